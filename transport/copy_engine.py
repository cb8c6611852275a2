"""The copy-engine interface: the one place that knows *how* bytes move.

Role
    The daemon decides *what* to copy (index, leases, step ordering, peers). A copy engine
    only moves bytes between an engine's registered memory and the daemon's pool. The host
    engine (``hkvd.daemon.engines.host_engine``) uses process_vm_readv/writev; the CUDA engine
    (``hkvd.cuda.copy``) uses IPC handles and batched copies on its own stream. Nothing else
    in the daemon may know which one is in use.

Threading model
    ``attach``/``detach`` run on the event loop and must be quick. ``copy`` is blocking and
    runs on the daemon's copy thread pool, except a copy of at most ``inline_max_bytes``
    (0 unless the engine sets it): that one runs on the loop, because handing it to a thread and
    back costs more loop time than the copy itself (a few tens of microseconds of kernel copy
    against two thread wake-ups). Engines whose copies can block on a device never set it.

Contracts
    - A ``Segment`` addresses bytes by (region id, offset inside that region) on the engine
      side and by an offset inside the pool on the daemon side. Bounds are checked by the
      caller against the registered region sizes *before* a segment reaches an engine; an
      engine still refuses segments that leave a region (defence in depth).
    - ``copy`` either moves every byte or raises a ``KVError``; a partial copy is an error.
    - ``detach`` is idempotent and releases everything ``attach`` opened (IPC handles).
    - ``abandon`` is called on the loop as soon as the daemon learns the engine process is gone
      (its pidfd readable, or its connection ended): copies that wait on the engine (its step
      event) must end soon with ``CopyFailedError``; the daemon detaches once they have ended.
    - ``copy_ordered`` adds event ordering where the engine has events (CUDA): wait for the
      engine's ``wait_event`` before reading, and return the handle of an event recorded after
      writing. Engines without events refuse a ``wait_event`` (the shim would be asking for an
      ordering nobody provides) and return ``done_event=b""``.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Self

from hkvd.transport.errors import CopyFailedError, ProtocolViolation


class EngineProcess(Protocol):
    """The engine process a registration came from (the daemon's pinned ``ClientProcess``)."""

    pid: int


class Direction(enum.Enum):
    TO_POOL = "store"  # engine blocks -> pool pages
    FROM_POOL = "retrieve"  # pool pages -> engine blocks


@dataclass(frozen=True, slots=True)
class Region:
    """One backing allocation of an engine, as registered.

    kind "host": ``addr`` is a virtual address in the engine process (pid from SO_PEERCRED).
    kind "cuda": ``handle`` is a cudaIpcMemHandle (64 bytes), ``device_uuid`` the GPU's UUID,
    ``offset`` the tensor's offset inside the IPC allocation.
    """

    region_id: int
    kind: str
    size: int
    addr: int = 0
    handle: bytes = b""
    device_uuid: str = ""
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Segment:
    region_id: int
    region_offset: int
    pool_offset: int
    nbytes: int


def host_iovecs(segments: list[Segment], regions: Mapping[int, Region], pool_base: int,
                pool_size: int) -> tuple[list[int], list[int], int]:
    """Check every segment against its host region and the pool, then the flat ``(pool, engine, bytes)``
    address lists of a host copy: ``[base0, len0, base1, len1, ...]`` at ``pool_base`` in the pool, the same at
    each region's ``addr`` in the engine. One pass; ``CopyFailedError`` before any address is used where a
    segment names an unregistered region or leaves one, or the pool. Zero-length segments take no entry."""
    local: list[int] = []
    remote: list[int] = []
    total = 0
    for s in segments:
        n, ro, po = s.nbytes, s.region_offset, s.pool_offset
        region = regions.get(s.region_id)
        if region is None:
            raise CopyFailedError(f"segment names region {s.region_id}, which is not registered")
        if n < 0 or ro < 0 or ro + n > region.size:
            raise CopyFailedError(f"segment [{ro}, +{n}) leaves region {s.region_id} ({region.size} bytes)")
        if po < 0 or po + n > pool_size:
            raise CopyFailedError(f"segment [{po}, +{n}) leaves the pool ({pool_size} bytes)")
        if n:
            local += (pool_base + po, n)
            remote += (region.addr + ro, n)
            total += n
    return local, remote, total


class CopyResult(NamedTuple):
    nbytes: int
    done_event: bytes = b""  # IPC handle of an event recorded after the copy; b"" if the engine has none


@dataclass(slots=True)
class Attachment:
    """What an engine opened for one registered engine; opaque to the rest of the daemon."""

    pid: int
    regions: dict[int, Region]
    state: dict[str, Any] = field(default_factory=dict)


class EnqueuedCopy(Protocol):
    """A copy a device finishes after ``CopyEngine.submit`` returned (``hkvd.cuda.completion.CopyTicket``).

    ``result.nbytes`` is known at once, ``result.done_event`` once the copy is enqueued. It is settled
    once: its done callbacks run (on the engine's own thread) when the device finished it or it
    failed; a failure after it was enqueued carries ``PagesInUse`` (``hkvd.transport.errors``)."""

    @property
    def result(self) -> CopyResult: ...

    def exception(self) -> BaseException | None: ...

    def add_done_callback(self, fn: Callable[[Self], None]) -> None: ...

    def add_finished_callback(self, fn: Callable[[Self], None]) -> None:
        """``fn(copy)`` once the device will never touch the copy's memory again (perhaps never, after
        a device fault)."""

    @property
    def gpu_finished(self) -> threading.Event: ...


class CopyEngine(ABC):
    """Moves bytes between registered engine memory and the pool. See the module docstring."""

    name: str = "abstract"
    inline_max_bytes: int = 0  # copies up to this size run on the event loop (see the module docstring)
    # True: ``submit`` enqueues a copy on a device and returns at once, so a copy thread is not held
    # while the device moves the bytes (the CUDA engine). False: ``copy_ordered`` on a copy thread.
    enqueues: bool = False

    @abstractmethod
    def attach(self, pid: int | EngineProcess, regions: list[Region]) -> Attachment:
        """Open or verify access to the regions of the engine process ``pid`` (pinned, or a bare pid).

        Raises ``RegistrationError`` (with the fix in its message) when access is refused.
        """

    @abstractmethod
    def detach(self, attachment: Attachment) -> None:
        """Release what ``attach`` opened. Idempotent."""

    @abstractmethod
    def copy(self, attachment: Attachment, segments: list[Segment], direction: Direction) -> int:
        """Move every segment; return the bytes moved. Blocking; runs on a copy thread."""

    def copy_ordered(self, attachment: Attachment, segments: list[Segment], direction: Direction, *,
                     wait_event: bytes | None = None) -> CopyResult:
        """``copy`` ordered after ``wait_event`` (see the module docstring). Blocking."""
        if wait_event:
            raise ProtocolViolation(f"the {self.name} copy engine has no GPU events; send stores without "
                                    "wait_event (host KV caches are final when the step returns)")
        return CopyResult(self.copy(attachment, segments, direction))

    def submit(self, attachment: Attachment, segments: list[Segment], direction: Direction, *,
               wait_event: bytes | None = None) -> EnqueuedCopy:
        """Enqueue the copy (after ``wait_event``) and return without waiting for it; engines with
        ``enqueues`` only. Runs on a copy thread (building the copy costs CPU time)."""
        raise NotImplementedError(f"the {self.name} copy engine copies synchronously: use copy_ordered")

    def abandon(self, attachment: Attachment) -> None:  # noqa: B027 - optional hook
        """The engine process is gone: every copy of ``attachment`` that waits on the engine ends soon
        with ``CopyFailedError``. Runs on the event loop and must not block. Default: nothing (host
        copies of a process that exited fail by themselves). ``detach`` still follows, once the
        copies in flight have ended."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine-wide resources (streams, pinned registrations)."""
