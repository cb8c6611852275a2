"""LMCache multiprocess-server ping rate, run with the LMCache venv's python (``make bench-peers``).

Imports only the standard library and lmcache (never hkvd). Starts ``lmcache server`` (or, where
that entry point is missing, ``python -m lmcache.v1.multiprocess.server``) on a free port with a
small CPU buffer, sends ``n`` NOOP requests one at a time through LMCache's own message-queue
client, and prints ``{"ops_s", "p50_us", "p99_us", "version"}`` as one JSON line.

Written against LMCache's multiprocess protocol (``lmcache.v1.multiprocess``: ``MessageQueueClient``,
``RequestType.NOOP``); not yet run against 0.5.6 here: if that API moved, this script fails with
the import or call that broke, and the rest of the bench is unaffected.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--start-timeout-s", type=float, default=120.0)
    a = ap.parse_args()
    import lmcache  # noqa: F401 - fail early and clearly when it is not installed
    import zmq
    from lmcache.v1.multiprocess.mq import MessageQueueClient
    from lmcache.v1.multiprocess.protocol import RequestType

    port = _free_port()
    exe = shutil.which("lmcache", path=os.path.dirname(sys.executable))
    args = ["--host", "127.0.0.1", "--port", str(port), "--cpu-buffer-size", "1"]
    cmd = [exe, "server", *args] if exe else [sys.executable, "-m", "lmcache.v1.multiprocess.server", *args]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ctx = zmq.Context()
        client = MessageQueueClient(f"tcp://127.0.0.1:{port}", ctx)
        deadline = time.monotonic() + a.start_timeout_s
        while True:  # wait for the server to answer one NOOP
            if server.poll() is not None:
                raise RuntimeError(f"lmcache server exited: {server.stderr.read()[-2000:] if server.stderr else ''}")
            try:
                client.submit_request(RequestType.NOOP, []).result(timeout=1.0)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
        lat = []
        for _ in range(a.n):
            t0 = time.perf_counter()
            client.submit_request(RequestType.NOOP, []).result(timeout=10.0)
            lat.append((time.perf_counter() - t0) * 1e6)
        lat.sort()
        print(json.dumps({"ops_s": 1e6 / (sum(lat) / len(lat)), "p50_us": lat[len(lat) // 2],
                          "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                          "version": getattr(sys.modules["lmcache"], "__version__", "?")}))
        client.close()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
