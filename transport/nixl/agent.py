"""``DataTransport`` over NIXL with its UCX backend (extra ``[peer]``; install with ``--no-deps``).

Role
    Registers the daemon's pool with a NIXL agent, exports and loads agent metadata (carried by
    the peer control link, no NIXL listener or etcd), and runs one-sided READs of descriptor lists
    from a peer's pool into ours. NIXL bundles UCX with TCP, shared-memory, verbs, mlx5 and EFA
    transports; ``UCX_TLS`` / ``UCX_NET_DEVICES`` in the daemon's environment choose among them.

Threading
    One dedicated thread ("hkvd-nixl") owns the agent: it creates it, makes every NIXL call, and
    polls completions. NIXL's ``transfer()`` and ``check_xfer_state()`` can block the calling
    thread for a whole transfer (measured: 140-360 ms per GiB over shared memory, seconds over
    TCP), so they never run on the event loop. The loop submits commands through a queue and gets
    asyncio futures back, resolved with ``call_soon_threadsafe``. While transfers are in flight
    the thread polls with exponential backoff from ``POLL_MIN_S`` to ``POLL_MAX_S`` (a blocking
    queue wait, never a spin); with nothing in flight it sleeps on the queue. NIXL's own progress
    thread stays on: over TCP, RMA is emulated and the *target* must make progress, and with the
    progress thread off a READ from an idle daemon hung.

Cancellation (measured with nixl-cu12 1.5.1 over TCP)
    NIXL cannot stop a READ in flight: after ``release_xfer_handle`` on a running transfer, and
    after ``remove_remote_agent``, bytes kept landing in the destination for another second until
    the transfer had delivered all of them. So a transfer is never released early. An aborted or
    timed-out transfer keeps being polled, and ``Transfer.settled`` resolves only when NIXL reports
    it DONE or ERR (a dead peer is reported as ``NIXL_ERR_REMOTE_DISCONNECT``). Callers keep the
    destination pages out of use until then.

Fork safety
    Never fork after ``start``: UCX state does not survive it. The daemon does not load NIXL at all:
    it runs this transport in its transport host (``hkvd.transport.nixl.hosted``, fork + exec before
    any UCX); tools that start daemons must do so before creating a transport (or use spawn).

Remote addresses
    Metadata wrapped by a transport host (``host_wire.wrap_metadata``) carries the offset from the
    serving daemon's pool addresses to its host's; ``read`` adds it to every remote address.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from hkvd.transport.base import DataTransport, Desc, ReadCounters, Transfer, TransportStats
from hkvd.transport.errors import CopyFailedError, InternalError, KVTimeout
from hkvd.transport.nixl.host_wire import unwrap_metadata

if TYPE_CHECKING:  # numpy is imported where the reads are built
    import numpy as np

T = TypeVar("T")

log = logging.getLogger("hkvd.nixl")

NIXL_VERSION = "1.5.1"
INSTALL_HINT = (f"install NIXL with `pip install --no-deps nixl-cu12=={NIXL_VERSION}` (--no-deps: its metadata "
                "asks for torch, which would pull a CUDA build), or `make dev`")
# Polling while transfers are in flight: 50 us catches small transfers within a scheduler step;
# 2 ms caps the wake-ups of a long transfer at 500/s (about 1% of one core).
POLL_MIN_S = 50e-6
POLL_MAX_S = 2e-3
IDLE_WAKE_S = 1.0
# NIXL's UCX progress thread sleeps in poll() on the workers' event fds with this timeout (rounded
# up to whole ms). The Python API hard-codes 0, which makes poll() return at once: the thread spun
# at 56% of a core with no transfer at all. 1 ms keeps an idle daemon near 0% and costs nothing
# measurable: the fds wake the thread as soon as UCX has work.
PROGRESS_DELAY_US = int(os.environ.get("HKVD_NIXL_PROGRESS_DELAY_US", "1000"))
_DRAM = "DRAM"


class TransportUnavailable(InternalError):
    """The transport library is missing or cannot start (start-up only)."""


def load_nixl() -> ModuleType:
    """Import NIXL's Python API (``nixl_cu12``, or the ``nixl`` meta package); the error names the fix."""
    errors = []
    for name in ("nixl_cu12", "nixl"):
        try:
            module = __import__(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(module, "nixl_agent"):
            break
        errors.append(f"{name}: no nixl_agent")
    else:
        raise TransportUnavailable(f"peer links need NIXL ({'; '.join(errors)}); {INSTALL_HINT}")
    # NIXL logs to stdout through a handler of its own; send its records through ours instead.
    nixl_log = logging.getLogger("nixl")
    nixl_log.handlers.clear()
    nixl_log.propagate = True
    if nixl_log.level < logging.WARNING and not log.isEnabledFor(logging.DEBUG):
        nixl_log.setLevel(logging.WARNING)
    return module


@contextlib.contextmanager
def _progress_delay(nixl: ModuleType, delay_us: int) -> Iterator[None]:
    """Create agents with NIXL's progress-thread delay set to ``delay_us`` (see PROGRESS_DELAY_US).

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` and sets ``pthrDelay = 0`` itself, so the
    binding's constructor is wrapped for the duration of the call (only the transfer thread creates
    agents). If the API ever moves, the agent is created as NIXL does and a warning says so.
    """
    api = sys.modules.get(getattr(nixl.nixl_agent, "__module__", ""))
    bind: Any = getattr(api, "nixlBind", None)
    make = getattr(bind, "nixlAgent", None)
    if bind is None or make is None:
        log.warning("cannot set NIXL's progress-thread delay (NIXL API changed); its thread may spin")
        yield
        return

    def with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make(name, config)

    bind.nixlAgent = with_delay
    try:
        yield
    finally:
        bind.nixlAgent = make


@dataclass(slots=True)
class _Read:
    transfer: Transfer
    local: np.ndarray  # (N, 3) uint64: addr, len, device
    remote: np.ndarray
    handle: object = None  # NIXL's transfer handle, handed back to it


_STOP = object()


class NixlTransport(DataTransport):
    """See the module docstring. Not thread-safe: call from the event loop that ran ``start``."""

    name = "nixl"

    def __init__(self, agent_name: str, *, backends: Sequence[str] = ("UCX",), poll_min_s: float = POLL_MIN_S,
                 poll_max_s: float = POLL_MAX_S, progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        self.agent_name = agent_name
        self.progress_delay_us = progress_delay_us
        self.backends = tuple(backends)
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._closed = False
        # Loop-side counters (updated by the settled callbacks, on the loop).
        self._counts = ReadCounters()
        self._peers: set[str] = set()
        # Remote address offset per peer: a serving daemon whose agent runs in a transport host
        # hands out its own pool addresses (``hkvd.transport.nixl.hosted``).
        self._offsets: dict[str, int] = {}
        # Transfer-thread state: never touched from the loop.
        self._agent: Any = None
        self._regs: list[object] = []  # NIXL registrations, handed back to deregister_memory
        self._active: dict[int, _Read] = {}
        self._remove_later: set[str] = set()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        if self._thread is not None:
            raise RuntimeError("NixlTransport.start called twice")
        self._loop = asyncio.get_running_loop()
        nixl = load_nixl()
        self._thread = threading.Thread(target=self._run, name="hkvd-nixl", daemon=True)
        self._thread.start()
        await self._call(lambda: self._create_agent(nixl), timeout_s, "starting the NIXL agent")

    def _create_agent(self, nixl: ModuleType) -> None:
        cfg = nixl.nixl_agent_config(enable_prog_thread=True, backends=list(self.backends))
        with _progress_delay(nixl, self.progress_delay_us):
            agent = nixl.nixl_agent(self.agent_name, cfg)
        missing = [b for b in self.backends if b not in agent.backends]
        if missing:
            raise TransportUnavailable(f"NIXL has no {', '.join(missing)} backend here (plugins found: "
                                       f"{', '.join(agent.plugin_list) or 'none'}); reinstall nixl-cu12")
        self._agent = agent

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and destroy the agent. Transfers still running after ``timeout_s`` settle
        with an error; the agent's destruction tears their UCX endpoints down."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        done = asyncio.get_running_loop().create_future()
        self._cmds.put((_STOP, timeout_s, done))
        try:
            async with asyncio.timeout(timeout_s + 5.0):
                await done
        except TimeoutError:
            log.error("the NIXL thread did not stop within %.0f s (a transfer call is blocked)", timeout_s + 5.0)
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 5.0)

    # ---- control calls (run on the transfer thread) --------------------------------------------
    async def register(self, addr: int, nbytes: int) -> None:
        def reg() -> None:
            self._regs.append(self._agent.register_memory([(addr, nbytes, 0, "")], _DRAM))
        await self._call(reg, 60.0, f"registering {nbytes >> 20} MiB with NIXL")

    async def metadata(self) -> bytes:
        md: bytes = await self._call(lambda: bytes(self._agent.get_agent_metadata()), 10.0, "exporting metadata")
        return md

    async def add_peer(self, metadata: bytes) -> str:
        md, offset = unwrap_metadata(metadata)

        def add() -> str:
            name = self._agent.add_remote_agent(md)
            return name.decode() if isinstance(name, bytes) else str(name)

        peer: str = await self._call(add, 10.0, "loading a peer's NIXL metadata")
        self._peers.add(peer)
        self._offsets[peer] = offset
        return peer

    async def remove_peer(self, peer: str) -> None:
        if peer not in self._peers or self._closed:
            return
        self._peers.discard(peer)
        self._offsets.pop(peer, None)

        def remove() -> None:
            if any(r.transfer.peer == peer for r in self._active.values()):
                self._remove_later.add(peer)  # after its last transfer settles
            else:
                self._agent.remove_remote_agent(peer)

        await self._call(remove, 10.0, f"removing peer {peer}")

    async def _call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        if self._closed or self._thread is None or not self._thread.is_alive():
            raise TransportUnavailable(f"{what}: the NIXL transport is not running")
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put((fn, fut))
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise KVTimeout(f"{what} took longer than {timeout_s:.0f} s (the NIXL thread is busy or stuck)") from None

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, peer: str, descs: Sequence[Desc]) -> Transfer:
        import numpy as np

        assert self._loop is not None, "start() first"
        fut: asyncio.Future[int] = self._loop.create_future()
        total = sum(d.nbytes for d in descs)
        t = Transfer(next(self._ids), peer, total, len(descs), fut, time.monotonic())
        self._counts.started()
        fut.add_done_callback(lambda f: self._on_settled(t))
        if self._closed or self._thread is None:
            fut.set_exception(TransportUnavailable("the NIXL transport is closed"))
            return t
        if not descs or any(d.nbytes <= 0 or d.local_addr <= 0 or d.remote_addr <= 0 for d in descs):
            fut.set_exception(CopyFailedError(f"READ from {peer}: empty list or a descriptor with no bytes"))
            return t
        local = np.array([(d.local_addr, d.nbytes, 0) for d in descs], dtype=np.uint64)
        offset = self._offsets.get(peer, 0)
        remote = np.array([(d.remote_addr + offset, d.nbytes, 0) for d in descs], dtype=np.uint64)
        self._cmds.put(_Read(t, local, remote))
        return t

    def _on_settled(self, t: Transfer) -> None:
        self._counts.settled(t)

    def statistics(self) -> TransportStats:
        return self._counts.statistics(len(self._peers))

    # ---- the transfer thread -------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future[Any], value: object = None, exc: BaseException | None = None) -> None:
        def set_() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # RuntimeError: the loop is closed, nobody waits any more
            self._loop.call_soon_threadsafe(set_)

    def _run(self) -> None:
        backoff = self.poll_min_s
        while True:
            try:
                cmd = self._cmds.get(timeout=backoff if self._active else IDLE_WAKE_S)
            except queue.Empty:
                cmd = None
            progressed = False
            while cmd is not None:
                if isinstance(cmd, tuple) and cmd[0] is _STOP:
                    self._stop(cmd[1], cmd[2])
                    return
                self._do(cmd)
                progressed = True
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._active and self._poll():
                progressed = True
            backoff = self.poll_min_s if progressed else min(backoff * 2, self.poll_max_s)

    def _do(self, cmd: Any) -> None:
        if isinstance(cmd, _Read):
            self._post(cmd)
            return
        fn, fut = cmd
        try:
            self._resolve(fut, fn())
        except Exception as e:
            err = e if isinstance(e, InternalError | KVTimeout | CopyFailedError) else TransportUnavailable(
                f"NIXL call failed: {type(e).__name__}: {e}")
            self._resolve(fut, exc=err)

    def _post(self, r: _Read) -> None:
        t = r.transfer
        agent = self._agent
        try:
            r.handle = agent.initialize_xfer("READ", agent.get_xfer_descs(r.local, _DRAM),
                                             agent.get_xfer_descs(r.remote, _DRAM), t.peer)
        except Exception as e:  # nothing was posted: the destination is untouched
            self._resolve(t.settled, exc=CopyFailedError(f"NIXL refused the READ from {t.peer} ({t.descs} "
                                                         f"descriptors): {type(e).__name__}: {e}"))
            return
        error: Exception | None = None
        try:
            state = agent.transfer(r.handle)
        except Exception as e:
            state, error = "ERR", e
        self._active[t.xfer_id] = r
        self._settle_if_done(r, state, error)

    def _poll(self) -> bool:
        changed = False
        for r in list(self._active.values()):
            try:
                state, error = self._agent.check_xfer_state(r.handle), None
            except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer went away
                state, error = "ERR", e
            changed |= self._settle_if_done(r, state, error)
        return changed

    def _settle_if_done(self, r: _Read, state: str, error: BaseException | None) -> bool:
        if state == "PROC":
            return False
        t = r.transfer
        try:
            self._agent.release_xfer_handle(r.handle)
        except Exception as e:
            if state == "DONE":
                log.warning("releasing a finished NIXL transfer handle failed: %s", e)
            else:
                # NIXL still considers it active: keep polling; the destination may still change.
                log.debug("NIXL transfer %d failed but its handle is still active (%s); waiting", t.xfer_id, e)
                return False
        del self._active[t.xfer_id]
        t.finished_at = time.monotonic()
        if state == "DONE":
            self._resolve(t.settled, t.nbytes)
        else:
            why = f"{type(error).__name__}: {error}" if error is not None else "NIXL reported ERR"
            self._resolve(t.settled, exc=CopyFailedError(f"READ of {t.nbytes} bytes from {t.peer} failed: {why}"))
        if t.peer in self._remove_later and not any(x.transfer.peer == t.peer for x in self._active.values()):
            self._remove_later.discard(t.peer)
            try:
                self._agent.remove_remote_agent(t.peer)
            except Exception as e:
                log.debug("removing NIXL peer %s failed: %s", t.peer, e)
        return True

    def _stop(self, timeout_s: float, done: asyncio.Future[None]) -> None:
        deadline = time.monotonic() + timeout_s
        backoff = self.poll_min_s
        while self._active and time.monotonic() < deadline:
            if not self._poll():
                time.sleep(backoff)
                backoff = min(backoff * 2, self.poll_max_s)
        for r in list(self._active.values()):
            # The agent's destruction below closes the endpoints these transfers use.
            self._resolve(r.transfer.settled, exc=TransportUnavailable(
                f"hkvd is shutting down; READ {r.transfer.xfer_id} from {r.transfer.peer} was cut off"))
        self._active.clear()
        while True:  # commands that raced with the stop: fail them
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            fut = cmd.transfer.settled if isinstance(cmd, _Read) else cmd[-1]
            self._resolve(fut, exc=TransportUnavailable("the NIXL transport is closed"))
        agent, self._agent = self._agent, None
        if agent is not None:
            for reg in self._regs:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    log.debug("deregistering pool memory failed: %s", e)
            self._regs.clear()
            del agent  # the C++ agent (UCX workers, endpoints, progress thread) goes with it
        self._resolve(done, None)
