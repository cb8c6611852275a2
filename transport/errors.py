"""Typed errors and their wire codes: one registry shared by the daemon and the client.

Every failure that crosses the wire travels as ``Error(req_id, code, message)``. The client turns
``code`` back into the ``KVError`` subclass registered for it, so callers catch types, never parse
strings. Codes are explicit and append-only; a duplicate code is a ``TypeError`` at import time, and
an unknown code (a newer daemon) becomes ``UnknownKVError`` rather than being dropped.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # for annotations only: copy_engine imports this module
    from hkvd.transport.copy_engine import EnqueuedCopy


class ErrorCode(enum.IntEnum):
    PROTOCOL_VIOLATION = 1
    UNSUPPORTED_VERSION = 2
    FRAME_TOO_LARGE = 3
    UNKNOWN_MESSAGE = 4
    NOT_REGISTERED = 10
    REGISTRATION = 11
    OUT_OF_RANGE = 12
    NOT_FOUND = 20
    LEASE_EXPIRED = 21
    POOL_FULL = 22
    COPY_FAILED = 30
    TIMEOUT = 31
    ABORTED = 32
    SHUTTING_DOWN = 40
    BUSY = 41
    PERMISSION = 42
    RESOURCE_EXHAUSTED = 43
    DAEMON_UNAVAILABLE = 50  # client-side only: never sent by the daemon
    INTERNAL = 99


_REGISTRY: dict[int, type[KVError]] = {}


class KVError(Exception):
    """Base of every hkvd error. Subclasses bind one ``code``."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            return  # an intermediate base that reuses its parent's code
        if cls.code in _REGISTRY:
            raise TypeError(f"error code {cls.code!r} registered twice: {_REGISTRY[cls.code]} and {cls}")
        _REGISTRY[cls.code] = cls

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message or self.__class__.__name__


class UnknownKVError(KVError):
    """An error code this client does not know (the daemon is newer)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[code {code}] {message}")
        self.raw_code = code


class ProtocolViolation(KVError):
    code = ErrorCode.PROTOCOL_VIOLATION


class UnsupportedVersion(KVError):
    code = ErrorCode.UNSUPPORTED_VERSION


class FrameTooLarge(KVError):
    code = ErrorCode.FRAME_TOO_LARGE


class UnknownMessage(KVError):
    code = ErrorCode.UNKNOWN_MESSAGE


class NotRegistered(KVError):
    code = ErrorCode.NOT_REGISTERED


class RegistrationError(KVError):
    code = ErrorCode.REGISTRATION


class OutOfRange(KVError):
    code = ErrorCode.OUT_OF_RANGE


class NotFound(KVError):
    code = ErrorCode.NOT_FOUND


class LeaseExpired(KVError):
    code = ErrorCode.LEASE_EXPIRED


class PoolFull(KVError):
    code = ErrorCode.POOL_FULL


class CopyFailedError(KVError):
    code = ErrorCode.COPY_FAILED


class KVTimeout(KVError):
    code = ErrorCode.TIMEOUT


class Aborted(KVError):
    code = ErrorCode.ABORTED


class ShuttingDown(KVError):
    code = ErrorCode.SHUTTING_DOWN


class Busy(KVError):
    code = ErrorCode.BUSY


class PermissionDenied(KVError):
    code = ErrorCode.PERMISSION


class ResourceExhausted(KVError):
    """The daemon lacks what a new client needs (open-file descriptors); the message names the fix.

    Engines already served keep their share; the refused one runs without the cache and retries.
    """

    code = ErrorCode.RESOURCE_EXHAUSTED


class DaemonUnavailable(KVError):
    """The daemon cannot be reached (down, restarting, wrong socket)."""

    code = ErrorCode.DAEMON_UNAVAILABLE


class InternalError(KVError):
    code = ErrorCode.INTERNAL


class PoolError(InternalError):
    """The pool could not be created or configured (start-up only; travels as INTERNAL)."""


class PagesInUse:
    """Set on a failed copy's error as ``exc.pages_in_use`` when the GPU may still run that copy.

    Until ``until`` is set, the copy may still write (store) or read (retrieve) the pool pages it
    was given, and read or write the engine memory it was given: the caller must not free, reuse or
    unpin those pages before then. ``call_when_free(fn)`` calls ``fn()`` once they are free (at
    once if they already are) on the thread that learns it (a copy engine's completion thread):
    hop to the event loop from there. After a CUDA fault it may never be set (the driver runs no
    host function after an error in the context): the pages then stay held. ``PagesInUse.of(exc)``
    is None for an error after which nothing of the copy can run (the pages are free at once).
    """

    __slots__ = ("_add", "until")

    def __init__(self, until: threading.Event, add_callback: Callable[[Callable[[], None]], None]) -> None:
        self.until = until
        self._add = add_callback

    def is_free(self) -> bool:
        return self.until.is_set()

    def call_when_free(self, fn: Callable[[], None]) -> None:
        self._add(fn)

    @classmethod
    def until_finished(cls, copy: EnqueuedCopy) -> PagesInUse:
        """In use until ``copy`` (an ``EnqueuedCopy``: ``gpu_finished``, ``add_finished_callback``) is done
        with its memory on the device."""
        return cls(copy.gpu_finished, lambda fn: copy.add_finished_callback(lambda _copy: fn()))

    @staticmethod
    def of(exc: BaseException) -> PagesInUse | None:
        held = getattr(exc, "pages_in_use", None)
        return held if isinstance(held, PagesInUse) else None


def error_from_wire(code: int, message: str) -> KVError:
    cls = _REGISTRY.get(code)
    if cls is None:
        return UnknownKVError(code, message)
    return cls(message)
