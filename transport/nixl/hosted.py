"""``DataTransport`` whose NIXL agent lives in a supervised child process (the "transport host").

Role
    A NIXL or UCX failure with one peer must never take the daemon down. Measured in
    tests/peer/test_netns.py: a pulling daemon whose UCX address the serving daemon cannot route to
    (a multi-homed node with ``UCX_NET_DEVICES`` pinned to the other interface) made the serving
    daemon segfault inside UCX (exit -11) in 3 of 4 runs, within 60 ms of the pull; in the fourth
    the pull stalled for its whole timeout. So this transport spawns ``hkvd.transport.nixl.host``
    (fork + exec of this interpreter; this process never loads UCX), which maps the pool by its
    memfd and runs the agent. Calls and READs travel over a socketpair (``host_wire``).

Crash handling
    The host's death is seen as EOF on the pipe. Once the process is reaped (its RDMA registrations
    are gone with it, so nothing can write into the pool any more), every READ in flight settles
    with ``CopyFailedError`` naming the crash and every pending call fails; ``on_crash`` tells the
    owner (it logs the peers linked at the time and counts it), and ``supervise`` starts a new host
    after ``RESTART_BACKOFF_S`` (doubling up to ``RESTART_BACKOFF_MAX_S`` while it keeps dying
    within ``STABLE_S``). The new host has a new agent name (``agent_name`` ends in its generation)
    and new metadata, handed to ``on_restart``: peers must load it again. Until it is up, ``read``
    fails at once and ``add_peer`` raises ``TransportUnavailable``: pulls recompute, never wait.
    A call the host does not answer within its budget kills it (a wedged agent is restarted too).

Addresses
    The host maps the pool at an address of its own, so descriptors are translated: local ones by
    this host's offset, remote ones by the offset the serving daemon put in its metadata
    (``host_wire.wrap_metadata``). Callers keep using their own pool addresses.

Threading
    Event loop only: the pipe is an asyncio protocol (no thread, no task but ``supervise``).

Lifecycle
    ``start`` (spawn, agent up) -> ``register`` -> ``supervise`` (in the owner's TaskGroup) ->
    ``aclose`` (closes the pipe; the host closes its agent and exits; after ``timeout_s`` it is
    killed). Only after ``aclose`` returned may the pool be unmapped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hkvd.transport.base import DataTransport, Desc, ReadCounters, Transfer, TransportStats
from hkvd.transport.errors import CopyFailedError, InternalError, KVError, KVTimeout, error_from_wire
from hkvd.transport.nixl.agent import PROGRESS_DELAY_US, TransportUnavailable
from hkvd.transport.nixl.host_wire import (
    CALL,
    ERR,
    OK,
    READ,
    SETTLED,
    Decoder,
    FrameError,
    encode,
    pack_descs,
    unwrap_metadata,
    wrap_metadata,
)

log = logging.getLogger("hkvd.transport_host")

# Spawning imports numpy and NIXL and creates the agent: 1-3 s on a loaded 2-core machine.
SPAWN_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 10.0
REGISTER_TIMEOUT_S = 60.0  # pinning a large pool for RDMA takes seconds per 100 GiB
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a host that lived this long resets the backoff
REAP_POLL_S = 0.01
OUTPUT_LINES = 32  # of the host's output kept to name the error that preceded a crash
# Lines of UCX (``UCX  ERROR``), NIXL's glog (``E1123 ...``) or ours that report an error.
_ERROR_MARKS = (b" ERROR ", b"level=error", b"Segmentation", b"Aborted")


class HostMemory(NamedTuple):
    """The memory the host maps: ``nbytes`` of the memfd ``fd``, mapped here at ``addr``."""

    fd: int
    addr: int
    nbytes: int


class HostCrash(NamedTuple):
    """What ``on_crash`` is told: which host died, how, and what was in flight with whom."""

    pid: int
    generation: int
    returncode: int
    reads_failed: int
    peers_in_flight: tuple[str, ...]
    peers_loaded: tuple[str, ...]
    uptime_s: float
    last_error: str  # the host's last error line (UCX names the address it could not reach), or ""

    @property
    def how(self) -> str:
        if self.returncode < 0:
            with contextlib.suppress(ValueError):
                return f"signal {signal.Signals(-self.returncode).name}"
            return f"signal {-self.returncode}"
        return f"exit status {self.returncode}"


@dataclass(slots=True)
class _Child:
    """One generation of the host: its process and pipe, and what is outstanding there."""

    generation: int
    proc: subprocess.Popen[bytes]
    agent: str
    started_at: float
    pipe: asyncio.Transport | None = None
    base: int = 0  # where the host mapped the pool
    calls: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    reads: dict[int, Transfer] = field(default_factory=dict)
    peers: dict[str, int] = field(default_factory=dict)  # NIXL name -> remote address offset
    up: bool = False  # agent started and memory registered
    serving: bool = False  # and its metadata handed to the owner (``on_restart``): peers can load it
    lost: bool = False
    killed_for: str = ""  # we killed it (reset, stuck, bad frame): a restart, not a crash
    output: collections.deque[bytes] = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES))

    def last_error(self) -> str:
        for line in reversed(self.output):
            if any(m in line for m in _ERROR_MARKS) or (line[:1] in (b"E", b"F") and line[1:5].isdigit()):
                return line.decode(errors="replace").strip()
        return ""


class _Output(asyncio.Protocol):
    """The host's stdout and stderr (UCX and NIXL log there): copied to ours line by line, the last
    ``OUTPUT_LINES`` kept so a crash report can quote the error that preceded it."""

    def __init__(self, child: _Child) -> None:
        self.child = child
        self.partial = b""

    def data_received(self, data: bytes) -> None:
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self.child.output.append(line)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(line + b"\n")
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()


class _Pipe(asyncio.Protocol):
    def __init__(self, owner: HostedTransport, child: _Child) -> None:
        self.owner = owner
        self.child = child
        self.decoder = Decoder()

    def data_received(self, data: bytes) -> None:
        try:
            for msg in self.decoder.feed(data):
                self.owner._on_message(self.child, msg)
        except (FrameError, ValueError, IndexError, TypeError) as e:
            log.error("the transport host (pid %d) sent a bad frame (%s); restarting it", self.child.proc.pid, e)
            self.owner._kill(self.child, f"it sent a bad frame ({e})")

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._on_lost(self.child)


class HostedTransport(DataTransport):
    """See the module docstring. Not thread-safe: call from the event loop that ran ``start``."""

    name = "nixl-host"

    def __init__(self, agent_name: str, memory: HostMemory, *, backends: Sequence[str] = ("UCX",),
                 progress_delay_us: int = PROGRESS_DELAY_US,
                 on_restart: Callable[[bytes], Awaitable[None]] | None = None,
                 on_crash: Callable[[HostCrash], None] | None = None) -> None:
        self.base_name = agent_name
        self.agent_name = agent_name
        self.memory = memory
        self.backends = tuple(backends)
        self.progress_delay_us = progress_delay_us
        self.on_restart = on_restart
        self.on_crash = on_crash
        self.generation = 0
        self.restarts = 0
        self._child: _Child | None = None
        self._registered: list[tuple[int, int]] = []  # (offset in the pool, bytes)
        self._lost = asyncio.Event()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._call_ids = itertools.count(1)
        self._xfer_ids = itertools.count(1)
        self._counts = ReadCounters()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        if self._child is not None:
            raise RuntimeError("HostedTransport.start called twice")
        self._loop = asyncio.get_running_loop()
        await self._spawn(timeout_s)

    async def _spawn(self, timeout_s: float) -> None:
        """A new host generation: process, pipe, agent, and the memory registered so far."""
        self.generation += 1
        agent = f"{self.base_name}-h{self.generation}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        level = logging.getLevelName(logging.getLogger("hkvd").getEffectiveLevel()).lower()
        try:
            # Popen returns once exec started (1-2 ms); an asyncio subprocess would add a watcher thread.
            proc = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "hkvd.transport.nixl.host", "--sock", str(theirs.fileno()), "--mem",
                 str(self.memory.fd), "--size", str(self.memory.nbytes), "--log-level", level],
                pass_fds=(theirs.fileno(), self.memory.fd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, close_fds=True)
        except OSError as e:
            ours.close()
            raise TransportUnavailable(f"cannot start the NIXL transport host ({e}); check that {sys.executable} "
                                       "runs and the pool's memfd is open") from None
        finally:
            theirs.close()
        child = _Child(self.generation, proc, agent, time.monotonic())
        self._child = child
        loop = asyncio.get_running_loop()
        child.pipe, _ = await loop.create_unix_connection(lambda: _Pipe(self, child), sock=ours)
        assert proc.stdout is not None
        await loop.connect_read_pipe(lambda: _Output(child), proc.stdout)
        log.info("transport host %d (pid %d) starting NIXL agent %s", child.generation, proc.pid, agent)
        child.base = int(await self._call(child, "start", [agent, list(self.backends), self.progress_delay_us],
                                          timeout_s, "starting the NIXL agent in the transport host"))
        for offset, nbytes in self._registered:
            await self._call(child, "register", [offset, nbytes], REGISTER_TIMEOUT_S,
                             f"registering {nbytes >> 20} MiB with NIXL")
        self.agent_name = agent
        child.up = True
        child.serving = self.generation == 1  # a restarted one serves once on_restart has its metadata

    async def supervise(self) -> None:
        """Restart the host whenever it dies; returns when ``aclose`` is called."""
        backoff = RESTART_BACKOFF_S
        while True:
            await self._lost.wait()
            if self._closed:
                return
            self._lost.clear()
            old = self._child
            if old is not None and time.monotonic() - old.started_at >= STABLE_S:
                backoff = RESTART_BACKOFF_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
            if self._closed:
                return
            try:
                await self._spawn(SPAWN_TIMEOUT_S)
                md = await self.metadata()
            except KVError as e:
                log.error("restarting the transport host failed (%s); trying again in %.1f s", e.message, backoff)
                if self._child is not None and not self._child.lost:
                    self._kill(self._child, f"its start failed ({e.message})")
                self._lost.set()
                continue
            self.restarts += 1
            log.warning("transport host %d is up (agent %s); peers reload its metadata on their next pull",
                        self.generation, self.agent_name)
            if self.on_restart is not None:
                await self.on_restart(md)
            if self._child is not None and self._child.up:
                self._child.serving = True

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Close the pipe; the host closes its agent (READs in flight settle or are cut off) and
        exits. Killed if it has not after ``timeout_s``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._lost.set()
        child = self._child
        if child is None:
            return
        if child.pipe is not None:
            child.pipe.close()
        try:
            await asyncio.to_thread(child.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            log.error("the transport host (pid %d) did not exit within %.0f s; killing it", child.proc.pid, timeout_s)
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait)
        self._fail_outstanding(child, "hkvd is shutting down")

    def reset(self, reason: str) -> bool:
        """Kill the host (READs in flight settle, failed, once it is reaped); ``supervise`` restarts it."""
        child = self._child
        if self._closed or child is None or child.lost:
            return child is not None and not self._closed  # already going: its READs settle with it
        log.warning("killing the transport host %d (pid %d): %s", child.generation, child.proc.pid, reason)
        self._kill(child, reason)
        return True

    # ---- calls ---------------------------------------------------------------------------------
    def _current(self, what: str) -> _Child:
        child = self._child
        if self._closed or child is None or child.lost:
            state = "closed" if self._closed else "restarting after a crash"
            raise TransportUnavailable(f"{what}: the NIXL transport host is {state}; pulls recompute until it is up")
        return child

    async def _call(self, child: _Child, op: str, args: list[object], timeout_s: float, what: str) -> Any:
        if child.lost or child.pipe is None:
            raise TransportUnavailable(f"{what}: the NIXL transport host is restarting after a crash")
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        child.calls[call_id] = fut
        child.pipe.write(encode([CALL, call_id, op, *args]))
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            log.error("the transport host (pid %d) did not answer %s within %.0f s; restarting it", child.proc.pid,
                      op, timeout_s)
            self._kill(child, f"it did not answer {op} within {timeout_s:.0f} s")
            raise KVTimeout(f"{what} took longer than {timeout_s:.0f} s (the transport host was stuck and is "
                            "restarted)") from None
        finally:
            child.calls.pop(call_id, None)

    async def register(self, addr: int, nbytes: int) -> None:
        m = self.memory
        offset = addr - m.addr
        if offset < 0 or offset + nbytes > m.nbytes:
            raise InternalError(f"register [{addr:#x}, +{nbytes}) is outside the memory the transport host maps "
                                f"([{m.addr:#x}, +{m.nbytes}))")
        child = self._current("registering memory")
        await self._call(child, "register", [offset, nbytes], REGISTER_TIMEOUT_S,
                         f"registering {nbytes >> 20} MiB with NIXL")
        self._registered.append((offset, nbytes))

    async def metadata(self) -> bytes:
        child = self._current("exporting metadata")
        md = await self._call(child, "metadata", [], CALL_TIMEOUT_S, "exporting metadata")
        return wrap_metadata(bytes(md), child.base - self.memory.addr)

    async def add_peer(self, metadata: bytes) -> str:
        child = self._current("loading a peer's NIXL metadata")
        md, offset = unwrap_metadata(metadata)
        name = str(await self._call(child, "add_peer", [md], CALL_TIMEOUT_S, "loading a peer's NIXL metadata"))
        child.peers[name] = offset
        return name

    async def remove_peer(self, peer: str) -> None:
        child = self._child
        if self._closed or child is None or child.lost or child.peers.pop(peer, None) is None:
            return
        with contextlib.suppress(KVError):
            await self._call(child, "remove_peer", [peer], CALL_TIMEOUT_S, f"removing peer {peer}")

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, peer: str, descs: Sequence[Desc]) -> Transfer:
        assert self._loop is not None, "start() first"
        fut: asyncio.Future[int] = self._loop.create_future()
        t = Transfer(next(self._xfer_ids), peer, sum(d.nbytes for d in descs), len(descs), fut, time.monotonic())
        self._counts.started()
        fut.add_done_callback(lambda f: self._on_settled(t))
        child = self._child
        if self._closed or child is None or child.lost or not child.up:
            fut.set_exception(TransportUnavailable(
                f"READ from {peer}: the NIXL transport host is {'closed' if self._closed else 'restarting'}; the "
                "engine recomputes"))
            return t
        offset = child.peers.get(peer)
        if offset is None:
            # A name loaded into an earlier host: that agent died with it.
            fut.set_exception(CopyFailedError(f"READ from {peer}: that peer was loaded into a transport host that "
                                              "has since restarted; the link reconnects on the next pull"))
            return t
        if not descs or any(d.nbytes <= 0 or d.local_addr <= 0 or d.remote_addr <= 0 for d in descs):
            fut.set_exception(CopyFailedError(f"READ from {peer}: empty list or a descriptor with no bytes"))
            return t
        local = child.base - self.memory.addr
        moved = [Desc(d.remote_addr + offset, d.local_addr + local, d.nbytes) for d in descs]
        child.reads[t.xfer_id] = t
        assert child.pipe is not None
        child.pipe.write(encode([READ, t.xfer_id, peer, pack_descs(moved)]))
        return t

    def _on_settled(self, t: Transfer) -> None:
        self._counts.settled(t)

    def statistics(self) -> TransportStats:
        child = self._child
        peers = len(child.peers) if child is not None else 0
        return self._counts.statistics(peers, host_restarts=self.restarts,
                                       host_pid=child.proc.pid if child and child.serving else 0)

    # ---- the pipe ------------------------------------------------------------------------------
    def _on_message(self, child: _Child, msg: list[Any]) -> None:
        kind = msg[0]
        if kind in (OK, ERR):
            fut = child.calls.get(int(msg[1]))
            if fut is None or fut.done():
                return  # its caller timed out
            if kind == OK:
                fut.set_result(msg[2])
            else:
                fut.set_exception(error_from_wire(int(msg[2]), str(msg[3])))
        elif kind == SETTLED:
            t = child.reads.pop(int(msg[1]), None)
            if t is None or t.settled.done():
                return
            t.finished_at = time.monotonic()
            nbytes, code, message = int(msg[2]), int(msg[3]), str(msg[4])
            if code == 0:
                t.settled.set_result(nbytes)
            else:
                t.settled.set_exception(error_from_wire(code, message))
        else:
            raise FrameError(f"unexpected message kind {kind} from the transport host")

    def _kill(self, child: _Child, why: str) -> None:
        child.killed_for = child.killed_for or why
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
        if child.pipe is not None:
            child.pipe.close()

    def _on_lost(self, child: _Child) -> None:
        """The pipe closed: wait until the process is reaped, then fail what it left outstanding."""
        if child.lost:
            return
        child.lost = True
        child.up = child.serving = False
        assert self._loop is not None
        if self._closed:
            return  # aclose reaps it

        def reaped() -> None:
            if child.proc.poll() is None:
                self._loop.call_later(REAP_POLL_S, reaped)  # type: ignore[union-attr]
                return
            self._crashed(child)

        reaped()

    def _crashed(self, child: _Child) -> None:
        in_flight = tuple(sorted({t.peer for t in child.reads.values()}))
        crash = HostCrash(child.proc.pid, child.generation, child.proc.returncode, len(child.reads), in_flight,
                          tuple(sorted(child.peers)), time.monotonic() - child.started_at, child.last_error())
        if child.killed_for:
            self._fail_outstanding(child, f"the NIXL transport host was reset ({child.killed_for})")
            log.warning("transport host %d (pid %d) reset: %s; %d READs in flight failed; restarting it",
                        child.generation, crash.pid, child.killed_for, crash.reads_failed)
            self._lost.set()
            return
        self._fail_outstanding(child, f"the NIXL transport host died ({crash.how})")
        log.error("the NIXL transport host %d (pid %d, agent %s) died with %s after %.1f s; %d READs in flight "
                  "failed (peers: %s); last error before it: %s. Restarting it; the daemon keeps serving engines "
                  "and pulls recompute meanwhile", child.generation, crash.pid, child.agent, crash.how,
                  crash.uptime_s, crash.reads_failed, ", ".join(in_flight) or "none", crash.last_error or "none")
        if self.on_crash is not None:
            try:
                self.on_crash(crash)
            except Exception:
                log.exception("the transport host's on_crash callback failed")
        self._lost.set()

    def _fail_outstanding(self, child: _Child, why: str) -> None:
        for fut in child.calls.values():
            if not fut.done():
                fut.set_exception(TransportUnavailable(f"{why}; the call was not answered"))
        child.calls.clear()
        for t in child.reads.values():
            if not t.settled.done():
                t.finished_at = time.monotonic()
                t.settled.set_exception(CopyFailedError(
                    f"READ of {t.nbytes} bytes from {t.peer} failed: {why} (its bytes are discarded; the engine "
                    "recomputes)"))
        child.reads.clear()


def host_enabled() -> bool:
    """``HKVD_TRANSPORT_HOST=0`` runs NIXL inside the daemon (for comparisons; a UCX crash is then fatal)."""
    return os.environ.get("HKVD_TRANSPORT_HOST", "1") != "0"
