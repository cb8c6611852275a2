"""usable_prefix: routers' usable-prefix lookups per second on the metrics port, pipelined, keep-alive.

A real ``hkvd serve`` holds the entries of a hybrid engine (one full-attention group, one sliding-window
group, two Mamba groups; ``SyntheticEngine``): ``PROMPTS`` prompts of 2,048 tokens over a few shared
prefixes, Mamba states every other chunk. Client processes (``CLIENT_PROCS``) each hold ``conns``
keep-alive connections and keep ``DEPTH`` requests in flight on each (pipelined); every request asks
``POST /v1/usable_prefix`` about a 2,048-token prompt (a stored one cut at a random length plus a random
tail, or a new one), with ``token_ids`` as a JSON list, as ``token_ids_b64`` in JSON, or as a bin of
little-endian uint32 in a msgpack body. Rows: lookups per second
of all clients together, the daemon's CPU time per lookup (its ``/proc`` utime + stime over the run),
and the pipelined rate of ``GET /healthz`` on the same connections (the HTTP floor). On a small machine
the clients compete with the daemon for the same cores: the rate is of the whole node.

Long prompts: one request of ``MAX_TOKENS`` (131,072) token ids at chunk size 16, and the longest
``GET /healthz`` answer seen on another connection meanwhile (how long the event loop was held).

Standalone: ``python -m bench.usable_prefix [--quick]`` prints the table; ``python -m bench usable_prefix``
also writes ``bench/results/usable_prefix.json``.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from bench.common import Daemon, median
from hkvd.daemon.routing.usable_prefix import MAX_TOKENS
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

PROMPT_TOKENS = 2048
PROMPTS = 64
BASES = 8
DEPTH = 16
CLIENT_PROCS = 2
MODEL = "bench/hybrid"
SHAPES = [GroupShape("full", 2, 4096), GroupShape("swa", 2, 4096, window_tokens=512),
          GroupShape("mamba", 2, 4096), GroupShape("mamba", 2, 4096)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    bases = [rng.integers(10, 150_000, PROMPT_TOKENS).tolist() for _ in range(BASES)]
    stored = []
    for i in range(PROMPTS):
        cut = int(rng.integers(PROMPT_TOKENS // 4, PROMPT_TOKENS))
        stored.append(bases[i % BASES][:cut] + rng.integers(10, 150_000, PROMPT_TOKENS - cut).tolist())
    return bases, stored


def _model(chunk: int) -> str:
    return f"{MODEL}-c{chunk}"  # each chunk size is a format of its own


def _fill(socket_path: str, chunk: int, stored: list[list[int]]) -> int:
    """Store every prompt's chunks: attention every chunk, Mamba states every other chunk."""
    n = PROMPT_TOKENS // chunk
    eng = SyntheticEngine(socket_path, SHAPES, num_blocks=n + 2, tokens_per_block=chunk, chunk_size=chunk,
                          model=_model(chunk))
    try:
        seq = 0
        for tokens in stored:
            keys = chunk_keys(tokens, chunk)
            eng.store([Item(g, i, keys[i], [1 + i], keys[i - 1] if i else b"") for g in (0, 1) for i in range(n)])
            offers = [Item(g, i, keys[i], [1 + i]) for g in (2, 3) for i in range(1, n, 2)]
            req = eng.client.submit_step_event(seq, seq, offers)
            eng.run(req)
            eng.run(eng.client.submit_step_event(seq + 1, seq + 1, [], [req]))
            seq += 2
        return int(eng.client.status()["index"]["ready"])
    finally:
        eng.close()


ENCODINGS = ("json", "b64", "msgpack")


