"""Helpers for cluster-tier tests: a real mooncake_master, hkvd daemons in network namespaces.

Loaded by path (``conftest.py``), since test folders are not packages under --import-mode=importlib.
The pytest process never imports Mooncake: the daemons do, and ``corrupt_value`` runs a child in
node 1's namespace.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from hkvd.shim.testing.launcher import DaemonProcess

MASTER_PORT = 50051
NODE_ARGS = ["--hugepages", "off", "--log-level", "debug", "--l1-size-gb", "0.125", "--cluster-segment-gb", "0.125",
             "--cluster-lookup-timeout-ms", "5000"]


def mooncake_missing() -> str | None:
    """Why cluster tests cannot run here, or None."""
    if importlib.util.find_spec("mooncake") is None:
        return ("Mooncake is not installed (the cluster tier needs it): pip install -e '.[cluster]' and "
                "apt-get install -y libibverbs1, or `make dev`")
    if not master_binary().exists():
        return f"mooncake_master is not at {master_binary()} (reinstall hkvd[cluster])"
    return None


def master_binary() -> Path:
    return Path(sys.executable).parent / "mooncake_master"


class Node(DaemonProcess):
    """``hkvd serve --cluster`` inside a network namespace."""

    def __init__(self, workdir: Path, name: str, ns: str, args: list[str]) -> None:
        self.name = name
        self.ns = ns
        super().__init__(str(workdir / f"{name}.sock"), [*NODE_ARGS, *args], workdir / f"{name}.log",
                         dict(os.environ), ["ip", "netns", "exec", ns])


class Cluster:
    def __init__(self, veth: dict[str, str], workdir: Path) -> None:
        self.veth = veth
        self.workdir = workdir
        self.master: subprocess.Popen[bytes] | None = None
        self.nodes: list[Node] = []
        self.url = f"mooncake://{veth['ip_p']}:{MASTER_PORT}"

    def start_master(self) -> None:
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115
        self.master = subprocess.Popen(["ip", "netns", "exec", self.veth["ns_p"], str(master_binary()),
                                        "--port", str(MASTER_PORT)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # listening once `ss` in its namespace shows the port
            r = subprocess.run(["ip", "netns", "exec", self.veth["ns_p"], "ss", "-ltn", f"sport = :{MASTER_PORT}"],
                               capture_output=True, text=True, timeout=10, check=False)
            if f":{MASTER_PORT}" in r.stdout:
                return
            time.sleep(0.1)
        log_text = (self.workdir / "master.log").read_text()
        raise AssertionError(f"mooncake_master did not listen within 30 s:\n{log_text}")

    def stop_master(self, kill: bool = False) -> None:
        if self.master is not None and self.master.poll() is None:
            if kill:
                self.master.kill()
            else:
                self.master.terminate()
            self.master.wait(20)
        self.master = None

    def node(self, name: str, where: str = "p", *args: str, wait: bool = True) -> Node:
        """A daemon in node 1's ("p") or node 2's ("d") namespace, joined to the master."""
        n = Node(self.workdir, name, self.veth[f"ns_{where}"], ["--cluster", self.url, *args])
        n.spawn()
        self.nodes.append(n)
        n.wait_ready(60)
        if wait:
            n.wait_status(lambda s: s["cluster"]["connected"], 60)
        return n

    def corrupt_value(self, key: str) -> None:
        """Rewrite a value in the cluster with one payload bit flipped, same size (a child in node 1's namespace)."""
        code = (
            "import sys\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"assert s.setup({self.veth['ip_p']!r}, 'P2PHANDSHAKE', 0, 64 << 20, 'tcp', '', "
            f"'{self.veth['ip_p']}:{MASTER_PORT}') == 0\n"
            f"raw = bytearray(s.get({key!r}))\n"
            "assert len(raw) > 1000, len(raw)\n"
            "raw[-777] ^= 1\n"
            f"assert s.remove({key!r}, True) == 0\n"
            f"rc = s.put({key!r}, bytes(raw))\n"
            "assert rc == 0, rc\n"
            "s.close()\n")
        r = subprocess.run(["ip", "netns", "exec", self.veth["ns_p"], sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr[-3000:]


def scrape(node: Node, port: int) -> str:
    """GET /metrics of a daemon inside its namespace (it listens on that namespace's loopback)."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    return subprocess.run(["ip", "netns", "exec", node.ns, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, check=True).stdout


