"""control_plane: descriptor round-trip latency (p50/p99) and ops/s with 1, 8 and 64 engines.

Every engine is a ``SyntheticEngine`` with its own connection and registration, closed loop
(next request once the previous completed). Engines run as threads in a few worker processes
(``bench.cp_worker``: 1 -> 1x1, 8 -> 2x4, 64 -> 4x16), so on a small machine the clients compete
with the daemon for the same cores: the figures are of the whole node, not of the daemon alone.

Reference, same run: a bare Unix-socket echo round trip (64 bytes, a child process that
echoes, blocking sockets), the floor any local request/reply protocol pays. LMCache's
multiprocess server is measured side by side only when ``--lmcache-venv DIR`` names a venv with
``lmcache`` installed (``make bench-peers`` makes one): see ``bench.lmcache_ping``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Daemon, median, percentile, readline_timeout, stop_process

OPS = ("ping", "lookup", "store", "retrieve")
LAYOUT = {1: (1, 1), 8: (2, 4), 64: (4, 16)}  # engines -> (processes, threads each)
TIMEOUT_S = 120.0

_ECHO = r"""
import os, socket, sys, threading
path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(8)
print("ready", flush=True)
def serve(c):
    while True:
        d = c.recv(4096)
        if not d:
            return
        c.sendall(d)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def echo_reference(n: int) -> dict[str, float]:
    d = tempfile.mkdtemp(prefix="hkvd-bench-echo-")
    path = os.path.join(d, "echo.sock")
    proc = subprocess.Popen([sys.executable, "-c", _ECHO, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        readline_timeout(proc, 30.0, "echo server")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10.0)
        s.connect(path)
        msg = b"x" * 64
        lat = []
        for i in range(n + 50):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(s.recv(4096))
            if i >= 50:
                lat.append((time.perf_counter() - t0) * 1e6)
        s.close()
    finally:
        stop_process(proc)
    return {"p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99), "ops_s": 1e6 / (sum(lat) / len(lat))}


class Workers:
    def __init__(self, socket_path: str, engines: int) -> None:
        procs, threads = LAYOUT.get(engines, (max(1, min(4, engines)), -(-engines // max(1, min(4, engines)))))
        self.procs = [subprocess.Popen([sys.executable, "-m", "bench.cp_worker"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for _ in range(procs)]
        for i, p in enumerate(self.procs):
            self._send(p, {"socket": socket_path, "threads": threads, "seed": i})
        for p in self.procs:
            readline_timeout(p, TIMEOUT_S, "control-plane worker start")
        self.engines = procs * threads

    @staticmethod
    def _send(p: subprocess.Popen[str], msg: dict[str, Any]) -> None:
        assert p.stdin is not None
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()

    def run(self, op: str, duration_s: float) -> dict[str, Any]:
        for p in self.procs:
            self._send(p, {"op": op, "duration_s": duration_s})
        replies = [json.loads(readline_timeout(p, duration_s + TIMEOUT_S, f"worker {op}")) for p in self.procs]
        for r in replies:
            if "error" in r:
                raise RuntimeError(f"control-plane {op}: {r['error']}")
        lat = [x for r in replies for x in r["lat_us"]]
        n = sum(r["n"] for r in replies)
        elapsed = max(r["elapsed_s"] for r in replies)
        return {"op": op, "engines": self.engines, "n": n, "ops_s": n / elapsed, "p50_us": percentile(lat, 50),
                "p99_us": percentile(lat, 99)}

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                stop_process(p)


def run(quick: bool, lmcache_venv: str | None = None, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    duration = 1.0 if quick else 5.0
    levels = [1, 8, 64]
    echo = echo_reference(1000 if quick else 10000)
    log(f"  bare UDS echo round trip: p50 {echo['p50_us']:.0f} us, p99 {echo['p99_us']:.0f} us")
    rows: list[dict[str, Any]] = []
    with Daemon("--chunk-size", "16", pool_gb=0.25, hugepages=hugepages) as daemon:
        for engines in levels:
            w = Workers(daemon.socket_path, engines)
            try:
                for op in OPS:
                    r = w.run(op, duration)
                    r["p50_vs_echo"] = r["p50_us"] / echo["p50_us"]
                    rows.append(r)
                    log(f"  {engines:>2} engines {op:<8} p50 {r['p50_us']:7.0f} us  p99 {r['p99_us']:7.0f} us  "
                        f"{r['ops_s']:8.0f} ops/s  ({r['p50_vs_echo']:.1f}x echo p50)")
            finally:
                w.close()
        lm = lmcache_compare(lmcache_venv, daemon.socket_path, quick, log)
    return {"config": {"duration_s": duration, "levels": levels, "layout": LAYOUT}, "echo": echo, "rows": rows,
            "lmcache": lm}


class LMCacheProc:
    """``bench.lmcache_ping --serve`` in the LMCache venv: its server stays up between rounds."""

    def __init__(self, py: Path, cwd: Path) -> None:
        self.proc = subprocess.Popen([str(py), "-m", "bench.lmcache_ping", "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        self.info = self._reply(240.0, "LMCache server start")

    def _reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        while True:
            line = readline_timeout(self.proc, timeout_s, what)
            if line.startswith("{"):
                reply = json.loads(line)
                if "error" in reply:
                    raise RuntimeError(f"{what}: {reply['error']}")
                return reply

    def run(self, op: str, duration_s: float, warmup: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "duration_s": duration_s, "warmup": warmup}) + "\n")
        self.proc.stdin.flush()
        return self._reply(duration_s + TIMEOUT_S, f"LMCache {op}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)


def lmcache_compare(venv: str | None, socket_path: str, quick: bool, log: Any) -> dict[str, Any]:
    """LMCache's ping and lookup against ours, one engine each, in alternating rounds."""
    if not venv:
        log("  LMCache not installed: make bench-peers")
        return {"skipped": "LMCache not installed: make bench-peers"}
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        log(f"  LMCache venv {venv} has no bin/python: make bench-peers")
        return {"skipped": f"no venv at {venv}"}
    rounds, duration, warmup = (3, 0.5, 50) if quick else (5, 2.0, 200)
    log(f"  LMCache: starting its server from {venv} (10-30 s) ...")
    try:
        lmc = LMCacheProc(py, Path(__file__).resolve().parent.parent)
    except RuntimeError as e:
        log(f"  LMCache comparison failed: {str(e)[-800:]}")
        return {"error": str(e)[-3000:]}
    pairs = {"ping": "ping", "lookup": "lookup_lease"}  # LMCache's lookup hashes, locks, answers: lookup_lease
    theirs: dict[str, list[dict[str, Any]]] = {op: [] for op in pairs}
    ours: dict[str, list[dict[str, Any]]] = {op: [] for op in pairs.values()}
    w = Workers(socket_path, 1)
    try:
        for r in range(rounds):
            for op, mine in pairs.items():
                theirs[op].append(lmc.run(op, duration, warmup if r == 0 else 0))
                ours[mine].append(w.run(mine, duration))
    except RuntimeError as e:
        log(f"  LMCache comparison failed: {str(e)[-800:]}")
        return {"error": str(e)[-3000:], "lmcache_info": lmc.info}
    finally:
        w.close()
        lmc.close()

    def med(rs: list[dict[str, Any]]) -> dict[str, float]:  # median over rounds of each figure
        return {k: median([x[k] for x in rs]) for k in ("p50_us", "p99_us", "ops_s")} | {"rounds": len(rs)}

    res: dict[str, Any] = {"lmcache_info": lmc.info, "lmcache": {op: med(v) for op, v in theirs.items()},
                           "hkvd": {op: med(v) for op, v in ours.items()}, "pairs": pairs,
                           "rounds": {"n": rounds, "duration_s": duration, "lmcache": theirs, "hkvd": ours},
                           "target": "rate >= 3x, p50 <= 1/3"}
    for op, mine in pairs.items():
        lm, me = res["lmcache"][op], res["hkvd"][mine]
        res[f"{op}_rate_ratio"] = me["ops_s"] / lm["ops_s"]
        res[f"{op}_p50_ratio"] = me["p50_us"] / lm["p50_us"]
        res[f"{op}_target_met"] = res[f"{op}_rate_ratio"] >= 3.0 and res[f"{op}_p50_ratio"] <= 1 / 3
        log(f"  LMCache {lmc.info.get('version', '?')} {op:<6} p50 {lm['p50_us']:6.0f} us p99 {lm['p99_us']:6.0f} us "
            f"{lm['ops_s']:6.0f} ops/s | hkvd {mine} p50 {me['p50_us']:5.0f} us {me['ops_s']:6.0f} ops/s: "
            f"{res[f'{op}_rate_ratio']:.2f}x its rate, {res[f'{op}_p50_ratio']:.2f}x its p50 "
            f"(target {'met' if res[f'{op}_target_met'] else 'NOT met'}; medians of {rounds} alternating rounds)")
    return res


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["engines", "op", "p50 us", "p99 us", "ops/s", "p50 / UDS echo p50"]
    rows = [[r["engines"], r["op"], r["p50_us"], r["p99_us"], r["ops_s"], r["p50_vs_echo"]] for r in result["rows"]]
    e = result["echo"]
    rows.append(["1", "(bare UDS echo)", e["p50_us"], e["p99_us"], e["ops_s"], 1.0])
    lm = result.get("lmcache", {})
    if "ping_rate_ratio" in lm:
        for op, mine in lm["pairs"].items():
            for who, r in ((f"LMCache {op}", lm["lmcache"][op]), (f"hkvd {mine}, same run", lm["hkvd"][mine])):
                rows.append(["1", f"({who})", r["p50_us"], r["p99_us"], r["ops_s"], r["p50_us"] / e["p50_us"]])
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for op in OPS:
        rs = [r for r in rows if r["op"] == op]
        line = axes[0].plot([r["engines"] for r in rs], [r["p50_us"] for r in rs], marker="o", label=f"{op} p50")
        axes[0].plot([r["engines"] for r in rs], [r["p99_us"] for r in rs], ls=":", color=line[0].get_color(),
                     label=f"{op} p99")
        axes[1].plot([r["engines"] for r in rs], [r["ops_s"] for r in rs], marker="o", label=op)
    axes[0].axhline(result["echo"]["p50_us"], color="grey", ls="--", lw=1, label="bare UDS echo p50")
    lm = result.get("lmcache", {})
    if "ping_rate_ratio" in lm:  # LMCache 0.5.6, one client, same run
        for op, marker in (("ping", "X"), ("lookup", "P")):
            r = lm["lmcache"][op]
            axes[0].plot([1], [r["p50_us"]], marker=marker, ms=11, ls="none", color="black",
                         label=f"LMCache {op} p50")
            axes[1].plot([1], [r["ops_s"]], marker=marker, ms=11, ls="none", color="black", label=f"LMCache {op}")
    axes[0].set_yscale("log")
    for ax, y in zip(axes, ("latency us (log)", "ops/s, all engines together"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent engines (closed loop)")
        ax.set_ylabel(y)
        ax.legend(fontsize=7, ncol=2)
    axes[0].set_title("round-trip latency vs engines")
    axes[1].set_title("rate vs engines")
    path = out_dir / "control_plane.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
