"""Pool pre-fault: GB/s with 1, 2 and N threads against first-touch and memset; time to ready.

Rows, same run, same machine:
  - ``memset_warm``: ``buf[:] = 1`` on pages already faulted (the memory bandwidth ceiling);
  - ``first_touch_anon``: the same write on a fresh anonymous mapping (what a cold pool costs a copy);
  - ``prefault`` per backing (plain; thp and hugetlb where the bench runs as root: it sets
    ``shmem_enabled`` / reserves ``nr_hugepages`` and restores them) and per thread count: a
    ``HugePagePool(faulted_only=True)`` filled by ``prefault(threads)``;
  - ``ready``: ``hkvd serve`` to ``READY=1`` over a real NOTIFY_SOCKET, and to the end of the fill,
    for 1 GiB and 8 GiB plain pools (8 GiB is skipped when less than 12 GiB is available).
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.cache.prefault import default_threads

GIB = 1 << 30
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _memset_rates(size: int) -> tuple[float, float]:
    """(first touch of a fresh anonymous mapping, memset of the same pages once warm), GB/s."""
    m = mmap.mmap(-1, size)
    buf = np.frombuffer(m, dtype=np.uint8)
    t0 = time.perf_counter()
    buf[:] = 1
    cold = _gbps(size, time.perf_counter() - t0)
    t0 = time.perf_counter()
    buf[:] = 2
    warm = _gbps(size, time.perf_counter() - t0)
    del buf
    m.close()
    return cold, warm


@contextmanager
def _backing(kind: str, size: int) -> Iterator[bool]:
    """Set the machine up for ``kind`` (root only), restore after; yields whether it could."""
    if kind == "plain":
        yield True
        return
    if os.geteuid() != 0:
        yield False
        return
    if kind == "hugetlb":
        old = NR_HUGEPAGES.read_text().strip()
        try:
            NR_HUGEPAGES.write_text(str(int(old) + size // (2 << 20)))
            yield int(NR_HUGEPAGES.read_text()) >= int(old) + size // (2 << 20)
        finally:
            NR_HUGEPAGES.write_text(old)
        return
    text = SHMEM_ENABLED.read_text()
    old = text[text.index("[") + 1 : text.index("]")]
    try:
        SHMEM_ENABLED.write_text("advise")
        yield True
    finally:
        SHMEM_ENABLED.write_text(old)


def _prefault_rows(size: int, threads: list[int]) -> list[dict[str, Any]]:
    rows = []
    for kind in ("plain", "thp", "hugetlb"):
        with _backing(kind, size) as ok:
            if not ok:
                continue
            for n in threads:
                mode = "off" if kind == "plain" else ("require" if kind == "hugetlb" else "auto")
                with HugePagePool(size, mode, faulted_only=True) as pool:  # type: ignore[arg-type]
                    gbps = pool.prefault(threads=n)
                    got = pool.backing(refresh=True).kind
                rows.append({"what": "prefault", "backing": got, "threads": n, "size_bytes": size, "gbps": gbps})
    return rows


def _ready(size_gb: float) -> dict[str, Any]:
    """Seconds from spawn to READY=1 and to the end of the fill, over a real NOTIFY_SOCKET."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "notify.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(300)
        env = {**os.environ, "NOTIFY_SOCKET": path}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", os.path.join(tmp, "s"),
                                 "--l1-size-gb", str(size_gb), "--hugepages", "off", "--log-level", "warning"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ready_s = full_s = 0.0
        try:
            while not full_s:
                msg = sock.recv(4096).decode()
                now = time.perf_counter() - t0
                if "READY=1" in msg and not ready_s:
                    ready_s = now
                if "pool pre-faulted" in msg or "pre-fault failed" in msg:
                    full_s = now
        finally:
            proc.terminate()
            proc.wait(60)
            sock.close()
    return {"what": "ready", "size_bytes": int(size_gb * GIB), "ready_s": ready_s, "prefaulted_s": full_s}


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run(quick: bool = False, hugepages: str = "auto") -> dict[str, Any]:
    size = 256 << 20 if quick else GIB
    n = default_threads()
    threads = sorted({1, 2, n})
    cold, warm = _memset_rates(size)
    rows: list[dict[str, Any]] = [
        {"what": "memset_warm", "size_bytes": size, "gbps": warm},
        {"what": "first_touch_anon", "size_bytes": size, "gbps": cold},
        *_prefault_rows(size, threads),
    ]
    for gb in (0.25,) if quick else (1, 8):
        if gb * GIB * 1.5 > _available():
            continue
        rows.append(_ready(gb))
    return {"rows": rows, "summary": {"default_threads": n, "cores": os.cpu_count()}}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["what", "backing", "threads", "size", "GB/s", "ready s", "fully pre-faulted s"]
    out = []
    for r in result["rows"]:
        out.append([r["what"], r.get("backing", ""), r.get("threads", ""), f"{r['size_bytes'] / GIB:g} GiB",
                    f"{r['gbps']:.2f}" if "gbps" in r else "", f"{r['ready_s']:.2f}" if "ready_s" in r else "",
                    f"{r['prefaulted_s']:.2f}" if "prefaulted_s" in r else ""])
    return headers, out


def plot(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    return []
