"""Helpers for peer-link tests: two real ``hkvd serve`` processes with NIXL over TCP.

Loaded by path (``load()``), since test folders are not packages under --import-mode=importlib.
The pytest process itself never imports NIXL: only the daemons do (UCX must not be forked).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import signal
import socket
from pathlib import Path
from typing import Any

from hkvd.shim.testing.launcher import DaemonProcess

TOKEN = "hkvd-test-token-0123456789abcdef"
# UCX over TCP on loopback; larger TCP segments (small ones collapsed over veth in measurements).
UCX_ENV = {
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "512K",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def nixl_missing() -> str | None:
    """Why peer tests cannot run here, or None."""
    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        return ("NIXL is not installed (peer links need it): `pip install --no-deps nixl-cu12==1.5.1`, "
                "or `make dev`")
    return None


def free_port() -> int:
    """A port free now on 127.0.0.1, below the kernel's ephemeral range: a port the kernel hands out (a bind to
    port 0, as UCX's listeners do in the daemons being started) could be taken again before the daemon that
    is given it binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(low - 12_000, 1024), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 below the ephemeral range (from {low}) in 200 tries")


def write_token(path: Path, value: str = TOKEN) -> Path:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


class PeerDaemon(DaemonProcess):
    """``hkvd serve`` with peers on, debug logs, huge pages off, UCX over TCP."""

    def __init__(self, workdir: Path, name: str, args: list[str], env: dict[str, str] | None = None,
                 prefix: list[str] | None = None) -> None:
        self.name = name
        full_env = {**os.environ, **UCX_ENV, **(env or {})}
        super().__init__(str(workdir / f"{name}.sock"),
                         ["--hugepages", "off", "--log-level", "debug", *args], workdir / f"{name}.log", full_env,
                         prefix)
        self.peer_address = ""
        self.frozen: list[int] = []  # pids stopped by freeze()


def start_pair(workdir: Path, *, chunk_size: int = 32, pool_gb: str = "0.25", token: str = TOKEN,
               serve_args: tuple[str, ...] = (), pull_args: tuple[str, ...] = (),
               decode_token: str | None = None) -> tuple[PeerDaemon, PeerDaemon]:
    """A serving ("prefill") daemon with --peer-listen and a pulling ("decode") one."""
    port = free_port()
    common = ["--l1-size-gb", pool_gb, "--chunk-size", str(chunk_size)]
    ptok = write_token(workdir / "prefill.token", token)
    dtok = write_token(workdir / "decode.token", decode_token if decode_token is not None else token)
    prefill = PeerDaemon(workdir, "prefill", [*common, "--peer-token-file", str(ptok),
                                               "--peer-listen", f"127.0.0.1:{port}", *serve_args])
    prefill.peer_address = f"127.0.0.1:{port}"
    decode = PeerDaemon(workdir, "decode", [*common, "--peer-token-file", str(dtok), *pull_args])
    prefill.spawn()
    decode.spawn()
    prefill.wait_ready(60)
    decode.wait_ready(60)
    return prefill, decode



def freeze(daemon: PeerDaemon) -> None:
    """SIGSTOP a daemon and its transport host (the process whose NIXL agent serves READs: over TCP a
    READ from a stopped target holds mid-way)."""
    host = int(daemon.status()["peer"]["transport"].get("host_pid", 0))
    daemon.frozen = [p for p in (daemon.proc.pid, host) if p]
    for pid in daemon.frozen:
        os.kill(pid, signal.SIGSTOP)


def thaw(daemon: PeerDaemon) -> None:
    for pid in getattr(daemon, "frozen", []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    daemon.frozen = []


def counter(status: dict[str, Any], name: str) -> float:
    return float(status["counters"].get(name, 0))
