"""An engine killed (SIGKILL) while the daemon copies for it is let go within a second, quietly.

- GPU path, on CPU: an in-process daemon (``Server`` + ``KVService``, as tests/unit/test_control_server.py
  builds it) whose copy engine is the host engine with one stand-in at the GPU boundary: a store that
  carries a step-end event waits on a ``threading.Event`` standing for that CUDA event, until the daemon
  calls ``abandon`` (then ``CopyFailedError``, as the CUDA engine's override ends it). The engine is a real
  child process, killed while the daemon waits; once with its socket closed by the kill, once with a
  forked child keeping the socket open (only the pidfd says it died).
- Host path: a real ``hkvd serve`` and the real host copy engine; the engine is killed while its 384 MiB
  store is in flight (the daemon's own ``copy_errors`` counter proves the kill landed before the copy ended).
- A copy thread that ends with an exception after its job timed out leaves no asyncio
  "Future exception was never retrieved" behind.

Each checks, within ``RELEASE_S`` of the kill, that the registration is gone and the copy thread has
returned, and that the daemon logged nothing at error level.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.in_process import in_process_service
from hkvd.daemon.server import Server
from hkvd.transport.copy_engine import Attachment, CopyResult, Direction, EngineProcess, Region, Segment
from hkvd.transport.errors import CopyFailedError, KVTimeout

ENGINE = Path(__file__).resolve().parent / "_gone_engine.py"
RELEASE_S = 1.0  # issue #36: a dead engine's registration and copy thread are let go within 1 s
STEP_EVENT_S = 20.0  # the stand-in's own bound on the wait (the CUDA engine's is copy_timeout_s)


class StepEventEngine(HostCopyEngine):
    """The host engine, with the GPU boundary stood in: a copy with ``wait_event`` waits on the engine's
    step event (a ``threading.Event`` here) and fails once the daemon abandons the attachment."""

    name = "step-event"

    def __init__(self, pool: HugePagePool) -> None:
        super().__init__(pool)
        self.waiting = threading.Event()  # a copy is waiting on the step event
        self.returned = threading.Event()  # ... and its thread has returned
        self.abandoned = 0

    def attach(self, pid: int | EngineProcess, regions: list[Region]) -> Attachment:
        att = super().attach(pid, regions)
        att.state["gone"] = threading.Event()
        return att

    def abandon(self, attachment: Attachment) -> None:
        self.abandoned += 1
        attachment.state["gone"].set()

    def copy_ordered(self, attachment: Attachment, segments: list[Segment], direction: Direction, *,
                     wait_event: bytes | None = None) -> CopyResult:
        if not wait_event:
            return super().copy_ordered(attachment, segments, direction)
        self.waiting.set()
        try:
            if attachment.state["gone"].wait(STEP_EVENT_S):
                raise CopyFailedError("the engine's step event will never complete: the engine is gone")
            raise KVTimeout(f"the engine's step event: not complete after {STEP_EVENT_S:.3f} s")
        finally:
            self.returned.set()


@contextlib.contextmanager
def in_process_daemon(copy_timeout_s: float = 30.0,
                      engine_type: type[HostCopyEngine] = StepEventEngine) -> Iterator[tuple[Server, Any, Any]]:
    with tempfile.TemporaryDirectory(prefix="hkvd-gone-", dir="/tmp") as d:
        cfg = DaemonConfig(socket_path=str(Path(d) / "s.sock"), chunk_size=16, l1_size_bytes=64 << 20,
                           hugepages="off")
        # One copy thread: "free" means a job submitted now runs at once.
        with in_process_service(cfg, make_engine=engine_type, threads=1) as parts:
            parts.service.copies.timeout_s = copy_timeout_s  # the config's is at least 30 s
            yield Server(cfg, parts.service), parts.copy_engine, parts.executor


async def until(pred: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``pred()`` held (on the loop, so the daemon keeps serving); AssertionError past the bound."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def spawn_engine(socket_path: str, mode: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(ENGINE), socket_path, mode, *extra], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ready_line(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"engine exited ({proc.wait(5)}): {proc.stderr.read().decode() if proc.stderr else ''}")
    return json.loads(line)


def quiet_log(records: list[logging.LogRecord]) -> None:
    """No error-level line, and no asyncio "never retrieved" report (collected futures report at GC)."""
    gc.collect()
    loud = [f"{r.name}: {r.getMessage()}" for r in records
            if r.levelno >= logging.ERROR or "never retrieved" in r.getMessage()]
    assert not loud, loud


@pytest.mark.parametrize("keep_socket", [False, True], ids=["socket-closes", "forked-child-keeps-socket"])
async def test_killed_engine_waiting_on_its_step_event_is_let_go(keep_socket: bool, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    loop = asyncio.get_running_loop()
    with in_process_daemon() as (srv, engine, executor):
        await srv.start()
        proc = spawn_engine(srv.cfg.socket_path, "event", *(["--fork"] if keep_socket else []))
        child = 0
        try:
            child = (await loop.run_in_executor(None, ready_line, proc))["child"]
            await until(engine.waiting.is_set, 30)
            assert srv.service.registry.engines() and not engine.returned.is_set()
            proc.kill()
            await loop.run_in_executor(None, proc.wait)
            waited = await until(lambda: not srv.service.registry.engines() and not srv.connections
                                 and engine.returned.is_set(), RELEASE_S)
            # The one copy thread is free: a job handed to it now runs at once.
            await asyncio.wait_for(loop.run_in_executor(executor, lambda: None), RELEASE_S)
            assert engine.abandoned == 1
            assert srv.service.metrics.total("copy_timeouts") == 0
        finally:
            if child:
                os.kill(child, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            await srv.stop_accepting()
            srv.close_connections()
    assert waited <= RELEASE_S
    quiet_log(caplog.records)


async def test_a_copy_thread_failing_after_its_job_timed_out_is_no_unretrieved_future(caplog: Any) -> None:
    """The daemon's timeout (here 0.2 s) ends the job first; the thread then fails (the engine's own
    timeout, as the CUDA engine's step-event wait does): its exception is retrieved, never reported."""
    caplog.set_level(logging.DEBUG)

    class SlowFailing(StepEventEngine):
        def copy_ordered(self, attachment: Attachment, segments: list[Segment], direction: Direction, *,
                         wait_event: bytes | None = None) -> CopyResult:
            time.sleep(0.5)
            self.returned.set()
            raise KVTimeout("the engine's step event: not complete after 0.500 s")

    loop = asyncio.get_running_loop()
    with in_process_daemon(copy_timeout_s=0.2, engine_type=SlowFailing) as (srv, engine, _executor):
        await srv.start()
        proc = spawn_engine(srv.cfg.socket_path, "event")
        try:
            await loop.run_in_executor(None, ready_line, proc)
            await until(lambda: srv.service.metrics.total("copy_timeouts") == 1 and engine.returned.is_set(), 30)
            await asyncio.sleep(0.05)  # the thread's outcome reaches the loop
        finally:
            proc.kill()
            proc.wait()
            await srv.stop_accepting()
            srv.close_connections()
            await asyncio.sleep(0.05)
    gc.collect()
    await asyncio.sleep(0)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_host_engine_killed_mid_copy_is_let_go(daemon_factory: Any) -> None:
    """The real host copy engine: the kill lands while a 384 MiB store is in flight (up to 5 tries)."""
    d = daemon_factory("--l1-size-gb", "0.5", "--chunk-size", "16")
    caught = 0
    for _ in range(5):
        before = d.status()["counters"].get("copy_errors", 0)
        proc = spawn_engine(d.socket_path, "big")
        try:
            ready_line(proc)
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            d.wait_status(lambda st: st["index"]["writing"] > 0, 30, poll_s=0.001)
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            st = d.wait_status(lambda st: not st["engines"] and st["index"]["writing"] == 0, RELEASE_S * 5,
                               poll_s=0.005)
            waited = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # The registration goes only after the copy's job ended, i.e. once the copy thread returned.
        assert waited <= RELEASE_S, f"released only after {waited:.2f} s"
        if st["counters"].get("copy_errors", 0) > before:  # the copy saw the process gone: killed mid-copy
            caught += 1
            break
    assert caught, "no kill landed while the store's copy was in flight"
    log = d.log()
    assert "level=error" not in log and "never retrieved" not in log, log[-3000:]
