"""Shared pieces: a real ``hkvd serve`` subprocess, statistics, timed waits, results and plots."""

from __future__ import annotations

import json
import math
import os
import platform
import select
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hkvd.shim.testing.launcher import DaemonProcess, prefault_over, stop_process

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def human_bytes(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of ``xs``."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def machine() -> dict[str, Any]:
    """The machine, and its load when the run ended (shared machines: read ratios with it)."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "machine": platform.machine(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             check=False)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def readline_timeout(proc: subprocess.Popen[str], timeout_s: float, what: str) -> str:
    """One line from ``proc.stdout``, or RuntimeError after ``timeout_s`` (every wait has a timeout)."""
    assert proc.stdout is not None
    readable = select.poll()
    readable.register(proc.stdout, select.POLLIN)
    if not readable.poll(timeout_s * 1000.0):
        raise RuntimeError(f"{what}: no answer within {timeout_s:.0f} s")
    line = proc.stdout.readline()
    if not line:
        err = ""
        if proc.stderr is not None:
            try:
                proc.wait(2)
                err = proc.stderr.read()[-2000:]
            except subprocess.TimeoutExpired:
                pass
        raise RuntimeError(f"{what}: the process ended (rc {proc.poll()})\n{err}")
    return line


class Daemon(DaemonProcess):
    """A real ``hkvd serve`` on a private socket in a temporary directory.

    ``with Daemon(...)`` returns once the daemon serves and its pool's pre-fault has ended: the daemon
    serves after a first slice, and the rest is faulted by threads that would otherwise share the
    CPUs with what a bench times (measured: a 1.6 GiB pool takes 1.4 s on two threads on the 2-vCPU
    VM, the whole of the 1- and 8-page rows of ``store_retrieve``'s 2 MiB pages). A daemon serving
    engines pre-faults at start, before their traffic; a bench that wants the pre-fault in its figures
    passes ``wait_prefault=False``."""

    def __init__(self, *args: str, pool_gb: float = 1.0, hugepages: str = "auto",
                 wait_prefault: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="hkvd-bench-")
        self.wait_prefault = wait_prefault
        super().__init__(os.path.join(self.dir, "hkvd.sock"),
                         ["--l1-size-gb", str(pool_gb), "--hugepages", hugepages, "--log-level", "warning", *args],
                         Path(self.dir) / "hkvd.log")

    def __enter__(self) -> Daemon:
        self.start(60.0)
        try:
            if self.wait_prefault:
                self.wait_status(prefault_over, PREFAULT_TIMEOUT_S, poll_s=0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, 20.0)


# The benches' pools are at most 3.2 GiB (store_retrieve's 4 MiB pages): ~3 s at the 1.1 GB/s two pre-fault
# threads reached on the 2-vCPU VM; the rest is room for a loaded machine.
PREFAULT_TIMEOUT_S = 120.0


def engine_result(proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> tuple[dict[str, Any], str]:
    """Wait (at most ``timeout_s``) for a bench engine process whose stdout and stderr are one pipe, and return the
    object of its ``HKVD_BENCH {json}`` line and its whole output. ``RuntimeError`` names ``what`` with the
    output's tail when it runs past the time (it is stopped) or ends without that line."""
    lines: list[bytes] = []
    out = proc.stdout
    if out is None:
        raise ValueError(f"{what}: start it with stdout=subprocess.PIPE")
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, b"")), daemon=True)
    reader.start()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        reader.join(10)
        tail = b"".join(lines).decode(errors="replace")[-3000:]
        raise RuntimeError(f"{what} ran past {timeout_s:.0f} s:\n{tail}") from None
    reader.join(30)
    text = b"".join(lines).decode(errors="replace")
    for line in text.splitlines():
        if line.startswith("HKVD_BENCH "):
            return dict(json.loads(line[len("HKVD_BENCH "):])), text
    raise RuntimeError(f"{what} failed (rc {proc.returncode}):\n{text[-4000:]}")


def tree_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) spent so far by the processes ``pids`` and every descendant, living or
    reaped by its parent. A work's CPU time moves far less than its wall time when other processes share
    the machine, so a cost that is compute (a prefill) shows in it where wall-clock ratios drown."""
    import psutil  # vLLM's dependency: the benches that call this need vLLM

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def time_repeats(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def write_json(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, sort_keys=False, default=float) + "\n")
    return path


def try_pyplot() -> Any:
    """matplotlib.pyplot with a headless backend, or None (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v != v:  # nan
                return "-"
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
