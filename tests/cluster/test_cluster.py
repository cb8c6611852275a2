"""The cluster tier against a real Mooncake Store: two daemons in two network namespaces.

An engine on node 1 stores prompts (attention-only, and a hybrid layout whose three Mamba groups' states
travel by step events); a NEW engine process on node 2, whose pool never saw them, looks them up and
retrieves them: the hits and every byte must match. Then the faults: a corrupted value is a miss; a value
forged by a host on the cluster's network (well-formed, sealed with a key the fleet does not hold) is a miss;
the master killed mid-run leaves both nodes serving and hits return after its restart; node 1 restarted and
node 2 still hits (two replicas). And the fleet key changed while both nodes serve, as docs/cluster.md says.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hkvd.daemon.tiers.cluster_value import key_id, value_key
from hkvd.shim.testing.synthetic import SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

_spec = importlib.util.spec_from_file_location("hkvd_test_cold_restart",
                                               Path(__file__).resolve().parents[1] / "ops" / "test_cold_restart.py")
assert _spec is not None and _spec.loader is not None
cold = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cold)  # the store and fetch helpers of the disk tier's restart test

ATTN, ATTN_KW, HYBRID, HYBRID_KW, MAMBA, BLOCK = (cold.ATTN, cold.ATTN_KW, cold.HYBRID, cold.HYBRID_KW, cold.MAMBA,
                                                  cold.BLOCK)


def _attn(node: Any, seeds: dict[int, int]) -> tuple[dict[int, list[bytes]], dict[int, dict[int, bytes]], bytes]:
    """Store attention prompts (seed -> chunks) on ``node``; their keys, bytes, and the engine fingerprint."""
    eng = SyntheticEngine(node.socket_path, ATTN, **ATTN_KW)
    keys = {s: chunk_keys(prompt_tokens(32 * n, seed=s), 32) for s, n in seeds.items()}
    data = {s: cold.attn_store(eng, k, s) for s, k in keys.items()}
    fp = eng.fingerprint
    eng.close()
    return keys, data, fp


def _fetch_attn(node: Any, keys: list[bytes], n: int | None = None) -> dict[str, Any]:
    return cold.fetch(node.socket_path, ATTN, ATTN_KW, keys, cold.attn_items(keys)[:n])


def _check_attn(res: dict[str, Any], data: dict[int, bytes], n: int) -> None:
    assert res["hit_chunks"] == n
    for i in range(n):
        assert res["blocks"][(0, 100 + 2 * i)] + res["blocks"][(0, 101 + 2 * i)] == data[i]


def _puts(lib: Any, node: Any, n: int) -> dict[str, Any]:
    """Wait until ``node`` has put ``n`` values in the cluster."""
    return node.wait_status(lambda s: s["cluster"]["puts"] >= n and s["cluster"]["queued"] == 0, 60)


def test_node2_hits_what_node1_stored_byte_exact(cluster: Any, lib: Any) -> None:
    n1 = cluster.node("node1", "p")
    n2 = cluster.node("node2", "d", "--metrics-port", "9466")
    keys, data, _fp = _attn(n1, {1: 8, 2: 5})
    heng = SyntheticEngine(n1.socket_path, HYBRID, **HYBRID_KW)
    hkeys = chunk_keys(prompt_tokens(BLOCK * 6, seed=4), BLOCK)
    hybrid = cold.hybrid_store(heng, hkeys, 4, [0])
    heng.close()
    # 13 attention chunks + 6 hybrid chunks x (1 attention + 3 Mamba states, each once confirmed)
    s1 = _puts(lib, n1, 13 + 6 * 4)
    assert s1["cluster"]["puts"] == 13 + 6 * 4 and s1["cluster"]["errors"] == {}

    for seed, k in keys.items():
        _check_attn(_fetch_attn(n2, k), data[seed], len(k))
    n = len(hkeys)
    items = [Item(0, i, hkeys[i], [60 + i]) for i in range(n)]
    items += [Item(g, n - 1, hkeys[n - 1], [90 + g]) for g in MAMBA]  # the state at exactly n chunks
    res = cold.fetch(n2.socket_path, HYBRID, HYBRID_KW, hkeys, items)
    assert res["hit_chunks"] == n
    for i in range(n):
        assert res["blocks"][(0, 60 + i)] == hybrid[(0, i)]
    for g in MAMBA:
        assert res["blocks"][(g, 90 + g)] == hybrid[(g, n - 1)]

    s2 = n2.status()
    # Read from the cluster: every attention chunk, and only the last Mamba state of the hybrid prompt.
    assert s2["by_kind"]["cluster_hits"] == {"full": 13 + 6, "mamba": 3}
    c2 = s2["cluster"]
    assert c2["gets"] == 22 and c2["corrupt"] == {} and c2["errors"] == {} and c2["puts"] == 0
    assert c2["get_bytes"] > 0
    # It came over the veth: node 1's daemon holds a TCP connection from node 2's address.
    conns = subprocess.run(["ip", "netns", "exec", cluster.veth["ns_p"], "ss", "-tn"], capture_output=True,
                           text=True, timeout=10, check=True).stdout
    assert cluster.veth["ip_d"] in conns
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "status", "--socket", n2.socket_path],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("cluster "))
    assert "connected" in line and "22 entries read" in line
    assert f"clust-key values sealed with fleet key {_key_id(cluster.key_file)}\n" in out
    metrics = lib.scrape(n2, 9466)
    assert 'hkvd_cluster_hits_total{kind="mamba"} 3.0' in metrics
    assert "hkvd_cluster_gets_total 22.0" in metrics and "hkvd_cluster_connected 1.0" in metrics
    assert "hkvd_cluster_insecure 0.0" in metrics


def test_a_corrupt_value_is_a_miss_never_bytes(cluster: Any, lib: Any) -> None:
    n1 = cluster.node("node1", "p")
    n2 = cluster.node("node2", "d")
    keys, data, fp = _attn(n1, {11: 8})
    _puts(lib, n1, 8)
    cluster.corrupt_value(value_key((fp, 0, keys[11][3])))
    _check_attn(_fetch_attn(n2, keys[11], 3), data[11], 3)  # chunk 3 fails its MAC: the hit stops before it
    s = n2.status()
    assert s["cluster"]["corrupt"] == {"mac": 1}
    assert s["counters"]["cluster_read_failures"] == 1
    assert "is unusable (the value's MAC does not verify" in n2.log()
    # Removed from the cluster: asked again, it is simply absent (recompute), never served.
    _check_attn(_fetch_attn(n2, keys[11], 3), data[11], 3)
    assert n2.status()["cluster"]["corrupt"] == {"mac": 1}


def test_a_value_forged_under_another_key_is_a_miss_and_the_fleets_values_still_hit(cluster: Any, lib: Any) -> None:
    n1 = cluster.node("node1", "p")
    n2 = cluster.node("node2", "d")
    keys, data, fp = _attn(n1, {51: 8, 52: 6, 53: 6})
    _puts(lib, n1, 20)
    # Another host writes, under real keys, values with the right header and real KV of the wrong tokens
    # (another prompt's chunk), sealed with its own key; the second claims the fleet key's id as well.
    cluster.forge_value(value_key((fp, 0, keys[51][3])), value_key((fp, 0, keys[52][3])), claim_key_id=False)
    cluster.forge_value(value_key((fp, 0, keys[53][2])), value_key((fp, 0, keys[52][2])), claim_key_id=True)
    _check_attn(_fetch_attn(n2, keys[51], 3), data[51], 3)  # the hit stops before the forged chunk
    _check_attn(_fetch_attn(n2, keys[53], 2), data[53], 2)
    _check_attn(_fetch_attn(n2, keys[52]), data[52], 6)  # what node 1 wrote under the fleet key still hits
    s = n2.status()
    assert s["cluster"]["corrupt"] == {"mac": 2} and s["counters"]["cluster_read_failures"] == 2
    log = n2.log()
    assert "which this node does not hold" in log and "does not verify under fleet key" in log
    # Removed: asked again, they are absent (recompute), never served.
    _check_attn(_fetch_attn(n2, keys[51], 3), data[51], 3)
    assert n2.status()["cluster"]["corrupt"] == {"mac": 2}


def _config(path: Path, key: Path, accept: Path | None = None) -> None:
    path.write_text(f'cluster-key-file = "{key}"\n' + (f'cluster-accept-key-file = "{accept}"\n' if accept else ""))


def _key_id(path: Path) -> str:
    return f"{key_id(path.read_bytes().strip()):08x}"


def _reload(node: Any, conf: Path, key: Path, accept: Path | None = None) -> None:
    """Rewrite ``node``'s config and send SIGHUP (``systemctl reload hkvd``); wait until it applied."""
    done = node.log().count("SIGHUP: config reloaded")
    _config(conf, key, accept)
    os.kill(node.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while node.log().count("SIGHUP: config reloaded") == done:
        assert time.monotonic() < deadline, node.log()[-3000:]
        time.sleep(0.05)
    c = node.status()["cluster"]
    assert (c["key_id"], c["accepted_key_ids"]) == (_key_id(key), [_key_id(accept)] if accept else [])


def test_the_fleet_key_changes_while_both_nodes_serve(cluster: Any, lib: Any, tmp_path: Path) -> None:
    old, new = cluster.key_file, lib.write_key(tmp_path / "next.key")
    c1, c2 = tmp_path / "node1.toml", tmp_path / "node2.toml"
    _config(c1, old)
    _config(c2, old)
    n1 = cluster.node("node1", "p", "--config", str(c1))
    n2 = cluster.node("node2", "d", "--config", str(c2))
    keys, data, _ = _attn(n1, {61: 4, 62: 4})  # sealed with the old key; node 2 reads 62 only at the end
    _puts(lib, n1, 8)
    _check_attn(_fetch_attn(n2, keys[61]), data[61], 4)
    # 1. Every node accepts the new key too.
    _reload(n1, c1, old, new)
    _reload(n2, c2, old, new)
    # 2. Node by node, seal with the new key and accept the old one: both directions read meanwhile.
    _reload(n1, c1, new, old)
    k63, d63, _ = _attn(n1, {63: 4})  # sealed with the new key, read by node 2 still sealing with the old
    _puts(lib, n1, 12)
    _check_attn(_fetch_attn(n2, k63[63]), d63[63], 4)
    k64, d64, _ = _attn(n2, {64: 4})  # sealed with the old key, read by node 1
    _puts(lib, n2, 4)
    _check_attn(_fetch_attn(n1, k64[64]), d64[64], 4)
    _reload(n2, c2, new, old)
    # 3. The old key dropped everywhere: values sealed with the new one hit, those sealed with the old are misses.
    _reload(n1, c1, new)
    _reload(n2, c2, new)
    k65, d65, _ = _attn(n1, {65: 4})
    _puts(lib, n1, 16)
    _check_attn(_fetch_attn(n2, k65[65]), d65[65], 4)
    assert _fetch_attn(n2, keys[62], 0)["hit_chunks"] == 0
    s2 = n2.status()["cluster"]
    assert s2["corrupt"] == {"mac": 4} and s2["errors"] == {}
    assert n1.status()["cluster"]["corrupt"] == {} and "which this node does not hold" in n2.log()
    # A key file that fails its checks on a reload is refused; the running keys stay.
    bad = lib.write_key(tmp_path / "bad.key")
    bad.chmod(0o644)
    _config(c2, bad)
    os.kill(n2.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "fleet keys not reloaded, keeping the running ones" not in n2.log():
        assert time.monotonic() < deadline, n2.log()[-3000:]
        time.sleep(0.05)
    assert n2.status()["cluster"]["key_id"] == _key_id(new)
    _check_attn(_fetch_attn(n2, k65[65]), d65[65], 4)


def test_master_killed_mid_run_then_restarted(cluster: Any, lib: Any) -> None:
    n1 = cluster.node("node1", "p")
    n2 = cluster.node("node2", "d", "--cluster-lookup-timeout-ms", "300")
    keys, data, _ = _attn(n1, {21: 6})
    _puts(lib, n1, 6)
    _check_attn(_fetch_attn(n2, keys[21]), data[21], 6)

    cluster.stop_master(kill=True)
    for n in (n1, n2):
        n.wait_status(lambda s: not s["cluster"]["connected"], 30)
    # Both keep serving: node 1 stores (the cluster copy is skipped and counted), node 2 hits what its
    # pool holds and misses the rest, no request fails.
    down, ddata, _ = _attn(n1, {22: 4})
    _check_attn(_fetch_attn(n1, down[22]), ddata[22], 4)
    _check_attn(_fetch_attn(n2, keys[21]), data[21], 6)
    assert _fetch_attn(n2, down[22], 0)["hit_chunks"] == 0
    s1 = n1.status()
    assert s1["cluster"]["skips"].get("unavailable", 0) >= 4

    cluster.start_master()
    for n in (n1, n2):
        n.wait_status(lambda s: s["cluster"]["connected"], 60)
    # A master restart loses its metadata; what is stored after it hits again.
    after, adata, _ = _attn(n1, {23: 5})
    _puts(lib, n1, 6 + 5)
    _check_attn(_fetch_attn(n2, after[23]), adata[23], 5)
    s2 = n2.status()
    assert s2["cluster"]["reconnects"] >= 1
    assert "master unreachable" in n2.log() and "master reachable again" in n2.log()


def test_node1_restarted_and_node2_still_hits(cluster: Any, lib: Any) -> None:
    n1 = cluster.node("node1", "p", "--cluster-replicas", "2")
    n2 = cluster.node("node2", "d", "--cluster-replicas", "2")
    keys, data, _ = _attn(n1, {31: 8})
    _puts(lib, n1, 8)
    assert n1.stop() == 0  # its segment (one replica of each value) leaves the cluster with it
    n1b = cluster.node("node1b", "p", "--cluster-replicas", "2")
    _check_attn(_fetch_attn(n2, keys[31]), data[31], 8)
    assert n2.status()["cluster"]["gets"] == 8
    assert n1b.status()["cluster"]["puts"] == 0
