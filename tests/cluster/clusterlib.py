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
MASTER_HTTP_PORT = 9003  # mooncake_master's metrics and admin port: /get_all_keys lists every key
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


def write_key(path: Path) -> Path:
    """A fleet key file as an operator makes one: 32 random bytes in hex, mode 600."""
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


class Cluster:
    def __init__(self, veth: dict[str, str], workdir: Path) -> None:
        self.veth = veth
        self.workdir = workdir
        self.master: subprocess.Popen[bytes] | None = None
        self.nodes: list[Node] = []
        self.url = f"mooncake://{veth['ip_p']}:{MASTER_PORT}"
        self.key_file = write_key(workdir / "fleet.key")  # every node's, unless a test says otherwise

    def start_master(self) -> None:
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115
        self.master = subprocess.Popen(["ip", "netns", "exec", self.veth["ns_p"], str(master_binary()),
                                        "--port", str(MASTER_PORT), "--metrics_port", str(MASTER_HTTP_PORT)],
                                       stdout=log, stderr=subprocess.STDOUT)
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
        """A daemon in node 1's ("p") or node 2's ("d") namespace, joined to the master; with the fleet
        key file unless ``args`` name keys (or a --config that does)."""
        own = any(a in args for a in ("--cluster-key-file", "--cluster-insecure", "--config"))
        keys = [] if own else ["--cluster-key-file", str(self.key_file)]
        n = Node(self.workdir, name, self.veth[f"ns_{where}"], ["--cluster", self.url, *keys, *args])
        n.spawn()
        self.nodes.append(n)
        n.wait_ready(60)
        if wait:
            n.wait_status(lambda s: s["cluster"]["connected"], 60)
        return n

    def _client(self, body: str) -> None:
        """Run ``body`` with ``s``, a plain Mooncake client, in a child in node 1's namespace: any host on the
        cluster's network can do as much."""
        code = (
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"assert s.setup({self.veth['ip_p']!r}, 'P2PHANDSHAKE', 0, 64 << 20, 'tcp', '', "
            f"'{self.veth['ip_p']}:{MASTER_PORT}') == 0\n"
            f"{body}"
            "s.close()\n")
        r = subprocess.run(["ip", "netns", "exec", self.veth["ns_p"], sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr[-3000:]

    def corrupt_value(self, key: str) -> None:
        """Rewrite a value in the cluster with one payload bit flipped, same size."""
        self._client(
            f"raw = bytearray(s.get({key!r}))\n"
            "assert len(raw) > 1000, len(raw)\n"
            "raw[-777] ^= 1\n"
            f"assert s.remove({key!r}, True) == 0\n"
            f"assert s.put({key!r}, bytes(raw)) == 0\n")

    def forge_value(self, key: str, payload_of: str, claim_key_id: bool) -> None:
        """Replace the value at ``key`` with a well-formed one whose payload is the value at ``payload_of``'s
        (real KV, for the wrong tokens): its header names the right entry, and it is sealed with a key the
        fleet does not hold. ``claim_key_id``: the header names the fleet key's id, as a forger can copy it
        from any genuine value."""
        self._client(
            "import os\n"
            "from hkvd.daemon.tiers.cluster_value import FleetKeys, MAGIC, VERSION\n"
            "from hkvd.daemon.tiers.disk_format import HEADER_BYTES, parse_head\n"
            f"genuine = s.get({key!r})\n"
            f"payload = s.get({payload_of!r})[HEADER_BYTES:]\n"
            "assert len(genuine) > HEADER_BYTES and len(payload) == len(genuine) - HEADER_BYTES\n"
            "header = parse_head(genuine, MAGIC, VERSION)\n"
            "forged = bytearray(FleetKeys(os.urandom(32)).seal(header, [memoryview(payload)]))\n"
            f"if {claim_key_id}:\n"
            "    forged[24:28] = genuine[24:28]\n"
            f"assert s.remove({key!r}, True) == 0\n"
            f"assert s.put({key!r}, bytes(forged) + payload) == 0\n")


    def value_keys(self) -> list[str]:
        """Every key the master holds, sorted (its /get_all_keys, from node 1's namespace)."""
        code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{MASTER_HTTP_PORT}"
                "/get_all_keys', timeout=30).read().decode())")
        out = subprocess.run(["ip", "netns", "exec", self.veth["ns_p"], sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return sorted(k for k in out.split() if k)

    def forge_chunk(self) -> int:
        """Forge every group's value of one chunk (the first chunk key in order) with another chunk's real KV of
        the same group (``forge_value``, claiming the fleet key's id); returns how many values were forged."""
        by_group: dict[str, list[str]] = {}
        for key in self.value_keys():
            by_group.setdefault(key.rsplit("/", 2)[1], []).append(key)
        chunk = min(key.rsplit("/", 1)[1] for keys in by_group.values() for key in keys)
        forged = 0
        for keys in by_group.values():
            victim = next((k for k in keys if k.endswith("/" + chunk)), None)
            donor = next((k for k in keys if k != victim), None)
            if victim is not None and donor is not None:
                self.forge_value(victim, donor, claim_key_id=True)
                forged += 1
        return forged


def scrape(node: Node, port: int) -> str:
    """GET /metrics of a daemon inside its namespace (it listens on that namespace's loopback)."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    return subprocess.run(["ip", "netns", "exec", node.ns, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, check=True).stdout