def _request(tokens: list[int] | np.ndarray, model: str, encoding: str) -> bytes:
    """One ``POST /v1/usable_prefix``: token ids as a JSON list, as base64 in JSON, or as a msgpack bin."""
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    if encoding == "msgpack":
        data = msgpack.packb({"model": model, "token_ids": packed})
        ctype = b"application/msgpack"
    else:
        body: dict[str, Any] = {"model": model}
        if encoding == "b64":
            body["token_ids_b64"] = base64.b64encode(packed).decode()
        else:
            body["token_ids"] = [int(t) for t in tokens]
        data = json.dumps(body).encode()
        ctype = b"application/json"
    return (b"POST /v1/usable_prefix HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (ctype, len(data))) + data


def _bodies(seed: int, encoding: str, count: int, model: str) -> list[bytes]:
    """Requests: half a stored prompt cut at a random length plus a random tail, half new prompts."""
    _, stored = _prompts(0)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.5:
            src = rng.choice(stored)
            cut = rng.randrange(1, PROMPT_TOKENS)
            tokens = src[:cut] + [rng.randrange(10, 150_000) for _ in range(PROMPT_TOKENS - cut)]
        else:
            tokens = [rng.randrange(10, 150_000) for _ in range(PROMPT_TOKENS)]
        out.append(_request(tokens, model, encoding))
    return out


class _Conn:
    """One keep-alive connection that keeps ``depth`` requests in flight."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(30)
        self.buf = b""

    def responses(self, n: int) -> list[int]:
        """Read ``n`` answers; their status codes (the bodies are read and dropped)."""
        codes = []
        buf = self.buf
        while len(codes) < n:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = buf[:end]
                i = head.lower().find(b"content-length: ")  # any case, and possibly the head's last field
                j = head.find(b"\r\n", i)
                length = int(head[i + 16:j if j >= 0 else len(head)])
                if len(buf) >= end + 4 + length:
                    codes.append(int(head[9:12]))
                    buf = buf[end + 4 + length:]
                    continue
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        self.buf = buf
        return codes


def _client(port: int, conns: int, requests: list[bytes], duration_s: float, start: float, out: Any) -> None:
    """A client process: ``conns`` connections, each in its own thread, ``DEPTH`` requests in flight."""
    done = [0] * conns
    bad = [0] * conns

    def drive(k: int) -> None:
        c = _Conn(port)
        rng = random.Random(k)
        while time.time() < start:
            time.sleep(0.001)
        end = time.time() + duration_s
        while time.time() < end:
            c.sock.sendall(b"".join(rng.choice(requests) for _ in range(DEPTH)))
            codes = c.responses(DEPTH)
            done[k] += len(codes)
            bad[k] += sum(code != 200 for code in codes)
        c.sock.close()

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((sum(done), sum(bad)))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rate(port: int, pid: int, requests: list[bytes], conns: int, duration_s: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    per_proc = [conns // CLIENT_PROCS + (i < conns % CLIENT_PROCS) for i in range(CLIENT_PROCS)]
    start = time.time() + 0.5
    procs = [ctx.Process(target=_client, args=(port, n, requests, duration_s, start, q)) for n in per_proc if n]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start - time.time()))
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    results = [q.get(timeout=duration_s + 60) for _ in procs]
    cpu1, t1 = _cpu_s(pid), time.perf_counter()
    for p in procs:
        p.join(10)
    done = sum(r[0] for r in results)
    bad = sum(r[1] for r in results)
    if bad:
        raise RuntimeError(f"{bad} of {done} answers were not 200")
    return {"lookups_s": done / (t1 - t0), "daemon_cpu_us": (cpu1 - cpu0) / max(done, 1) * 1e6, "answers": done}


def _long_prompt(port: int, encoding: str) -> dict[str, Any]:
    """One request of MAX_TOKENS token ids, and the slowest /healthz answered on another connection meanwhile."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(10, 150_000, MAX_TOKENS, dtype=np.uint32)
    req = _request(tokens, _model(16), encoding)
    ping = _Conn(port)
    stop = threading.Event()
    worst = [0.0]

    def pings() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            ping.sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            ping.responses(1)
            worst[0] = max(worst[0], time.perf_counter() - t)

    latencies = []
    t_ping = threading.Thread(target=pings)
    t_ping.start()
    try:
        c = _Conn(port)
        for _ in range(3):
            t = time.perf_counter()
            c.sock.sendall(req)
            assert c.responses(1) == [200]
            latencies.append(time.perf_counter() - t)
    finally:
        stop.set()
        t_ping.join()
    return {"tokens": MAX_TOKENS, "chunk_size": 16, "encoding": encoding, "body_bytes": len(req),
            "latency_ms": median(latencies) * 1e3, "worst_healthz_ms": worst[0] * 1e3}


def run(quick: bool = False, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    duration = 1.0 if quick else 4.0
    port = _free_port()
    rows: list[dict[str, Any]] = []
    chunks = (128,) if quick else (128, 16)
    conns_levels = (4,) if quick else (4, 8)
    _, stored = _prompts(0)
    with Daemon("--chunk-size", "16", "--metrics-port", str(port), pool_gb=0.5, hugepages=hugepages) as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        for chunk in chunks:
            entries = _fill(daemon.socket_path, chunk, stored)
            for encoding in ENCODINGS:
                requests = _bodies(1, encoding, 64, _model(chunk))
                for conns in conns_levels:
                    r = _rate(port, pid, requests, conns, duration)
                    row = {"what": "usable_prefix", "chunk_size": chunk, "encoding": encoding,
                           "connections": conns, "depth": DEPTH, "prompt_tokens": PROMPT_TOKENS,
                           "entries": entries, **r}
                    rows.append(row)
                    log(f"  chunk {chunk:>3} {row['encoding']:<7} {conns} conns x {DEPTH} in flight: "
                        f"{r['lookups_s']:8.0f} lookups/s, daemon CPU {r['daemon_cpu_us']:.0f} us per lookup")
        health = [b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"]
        r = _rate(port, pid, health, conns_levels[-1], duration)
        rows.append({"what": "healthz (HTTP floor)", "connections": conns_levels[-1], "depth": DEPTH, **r})
        log(f"  GET /healthz, {conns_levels[-1]} conns: {r['lookups_s']:8.0f} answers/s, daemon CPU "
            f"{r['daemon_cpu_us']:.0f} us per answer")
        long_rows = []
        if 16 in chunks:
            for encoding in ENCODINGS:
                lr = _long_prompt(port, encoding)
                long_rows.append(lr)
                log(f"  {lr['tokens']} tokens ({lr['encoding']}, {lr['body_bytes'] >> 10} KiB): "
                    f"{lr['latency_ms']:.1f} ms; slowest /healthz meanwhile {lr['worst_healthz_ms']:.1f} ms")
    best = max((r["lookups_s"] for r in rows if r["what"] == "usable_prefix"), default=0.0)
    return {"config": {"duration_s": duration, "client_procs": CLIENT_PROCS, "depth": DEPTH,
                       "prompt_tokens": PROMPT_TOKENS, "stored_prompts": PROMPTS, "groups": "full, swa, 2 mamba"},
            "rows": rows, "long": long_rows, "summary": {"best_lookups_s": best, "target_lookups_s": 10_000}}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["request", "chunk", "token ids", "connections x in flight", "lookups/s", "daemon CPU us/lookup"]
    rows = []
    for r in result["rows"]:
        rows.append([r["what"], r.get("chunk_size", ""), r.get("encoding", ""), f"{r['connections']} x {r['depth']}",
                     f"{r['lookups_s']:.0f}", f"{r['daemon_cpu_us']:.0f}"])
    return headers, rows


def notes(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"Prompts of {result['config']['prompt_tokens']} tokens; best {s['best_lookups_s']:.0f} lookups/s "
             f"(target {s['target_lookups_s']})."]
    for lr in result.get("long", []):
        lines.append(f"One prompt of {lr['tokens']} tokens at chunk {lr['chunk_size']} ({lr['encoding']}, "
                     f"{lr['body_bytes'] >> 10} KiB): {lr['latency_ms']:.1f} ms; the slowest `/healthz` on another "
                     f"connection meanwhile: {lr['worst_healthz_ms']:.1f} ms.")
    return "\n\n".join(lines)


def plot(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    return []


if __name__ == "__main__":
    res = run(quick="--quick" in sys.argv)
    from bench.common import md_table

    print(md_table(*table(res)))
    print(notes(res))
