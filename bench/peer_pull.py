"""Peer pull GB/s: an engine's ``Pull`` through two real daemons, against a bare NIXL READ of the
same pages over the same link, in the same run.

    python -m bench.peer_pull [--quick] [--sizes-mib 64,256] [--reps 5] [--tls tcp,sm]

Setup per UCX transport choice (``--tls``: ``tcp`` = ``UCX_TLS=tcp,self`` on loopback with 256K/512K
TCP segments, as the tests; ``sm`` = ``UCX_TLS=tcp,sm,self``: shared memory for the data, TCP only
for connection setup): a serving daemon (``--peer-listen``) holding the entries a synthetic engine
stored, a pulling daemon (both started afresh per case, pools large enough for every key set of the
case), and a spawned "bare" process. Cases: 64 MiB and 256 MiB in 512 KiB entries (many entries:
the pull's per-entry work shows) and 256 MiB in 4 MiB entries. For each repetition, on a fresh key
set:

- **pull**: the decode-side engine sends ``Pull`` to its daemon and waits for its ``PullResult``: lookup +
  lease on the serving daemon, local allocation, one NIXL READ into the pool, publish, release.
  Timed end to end at the engine (what a decode request waits for).
- **bare**: the bare process authenticates like a peer, looks up the same keys (untimed) for the
  same remote extents, then times one NIXL READ of exactly those descriptors into memory of the
  pool's kind, registered once (``initialize_xfer`` + ``transfer`` + polling every 50 us), with its
  agent configured as the daemon's. Each READ lands in the next unused stretch of that memory, as
  each pull lands in newly allocated pool entries: writing into pages nothing wrote since the
  pre-fault is slower than rewriting the same buffer (see ``bench.cma_helper``), and a reference
  that reused one buffer would measure a different copy.

Ratio = median over repetitions of pull GB/s / bare GB/s, each pair run back to back (target >= 0.9).
Links are warmed before timing (connection, handshake and NIXL metadata exchange happen once per
link, not per pull). Also reported: the pull's own READ rate and the rest of its time (control).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import MiB, gbps, median

# Entry sizes: 512 KiB makes many entries (the pull's per-entry work shows); 4 MiB is closer to real
# models (a 7B model's 256-token chunk of one full-attention group is tens of MiB).
SMALL_ENTRY = 512 << 10
LARGE_ENTRY = 4 << 20
TOKEN = "bench-peer-token-0123456789abcdef"
TLS = {"tcp": "tcp,self", "sm": "tcp,sm,self"}
BASE_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "512K",
            "UCX_WARN_UNUSED_ENV_VARS": "n"}


def nixl_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1 (or make dev)"
    return None


# ---- the bare reader (its own process: NIXL never loads into the bench process) ------------------
def _bare_main(conn: Any, env: dict[str, str], max_bytes: int, hugepages: str) -> None:
    os.environ.update(env)
    import nixl_cu12
    import numpy as np
    from nixl_cu12 import nixl_agent, nixl_agent_config

    from hkvd.daemon.cache.pool import HugePagePool
    from hkvd.daemon.peers.auth import client_proof, split_address
    from hkvd.daemon.peers.pulling import merge, pair_extents
    from hkvd.transport.aio import FrameStream
    from hkvd.transport.nixl.agent import PROGRESS_DELAY_US, _progress_delay
    from hkvd.transport.nixl.host_wire import unwrap_metadata
    from hkvd.transport.wire.peer import (
        PEER_VERSION,
        PeerAuth,
        PeerHello,
        PeerLookup,
        PeerRelease,
    )

    # The agent is configured as the daemon's (progress thread on, the same poll timeout): with
    # NIXL's default (a spinning progress thread) the same READ ran 1.4-2.5x slower on 2 cores.
    with _progress_delay(nixl_cu12, PROGRESS_DELAY_US):
        agent = nixl_agent(f"bench-bare-{os.getpid()}", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    # The destination is memory of the daemon pool's kind (a pre-faulted memfd mapping, same page
    # size): a numpy buffer would get transparent huge pages the pool may not have, and over
    # shared memory the page size of the destination alone moved the READ rate by up to 1.7x here.
    pool = HugePagePool(max_bytes + (32 << 20), hugepages)  # type: ignore[arg-type]
    pool.prefault()
    buf = np.frombuffer(pool.buffer, dtype=np.uint8)
    agent.register_memory([(pool.base_addr, pool.size, 0, "")], "DRAM")
    cursor = [0]  # the next unused byte of the pool; a READ that would not fit starts over at 0
    peers: dict[str, str] = {}
    offsets: dict[str, int] = {}

    async def lookup(address: str, fp: bytes, keys: list[bytes]) -> tuple[Any, Any, FrameStream]:
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        s = FrameStream(reader, writer, 64 << 20)
        nonce = os.urandom(32)
        await s.send(PeerHello(PEER_VERSION, "bench-bare", nonce), 10)
        ch = await s.recv(10)
        await s.send(PeerAuth(client_proof(TOKEN.encode(), nonce, ch.nonce), [fp]), 10)
        welcome = await s.recv(10)
        if welcome.agent not in peers:  # a transport host's metadata carries its pool's address offset
            md, offsets[welcome.agent] = unwrap_metadata(welcome.agent_metadata)
            name = agent.add_remote_agent(md)
            peers[welcome.agent] = name.decode() if isinstance(name, bytes) else name
        await s.send(PeerLookup(1, fp, keys, 0, 0.0, 0), 10)
        reply = await s.recv(30)
        return welcome, reply, s

    async def one(address: str, fp: bytes, keys: list[bytes]) -> dict[str, Any]:
        welcome, reply, s = await lookup(address, fp, keys)
        entries = reply.entries()
        total = sum(e.nbytes for e in entries)
        if cursor[0] + total > pool.size:
            cursor[0] = 0
        start = buf.ctypes.data + cursor[0]
        descs, off = [], start
        for e in entries:
            descs.extend(pair_extents(e.extents, [(off, e.nbytes)]))
            off += e.nbytes
        descs = merge(descs)
        nbytes = off - start
        cursor[0] += nbytes
        local = np.array([(d.local_addr, d.nbytes, 0) for d in descs], dtype=np.uint64)
        shift = offsets[welcome.agent]
        remote = np.array([(d.remote_addr + shift, d.nbytes, 0) for d in descs], dtype=np.uint64)
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"),
                                  peers[welcome.agent])
        state = agent.transfer(h)
        while state == "PROC":
            time.sleep(50e-6)  # noqa: ASYNC251 - the bare baseline polls like the daemon's transfer thread
            state = agent.check_xfer_state(h)
        seconds = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        await s.send(PeerRelease(2, reply.lease_id), 10)
        await s.aclose()
        return {"state": state, "nbytes": nbytes, "seconds": seconds, "descs": len(descs),
                "hit_chunks": reply.hit_chunks}

    conn.send({"ready": True})
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        address, fp, keys = cmd
        try:
            conn.send(asyncio.run(one(address, fp, keys)))
        except Exception as e:
            conn.send({"error": repr(e)})


class Bare:
    def __init__(self, env: dict[str, str], max_bytes: int, hugepages: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_bare_main, args=(child, env, max_bytes, hugepages), daemon=True)
        # The spawned child imports this module as bench.peer_pull: it needs the checkout's root on
        # its sys.path, which spawn copies from ours at start().
        root = str(Path(__file__).resolve().parents[1])
        added = root not in sys.path
        if added:
            sys.path.insert(0, root)
        try:
            self.proc.start()
        finally:
            if added:
                sys.path.remove(root)
        self._recv(120)

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the bare NIXL reader exited (code {self.proc.exitcode}); see its stderr")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bare NIXL reader did not answer within {timeout_s:.0f} s")
        out: dict[str, Any] = self.conn.recv()
        if "error" in out:
            raise RuntimeError(f"bare NIXL reader: {out['error']}")
        return out

    def read(self, address: str, fp: bytes, keys: list[bytes]) -> dict[str, Any]:
        self.conn.send((address, fp, keys))
        return self._recv(300)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---- one transport setting -------------------------------------------------------------------
def _bench_tls(tls: str, cases: list[tuple[int, int]], reps: int, hugepages: str, log: Any) -> list[dict[str, Any]]:
    env = {**BASE_ENV, "UCX_TLS": TLS[tls]}
    rows: list[dict[str, Any]] = []
    # Room for every READ of the largest case (a warm-up and ``reps``) without reusing a byte.
    bare = Bare(env, (reps + 1) * max(size for size, _ in cases), hugepages)
    try:
        for size, entry in cases:
            rows.append(_bench_case(tls, env, size, entry, reps, hugepages, bare, log))
    finally:
        bare.close()
    return rows


def _bench_case(tls: str, env: dict[str, str], size: int, entry: int, reps: int, hugepages: str, bare: Bare,
                log: Any) -> dict[str, Any]:
    """Fresh daemons whose pools hold every key set of the case: no pull waits for evictions, so
    this compares the data path and the pull's own work."""
    import socket

    import numpy as np

    from hkvd.shim.testing.launcher import DaemonProcess
    from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
    from hkvd.transport.keys import chunk_keys

    with tempfile.TemporaryDirectory(prefix="hkvd-peer-bench-") as tmp:
        tok = Path(tmp) / "token"
        tok.write_text(TOKEN)
        tok.chmod(0o600)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"127.0.0.1:{port}"
        pool_gb = ((reps + 1) * size + 8 * entry + 128 * MiB) / (1 << 30)
        common = ["--hugepages", hugepages, "--chunk-size", "32", "--peer-token-file", str(tok),
                  "--lease-ttl-s", "120", "--peer-pull-timeout-s", "90", "--l1-size-gb", f"{pool_gb:.3f}"]
        denv = {**os.environ, **env}
        prefill = DaemonProcess(f"{tmp}/p.sock", [*common, "--peer-listen", address], Path(tmp) / "p.log", env=denv)
        decode = DaemonProcess(f"{tmp}/d.sock", common, Path(tmp) / "d.log", env=denv)
        prefill.spawn()
        decode.spawn()
        try:
            prefill.wait_ready(300)
            decode.wait_ready(300)
            # An entry is 2 blocks x 2 layers of one page (chunk 32 tokens, block 16).
            shape = [GroupShape("full", 2, entry // 4)]
            blocks = 2 * (size // entry) + 2
            producer = SyntheticEngine(prefill.socket_path, shape, num_blocks=blocks, timeout_s=300)
            consumer = SyntheticEngine(decode.socket_path, shape, num_blocks=blocks, timeout_s=300)
            seed = 0

            def fresh(nbytes: int) -> list[bytes]:
                nonlocal seed
                seed += 1
                producer.buffer[:] = np.random.default_rng(seed).integers(-128, 128, producer.buffer.size,
                                                                          dtype=np.int8)
                keys = chunk_keys(prompt_tokens(32 * (nbytes // entry), seed=1000 + seed), 32)
                producer.store(producer.items(0, keys, first_block=1))
                return keys

            def pull(keys: list[bytes]) -> tuple[float, dict[str, Any]]:
                t0 = time.perf_counter()
                rid = consumer.client.submit_pull(address, keys)
                c = consumer.client.wait([rid], 300)[rid]
                dt = time.perf_counter() - t0
                if c.error is not None:
                    raise c.error
                consumer.client.release(int(c.result.lease_id))
                return dt, dataclasses.asdict(c.result)

            warm = fresh(8 * entry)  # links up, NIXL metadata loaded, both paths
            pull(warm)
            bare.read(address, producer.fingerprint, warm)
            pulls, bares, infos, bare_descs = [], [], [], 0
            for r in range(reps):
                keys = fresh(size)
                for what in (("pull", "bare") if r % 2 == 0 else ("bare", "pull")):
                    if what == "pull":
                        dt, info = pull(keys)
                        assert info["hit_chunks"] == len(keys) and info["nbytes"] == size, info
                        pulls.append(gbps(size, dt))
                        info["overhead_s"] = dt - info["read_s"]  # everything but the READ, end to end
                        infos.append(info)
                    else:
                        b = bare.read(address, producer.fingerprint, keys)
                        assert b["state"] == "DONE" and b["nbytes"] == size, b
                        bares.append(gbps(size, b["seconds"]))
                        bare_descs = b["descs"]
                if r == 0:  # the pulled bytes are the stored ones
                    _, lease = consumer.lookup(keys)
                    consumer.retrieve(consumer.items(0, keys, first_block=1), lease)
                    v = consumer.groups[0].views[0]
                    for layer in range(v.num_layers):
                        lo = v.offset + layer * v.layer_stride + v.block_stride
                        hi = lo + 2 * len(keys) * v.block_stride
                        assert np.array_equal(consumer.buffer[lo:hi], producer.buffer[lo:hi]), "pulled bytes differ"
            producer.close()
            consumer.close()
        finally:
            for d in (prefill, decode):
                if d.proc is not None and d.proc.poll() is None:
                    d.stop(60)
            keep = os.environ.get("HKVD_BENCH_LOGS")
            if keep:  # the daemons' logs, for looking into a run
                import shutil

                Path(keep).mkdir(parents=True, exist_ok=True)
                for name in ("p.log", "d.log"):
                    shutil.copy(Path(tmp) / name, Path(keep) / f"{tls}-{size >> 20}-{entry >> 10}-{name}")
    row = {"tls": tls, "size_mib": size // MiB, "entry_kib": entry >> 10, "entries": size // entry, "reps": reps,
           "pull_gbps": median(pulls), "bare_gbps": median(bares),
           # Each repetition's pull and bare READ run back to back on the same key set: the median of
           # their ratios is steadier than a ratio of medians on a busy machine.
           "ratio": median([p / b for p, b in zip(pulls, bares, strict=True)]),
           "pull_all": pulls, "bare_all": bares,
           "overhead_ms": median([i["overhead_s"] for i in infos]) * 1e3,
           "daemon_s": median([i["seconds"] for i in infos]),
           "lookup_s": median([i["lookup_s"] for i in infos]),
           "read_gbps": median([gbps(size, i["read_s"]) for i in infos]),
           "descs": median([i["descs"] for i in infos]), "bare_descs": bare_descs}
    log(f"  {tls:3} {size // MiB:4d} MiB in {entry >> 10:5d} KiB entries: pull {row['pull_gbps']:.2f} GB/s (its READ "
        f"{row['read_gbps']:.2f}; lookup {row['lookup_s'] * 1e3:.1f} ms, all but the READ "
        f"{row['overhead_ms']:.1f} ms), bare NIXL READ {row['bare_gbps']:.2f} GB/s, paired ratio {row['ratio']:.2f}")
    return row


def run(quick: bool, hugepages: str = "auto", log: Any = print, sizes_mib: list[int] | None = None,
        reps: int | None = None, tls: list[str] | None = None) -> dict[str, Any]:
    why = nixl_missing()
    if why:
        log(f"  skipped: {why}")
        return {"skipped": why, "rows": []}
    if sizes_mib:
        cases = [(s * MiB, SMALL_ENTRY) for s in sizes_mib]
    else:
        cases = [(32 * MiB, SMALL_ENTRY)] if quick else [(64 * MiB, SMALL_ENTRY), (256 * MiB, SMALL_ENTRY),
                                                          (256 * MiB, LARGE_ENTRY)]
    reps = reps or (1 if quick else 5)
    rows: list[dict[str, Any]] = []
    for t in tls or (["tcp"] if quick else ["tcp", "sm"]):
        rows.extend(_bench_tls(t, cases, reps, hugepages, log))
    return {"rows": rows}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["UCX", "size", "entries", "pull GB/s", "bare NIXL READ GB/s", "pull / bare (paired median)",
               "pull's READ GB/s", "rest of the pull, ms"]
    rows = [[r["tls"], f"{r['size_mib']} MiB", f"{r['entries']} x {r['entry_kib']} KiB", f"{r['pull_gbps']:.2f}",
             f"{r['bare_gbps']:.2f}",
             f"{r['ratio']:.2f}", f"{r['read_gbps']:.2f}", f"{r['overhead_ms']:.1f}"] for r in result.get("rows", [])]
    if not rows and result.get("skipped"):
        rows = [["-", "-", "-", "-", "-", f"skipped: {result['skipped']}", "-", "-"]]
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    rows = result.get("rows", [])
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['tls']} {r['size_mib']} MiB/{r['entry_kib']} KiB" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["pull_gbps"] for r in rows], width=0.4, label="hkvd pull")
    ax.bar([i + 0.2 for i in x], [r["bare_gbps"] for r in rows], width=0.4, label="bare NIXL READ")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GB/s")
    ax.legend()
    fig.tight_layout()
    path = out / "peer_pull.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_pull", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes-mib", default=None,
                    help="comma-separated pull sizes in MiB, 512 KiB entries (default: 64 and 256 MiB in 512 KiB "
                    "entries, 256 MiB in 4 MiB entries)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per case (default 5)")
    ap.add_argument("--tls", default=None, help="comma-separated: tcp, sm (default both)")
    ap.add_argument("--hugepages", choices=["auto", "off"], default="auto")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    from bench.common import git_commit, machine, md_table, write_json

    t0 = time.perf_counter()
    result = run(a.quick, a.hugepages, sizes_mib=[int(s) for s in a.sizes_mib.split(",")] if a.sizes_mib else None,
                 reps=a.reps, tls=a.tls.split(",") if a.tls else None)
    payload = {"name": "peer_pull", "quick": a.quick, "commit": git_commit(), "machine": machine(),
               "wall_s": time.perf_counter() - t0, **result}
    path = write_json(Path(a.out), "peer_pull", payload)
    headers, rows = table(result)
    print(f"wrote {path}\n\n{md_table(headers, rows)}")
    print(json.dumps({k: v for k, v in payload.items() if k != "rows"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
