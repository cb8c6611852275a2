"""The daemon's error types.

Request errors are the wire registry's (``hkvd.transport.errors``), re-exported so both sides raise
the same classes. ``StartupError`` is the base of everything that stops ``hkvd serve`` from
starting; ``hkvd serve`` catches it alone, prints it and exits with its ``exit_code``.
"""

from hkvd.transport.errors import (
    Aborted,
    Busy,
    CopyFailedError,
    DaemonUnavailable,
    ErrorCode,
    FrameTooLarge,
    InternalError,
    KVError,
    KVTimeout,
    LeaseExpired,
    NotFound,
    NotRegistered,
    OutOfRange,
    PermissionDenied,
    PoolError,
    PoolFull,
    ProtocolViolation,
    RegistrationError,
    ResourceExhausted,
    ShuttingDown,
    UnknownKVError,
    UnknownMessage,
    UnsupportedVersion,
    error_from_wire,
)


class StartupError(Exception):
    """``hkvd serve`` cannot start here as configured; the message names the fix.

    ``exit_code``: 2 for a configuration a user must change, 1 for what the machine lacks.
    """

    exit_code = 1


__all__ = [
    "Aborted", "Busy", "CopyFailedError", "DaemonUnavailable", "ErrorCode", "FrameTooLarge", "InternalError",
    "KVError", "KVTimeout", "LeaseExpired", "NotFound", "NotRegistered", "OutOfRange", "PermissionDenied",
    "PoolError", "PoolFull", "ProtocolViolation", "RegistrationError", "ResourceExhausted", "ShuttingDown",
    "StartupError", "UnknownKVError", "UnknownMessage", "UnsupportedVersion", "error_from_wire",
]
