"""The daemon's error types: re-exported from the wire registry so both sides raise the same classes."""

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
    ShuttingDown,
    UnknownKVError,
    UnknownMessage,
    UnsupportedVersion,
    error_from_wire,
)

__all__ = [
    "Aborted", "Busy", "CopyFailedError", "DaemonUnavailable", "ErrorCode", "FrameTooLarge", "InternalError",
    "KVError", "KVTimeout", "LeaseExpired", "NotFound", "NotRegistered", "OutOfRange", "PermissionDenied",
    "PoolError", "PoolFull", "ProtocolViolation", "RegistrationError", "ShuttingDown", "UnknownKVError",
    "UnknownMessage", "UnsupportedVersion", "error_from_wire",
]
