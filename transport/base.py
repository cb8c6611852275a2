"""The data-transport interface: one-sided reads from a peer daemon's registered memory.

Role
    The peer link (``hkvd.daemon.peers.pulling`` / ``serving``) decides *what* to move: which
    leased pool entries of the serving daemon land in which freshly allocated entries of the
    pulling daemon. A ``DataTransport`` only moves the bytes: it registers the local pool, exports
    the metadata a peer needs to reach it, loads a peer's metadata, and READs lists of
    ``Desc(remote_addr, local_addr, nbytes)``. The daemon core never imports NIXL or UCX; it sees
    this interface (``hkvd.transport.nixl.agent`` implements it).

Threading
    Every method is called from the event loop and never blocks it: implementations run the
    library on threads of their own and hand results back with ``call_soon_threadsafe``.

Lifecycle
    ``start`` -> ``register`` (the pool, once) -> ``supervise`` (a task of the owner's, for the
    transport's lifetime) -> ``add_peer`` per peer -> ``read``... -> ``aclose`` (idempotent). A
    transport that recovers from library crashes (``hkvd.transport.nixl.hosted``) bumps ``generation``
    and changes ``agent_name`` and ``metadata`` when it does: names from an earlier ``add_peer``
    are then gone. Memory registered with a transport must stay mapped until ``aclose``
    has returned: a transport may still be writing into it until then.

Contracts
    - ``read`` returns a ``Transfer`` at once; it never raises for transport failures, which
      arrive through ``Transfer.settled``.
    - ``Transfer.settled`` resolves only when the transport will never touch the local bytes of
      that transfer again: to the bytes moved when it completed whole, or to a ``KVError`` when
      it failed. There is no partial success.
    - ``Transfer.wait(timeout_s)`` bounds the caller's wait. A timeout raises ``KVTimeout`` but
      does not make the local memory reusable: the caller keeps the destination pages out of
      use until ``settled`` resolves (``hkvd.daemon.peers.pulling`` quarantines them).
    - ``Transfer.abort`` records that nobody waits for the result any more. A transport that can
      cancel in flight does so; one that cannot (NIXL, see its module) still settles later.
    - ``reset`` makes every READ in flight settle now (a hosted transport kills its process) when
      the transport can; the owner uses it for READs that never end.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hkvd.transport.errors import KVTimeout
from hkvd.transport.stat_fields import status_only


class Desc(NamedTuple):
    """Move ``nbytes`` from ``remote_addr`` (peer's registered memory) to ``local_addr`` (ours)."""

    remote_addr: int
    local_addr: int
    nbytes: int


@dataclass(slots=True)
class Transfer:
    """One READ in flight. See the module docstring for what ``settled`` promises."""

    xfer_id: int
    peer: str
    nbytes: int
    descs: int
    settled: asyncio.Future[int]
    started_at: float
    # Set by the transport when it saw the transfer complete (time.monotonic()); 0 until then.
    finished_at: float = 0.0
    aborted: bool = False
    abort_reason: str = field(default="")

    async def wait(self, timeout_s: float) -> int:
        """The bytes moved; ``KVTimeout`` after ``timeout_s`` (the transfer may still be running)."""
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(self.settled)
        except TimeoutError:
            raise KVTimeout(f"READ of {self.nbytes} bytes from {self.peer} did not finish within "
                            f"{timeout_s:.1f} s") from None

    def abort(self, reason: str) -> None:
        """Nobody waits for this transfer any more (timeout, dead control link, shutdown)."""
        self.aborted = True
        self.abort_reason = reason


@dataclass(frozen=True, slots=True)
class TransportStats:
    """A transport's READ counters (``hkvd status``: ``peer.transport``)."""

    reads: int = status_only()
    reads_failed: int = status_only()
    reads_aborted: int = status_only()
    bytes_read: int = status_only()
    in_flight: int = status_only()
    peers: int = status_only()
    # transport hosts started after one died (``hkvd.transport.nixl.hosted``)
    host_restarts: int = status_only(default=0)
    host_pid: int = status_only(default=0)  # the transport host serving now; 0: in-process, or restarting


class ReadCounters:
    """A transport's READ counters: ``started`` when a READ is posted, ``settled`` when it ends."""

    def __init__(self) -> None:
        self.reads = self.failed = self.aborted = self.bytes = self.in_flight = 0

    def started(self) -> None:
        self.in_flight += 1

    def settled(self, t: Transfer) -> None:
        self.in_flight -= 1
        self.reads += 1
        if t.aborted:
            self.aborted += 1
        f = t.settled
        if f.cancelled() or f.exception() is not None:
            self.failed += 1
        else:
            self.bytes += f.result()

    def statistics(self, peers: int, **more: int) -> TransportStats:
        return TransportStats(reads=self.reads, reads_failed=self.failed, reads_aborted=self.aborted,
                              bytes_read=self.bytes, in_flight=self.in_flight, peers=peers, **more)


class DataTransport(ABC):
    """One-sided reads between registered memory of two daemons. See the module docstring."""

    name: str = "abstract"
    # This end's name in peer handshakes (``PeerWelcome.agent``), so a daemon can tell a link to itself.
    agent_name: str = ""
    # Bumped each time the library restarts after a crash (``hkvd.transport.nixl.hosted``): peer names
    # from ``add_peer`` of an earlier generation are gone, and peers must load our new metadata.
    generation: int = 0

    @abstractmethod
    async def start(self, timeout_s: float) -> None:
        """Bring the library up (threads, agent). Raises ``KVError`` with the fix when it cannot."""

    @abstractmethod
    async def register(self, addr: int, nbytes: int) -> None:
        """Make ``[addr, addr + nbytes)`` of this process readable by peers and writable by reads."""

    @abstractmethod
    async def metadata(self) -> bytes:
        """What a peer passes to its ``add_peer`` to read our registered memory (send it only to
        authenticated peers: it grants access to that memory)."""

    @abstractmethod
    async def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the name to pass to ``read``."""

    @abstractmethod
    async def remove_peer(self, peer: str) -> None:
        """Forget a peer (its daemon restarted, or the link closed). Idempotent."""

    @abstractmethod
    def read(self, peer: str, descs: Sequence[Desc]) -> Transfer:
        """Start one READ of every descriptor from ``peer`` into local registered memory."""

    @abstractmethod
    def statistics(self) -> TransportStats:
        """Counters for status and metrics."""

    def reset(self, reason: str) -> bool:
        """Drop the library's state now, so every READ in flight settles (failed) and none writes
        into local memory any more; ``supervise`` brings it back. False: this transport cannot."""
        return False

    async def supervise(self) -> None:
        """Run for the transport's lifetime (in the owner's TaskGroup) to recover from library
        crashes; returns after ``aclose``. Transports that cannot recover return at once."""
        return

    @abstractmethod
    async def aclose(self) -> None:
        """Stop; afterwards the library touches no registered memory. Idempotent."""
