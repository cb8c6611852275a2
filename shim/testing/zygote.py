"""A zygote for test engines: vLLM imported once per test session, each engine a fork of it.

Role
    A test engine (tests/shim/e2e_run.py and its siblings) is a script that builds ``vllm.LLM`` and prints a
    result line. Started as a fresh interpreter it first imports vLLM, torch and transformers: about 10 s
    on two cores, more than the engine's own start (about 5 s with the engine core in its process,
    ``vllm_cache.place_engine_core``). The zygote is a process that imports them once and then, for each
    engine, forks: the child is a new process with the imports done, an empty vLLM and an empty connector, and
    runs the script as ``__main__`` with the arguments and the environment the test gave it. Nothing of one
    engine outlives its child.

Protocol (one Unix socket, one connection per engine)
    The test sends one JSON line: ``{"argv": [script, *args], "env": {...}, "cwd": DIR}``. The zygote forks;
    the child's standard output and error are the connection. Its first line is ``HKVD_ZYGOTE_PID <pid>``;
    its last, when it exits by itself, ``HKVD_ZYGOTE_EXIT <code>``. A child killed by a signal ends the
    stream without that line.

Limits
    A fork keeps what the zygote's imports read from the environment at import time, so the zygote starts
    with the settings every engine shares (``HF_HUB_OFFLINE=1``); each child gets its own environment before
    the script runs, and vLLM reads its own variables when it needs them. The zygote refuses to fork once
    its imports started a thread (a fork copies a thread's locks, not the thread). An engine whose engine core
    or workers run in processes of their own (tensor parallelism, ``"processes": true``) forks them in turn
    where vLLM's start method is ``fork`` (``vllm_cache.forks_engine_processes``). A fork keeps the zygote's
    hash seed: an engine that needs its own ``PYTHONHASHSEED`` is started as a fresh interpreter.

One zygote per test session: ``session_zygote(env)`` starts it at its first use, ``stop_session_zygote()``
ends it (tests/conftest.py, at the session's end).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

#: Imported before the first fork: what every engine script imports (and vLLM's CPU worker and the tiny
#: models' classes, which the engine imports while it starts).
PRELOAD = ("torch", "transformers", "vllm", "vllm.inputs", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.qwen3_next",
           "vllm.model_executor.models.gemma3", "vllm.model_executor.models.llama", "hkvd.shim.connector",
           "hkvd.shim.testing.vllm_cache")

PID_LINE = "HKVD_ZYGOTE_PID "
EXIT_LINE = "HKVD_ZYGOTE_EXIT "
READY = "HKVD_ZYGOTE_READY"


# ---- the zygote process ----------------------------------------------------------------------------------

def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise SystemExit(f"hkvd zygote: the imports started threads {names}; forking would copy their locks")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print(READY, flush=True)
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as f:
            request = json.loads(f.readline())
            if os.fork() == 0:
                listener.close()
                _child(conn, request)  # never returns


def _child(conn: socket.socket, request: dict) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # the test kills the engine's group, its own children included
        for fd in (1, 2):
            os.dup2(conn.fileno(), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        print(f"{PID_LINE}{os.getpid()}", flush=True)
        sys.argv = list(request["argv"])
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(1, f"\n{EXIT_LINE}{code}\n".encode())
        os._exit(code)


# ---- the test's side -------------------------------------------------------------------------------------

class Zygote:
    """The zygote process of a test session: ``start()`` once, ``spawn(...)`` per engine, ``stop()``."""

    def __init__(self, workdir: Path, env: dict[str, str], start_timeout_s: float = 240.0) -> None:
        self.path = str(workdir / "zygote.sock")
        self.log = workdir / "zygote.log"
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Zygote:
        log = open(self.log, "wb")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen([sys.executable, "-m", "hkvd.shim.testing.zygote", self.path],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while READY not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the engine zygote did not start within {self.start_timeout_s:.0f} s:\n"
                                   f"{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)
        return self

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None,
              fork_timeout_s: float = 30.0) -> ForkedEngine:
        """Fork an engine that runs ``argv``; raise ``RuntimeError`` if the zygote has not forked it (its
        first line) within ``fork_timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"the engine zygote is not running (log: {self.log})")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(fork_timeout_s)  # the connection and the fork; the engine's output has no bound
        try:
            conn.connect(self.path)
            conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode() + b"\n")
            return ForkedEngine(conn)
        except TimeoutError as e:
            conn.close()
            raise RuntimeError(f"the engine zygote forked no engine within {fork_timeout_s:.0f} s "
                               f"(log: {self.log})") from e

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


_SESSION: list[Zygote] = []
_SESSION_LOCK = threading.Lock()  # engines started from several threads at once share one zygote


def engine_env(base: Mapping[str, str]) -> dict[str, str]:
    """A test engine's environment: ``base`` with the settings every engine of a session shares."""
    env = dict(base)
    # Identical thread binding in every compared run: vLLM's automatic binding reserves one
    # more core once a connector is configured, which moves bf16 logprobs.
    env["VLLM_CPU_OMP_THREADS_BIND"] = base.get("HKVD_TEST_OMP_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def fork_engine(argv: list[str], env: dict[str, str], session_env: Mapping[str, str]) -> ForkedEngine:
    """An engine that runs ``argv`` with ``env``, forked from the session's zygote (started at the first call
    with ``engine_env(session_env)``: the environment before any test changed it)."""
    return session_zygote(engine_env(session_env)).spawn(argv, env)


def session_zygote(env: dict[str, str]) -> Zygote:
    """This process's zygote, started with ``env`` at the first call (later calls return it as it is; calls from
    other threads meanwhile wait for it rather than start zygotes of their own)."""
    with _SESSION_LOCK:
        if not _SESSION:
            import tempfile

            _SESSION.append(Zygote(Path(tempfile.mkdtemp(prefix="hkvd-zygote-")), env).start())
        return _SESSION[0]


def stop_session_zygote() -> None:
    for z in _SESSION:
        z.stop()
    _SESSION.clear()


class ForkedEngine:
    """A forked engine, as the test sees it: its output lines, ``poll()``, ``kill()``, ``returncode``."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._file = conn.makefile("rb")
        first = self._file.readline().decode(errors="replace")
        if not first.startswith(PID_LINE):
            raise RuntimeError(f"the engine zygote did not fork an engine: {first!r}")
        self.pid = int(first[len(PID_LINE):])
        conn.settimeout(None)  # the caller bounds the engine's run (and kills it)
        self.returncode: int | None = None
        self._ended = threading.Event()

    def lines(self) -> Iterator[bytes]:
        """The engine's output, line by line, up to its exit (which sets ``returncode``)."""
        try:
            for line in self._file:
                if line.startswith(EXIT_LINE.encode()):
                    self.returncode = int(line[len(EXIT_LINE):])
                    continue
                yield line
        finally:
            if self.returncode is None:
                self.returncode = -signal.SIGKILL  # ended by a signal: no exit line
            self._file.close()
            self._conn.close()
            self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
