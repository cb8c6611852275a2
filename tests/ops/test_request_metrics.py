"""Hits and misses by group kind, copy throughput, and request ids in the logs, from a real daemon."""

from __future__ import annotations

import re
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import NotFound
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

BLOCK = 16
HYBRID = [GroupShape("full", 2, 8192)] + [GroupShape("mamba", 2, 5000, 8192)] * 3
HYBRID_KW = {"num_blocks": 64, "tokens_per_block": BLOCK, "chunk_size": BLOCK, "aliased": True}
MAMBA = (1, 2, 3)


def samples(port: int, web) -> dict:
    out = {}
    for fam in text_string_to_metric_families(web.get(port, "/metrics")[1]):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_hits_and_misses_by_group_kind_and_copy_throughput(daemon_factory, web):
    port = web.free_port()
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", "32", "--metrics-port", str(port))
    eng = SyntheticEngine(d.socket_path, HYBRID, **HYBRID_KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 4, seed=31), BLOCK)
    # Attention for all 4 chunks; Mamba states only after chunk 1 (offered at step 1, confirmed at step 2).
    c = eng.client
    eng.store([Item(0, i, k, [1 + i]) for i, k in enumerate(keys)])
    eng.run(c.submit_step_event(0, 0, [], []))
    offer = c.submit_step_event(1, 1, [Item(g, 1, keys[1], [40 + g]) for g in MAMBA], [])
    eng.run(offer)
    eng.run(c.submit_step_event(2, 2, [], [offer]))
    hit, lease = eng.lookup(keys)
    assert hit == 2
    eng.retrieve([Item(0, 0, keys[0], [10]), Item(0, 1, keys[1], [11])]
                 + [Item(g, 1, keys[1], [50 + g]) for g in MAMBA], lease)
    assert eng.lookup(chunk_keys(prompt_tokens(BLOCK * 4, seed=32), BLOCK), lease=False)[0] == 0
    m = samples(port, web)
    # The hit of 2 loads 2 attention chunks and one state per Mamba group; the states missing at 4 and 3
    # chunks cut it short (one probe each: the first Mamba group stops the candidate); the new prompt
    # misses on its first attention chunk.
    assert m[("hkvd_lookup_hit_entries_total", (("kind", "full"),))] == 2
    assert m[("hkvd_lookup_hit_entries_total", (("kind", "mamba"),))] == 3
    assert m[("hkvd_lookup_miss_entries_total", (("kind", "mamba"),))] == 2
    assert m[("hkvd_lookup_miss_entries_total", (("kind", "full"),))] == 1
    assert m[("hkvd_copy_gbps", (("direction", "store"),))] > 0
    assert m[("hkvd_copy_gbps", (("direction", "retrieve"),))] > 0
    assert ("hkvd_l2_entries", ()) not in m  # no disk tier configured
    # By engine (model, rank): the hit of 2 chunks and the miss of 4 (the first lookup's 2 missing chunks and
    # the new prompt's 4), in tokens; the bytes stored and retrieved. One latency observation per request.
    engine = [labels for name, labels in m if name == "hkvd_engine_lookup_hit_tokens_total"]
    assert len(engine) == 1 and dict(engine[0]).keys() == {"model", "rank"}
    assert m[("hkvd_engine_lookup_hit_tokens_total", engine[0])] == 2 * eng.chunk_size
    assert m[("hkvd_engine_lookup_miss_tokens_total", engine[0])] == 6 * eng.chunk_size
    assert m[("hkvd_engine_stored_bytes_total", engine[0])] == sum(
        v for (name, _), v in m.items() if name == "hkvd_stored_bytes_total")
    assert m[("hkvd_engine_retrieved_bytes_total", engine[0])] == sum(
        v for (name, _), v in m.items() if name == "hkvd_retrieved_bytes_total") > 0
    assert m[("hkvd_request_duration_seconds_count", (("op", "lookup"),))] == 2
    assert m[("hkvd_request_duration_seconds_bucket", (("le", "+Inf"), ("op", "retrieve")))] == 1
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "status", "--socket", d.socket_path],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert lines["kinds"].endswith("full 2/1, mamba 3/2")
    assert re.search(r"retrieve \d+\.\d\d GB/s, store \d+\.\d\d GB/s", lines["copy"])
    assert lines["disk"].startswith("disk      off")
    eng.close()


def test_request_ids_follow_a_request_through_the_log(daemon):
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, 4096)], num_blocks=16)
    keys = chunk_keys(prompt_tokens(64, seed=41), eng.chunk_size)
    rid = eng.client.submit_retrieve(eng.items(0, keys, first_block=1))
    err = eng.client.wait([rid], 10.0)[rid].error
    assert isinstance(err, NotFound)
    store = eng.client.submit_store(eng.items(0, keys, first_block=1))
    eng.client.abort(store)
    eng.client.wait([store], 10.0)  # Done or ABORTED, whichever won the race
    eng.close()
    daemon.stop()
    log = daemon.log().splitlines()
    failed = [ln for ln in log if f" req_id={rid} " in ln]
    assert len(failed) == 1, "\n".join(log)
    assert re.match(r"ts=\S+ \S+ level=info logger=hkvd\.server pid=\d+ engine=\d+ peer_pid=\d+ req_id=\d+ "
                    r'msg="request failed: NOT_FOUND: group 0 chunk 0 is not in the cache', failed[0]), failed[0]
    assert any(f" req_id={store} " in ln and 'msg="abort requested"' in ln for ln in log)
