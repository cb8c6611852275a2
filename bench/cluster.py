"""The cluster tier's put and get GB/s against Mooncake's own, same values, same run (loopback, TCP).

A real ``mooncake_master`` and two ``hkvd serve --cluster`` daemons. An engine on the first stores
entries of one size; the tier writes them behind to the cluster (its put GB/s, from ``hkvd status``).
An engine on the second, whose pool never saw them, looks them up; the tier reads them through (its
get GB/s). The reference is plain Mooncake clients putting and getting values of the same
size and count with the same batch calls from registered memory: one client process puts, another
gets, as the tier's two nodes do. Needs ``hkvd[cluster]``.
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

from bench.common import human_bytes

SIZES = ((512 << 10, 128), (4 << 20, 32))  # (entry bytes, entries): 64 and 128 MiB
BATCH = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _master(port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mooncake_master"), "--port", str(port)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"mooncake_master did not listen within 30 s: {log.read_text()[-2000:]}")


_CLIENT = """
import ctypes, json, sys, time
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
master, what, size, count, batch = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 0, "tcp", "", master) == 0, "cannot join"
buf = (ctypes.c_char * (size * count))()
ctypes.memset(buf, 7, size * count)
base = ctypes.addressof(buf)
store.register_buffer(base, size * count)
keys = [f"bench-ref-{size}-{i}" for i in range(count)]
cfg = ReplicateConfig()
cfg.replica_num = 1
seconds = 0.0
for i in range(0, count, batch):
    k = keys[i:i + batch]
    ptrs, sizes = [[base + j * size] for j in range(i, i + len(k))], [[size]] * len(k)
    t0 = time.perf_counter()
    rcs = (store.batch_put_from_multi_buffers(k, ptrs, sizes, cfg) if what == "put"
           else store.batch_get_into_multi_buffers(k, ptrs, sizes))
    seconds += time.perf_counter() - t0
    assert all(rc >= 0 for rc in rcs), rcs
print(json.dumps({"gbps": size * count / seconds / 1e9}))
if what == "put":
    sys.stdout.flush()
    sys.stdin.read()  # keep this client's segment (which holds the values) until the get is done
store.close()
"""


def _reference(master: str, size: int, count: int) -> tuple[float, float]:
    """Mooncake's own batch put (one client) and get (another client, another process), GB/s."""
    argv = [master, "", str(size), str(count), str(BATCH)]
    putter = subprocess.Popen([sys.executable, "-c", _CLIENT, *argv[:1], "put", *argv[2:]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert putter.stdout is not None
        put = json.loads(putter.stdout.readline())["gbps"]
        out = subprocess.run([sys.executable, "-c", _CLIENT, *argv[:1], "get", *argv[2:]], capture_output=True,
                             text=True, timeout=300, check=True).stdout
        get = json.loads(out.splitlines()[-1])["gbps"]
    finally:
        putter.kill()
        putter.wait()
    return put, get


def _tier(url: str, work: Path, size: int, count: int, hugepages: str) -> tuple[float, float]:
    """The tier's put GB/s (node 1 writing behind) and get GB/s (node 2 reading through)."""
    from hkvd.shim.testing.launcher import DaemonProcess
    from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
    from hkvd.transport.keys import chunk_keys

    pool_gb = str(round((size * count * 2 + (256 << 20)) / (1 << 30), 3))
    key = work / "fleet.key"  # both nodes seal and check every value with it (HMAC-SHA256 of header and payload)
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    args = ["--chunk-size", "32", "--l1-size-gb", pool_gb, "--hugepages", hugepages, "--cluster", url,
            "--cluster-key-file", str(key), "--cluster-lookup-timeout-ms", "30000", "--log-level", "warning"]
    nodes = [DaemonProcess(str(work / f"n{i}-{size}.sock"), args, work / f"n{i}-{size}.log").start(60)
             for i in (1, 2)]
    try:
        shape = [GroupShape("full", 1, size // 2)]  # two blocks of 16 tokens per 32-token chunk
        keys = chunk_keys(prompt_tokens(32 * count, seed=size), 32)
        producer = SyntheticEngine(nodes[0].socket_path, shape, num_blocks=2 * count + 2)
        items = producer.items(0, keys, first_block=1)
        producer.fill_random(0, [b for it in items for b in it.block_ids], seed=1)
        step = max(1, min(BATCH, (16 << 20) // size))  # steps the write-behind queue takes whole (full: skips)
        for i in range(0, count, step):
            producer.store(items[i:i + step])
            s = nodes[0].wait_status(lambda st: st["cluster"]["queued"] == 0, 120)
        if s["cluster"]["puts"] < count:
            raise RuntimeError(f"node 1 put {s['cluster']['puts']} of {count} entries: {s['cluster']['skips']}")
        consumer = SyntheticEngine(nodes[1].socket_path, shape, num_blocks=2 * count + 2)
        hit, _ = consumer.lookup(keys)
        if hit != count:
            raise RuntimeError(f"node 2 read {hit} of {count} entries through the cluster")
        g = nodes[1].status()
        producer.close()
        consumer.close()
        return float(s["cluster"]["put_gbps"]), float(g["cluster"]["get_gbps"])
    finally:
        for n in nodes:
            n.stop()


def _with_master(work: Path, fn: Any) -> Any:
    """``fn(port)`` against a fresh mooncake_master: a client that left holds no segment of the next run."""
    port = _free_port()
    master = _master(port, work / f"master-{port}.log")
    try:
        return fn(port)
    finally:
        master.kill()
        master.wait()


def run(quick: bool, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="hkvd-bench-cluster-") as tmp:
        work = Path(tmp)
        for size, count in SIZES[:1] if quick else SIZES:
            ref_put, ref_get = _with_master(work, lambda p, n=size, c=count: _reference(f"127.0.0.1:{p}", n, c))
            put, get = _with_master(work, lambda p, n=size, c=count: _tier(f"mooncake://127.0.0.1:{p}", work, n, c,
                                                                           hugepages))
            log(f"  {human_bytes(size)} x {count}: tier put {put:.2f} GB/s, get {get:.2f}; "
                f"Mooncake put {ref_put:.2f}, get {ref_get:.2f}")
            rows.append({"entry_bytes": size, "entries": count, "put_gbps": put, "ref_put_gbps": ref_put,
                         "put_ratio": put / ref_put, "get_gbps": get, "ref_get_gbps": ref_get,
                         "get_ratio": get / ref_get})
    return {"rows": rows}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["entries", "tier put GB/s", "Mooncake put GB/s", "put ratio", "tier get GB/s", "Mooncake get GB/s",
               "get ratio"]
    rows = [[f"{r['entries']} x {human_bytes(r['entry_bytes'])}", r["put_gbps"], r["ref_put_gbps"], r["put_ratio"],
             r["get_gbps"], r["ref_get_gbps"], r["get_ratio"]] for r in result["rows"]]
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Any) -> list[str]:
    return []
