"""KV hints on a real daemon's metrics port (``POST /v1/kv/hints``, docs/hints.md): each action's accepted outcome
has its effect (a pinned prefix outlives a flood that evicts its unpinned twin, a demoted prefix is evicted first,
a prefetched prefix is read from the disk tier into the pool so that a lookup hits it from memory), each bad input
gets its outcome and reason, and ``hkvd_hints_total`` counts them."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from hkvd.daemon.cli import format_status
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys
from tests.routing.test_usable_prefix_daemon import Router as UsablePrefixRouter
from tests.routing.test_usable_prefix_daemon import free_port

C = 16
PAGE = 128 << 10  # 2 layers: 256 KiB per entry; a 64 MiB pool holds about 250, the pin budget (0.5) about 125
SHAPES = [GroupShape("full", 2, PAGE)]
CHUNKS = 8
MODEL = "/models/tiny"
KW: dict[str, Any] = {"num_blocks": CHUNKS + 2, "tokens_per_block": C, "chunk_size": C, "model": MODEL}
FLOOD = 40  # prompts of 8 chunks: more than the pool holds


class Router(UsablePrefixRouter):
    """The usable-prefix tests' keep-alive client of the metrics port, with the hints' calls."""

    def hints(self, *actions: Any) -> list[dict[str, Any]]:
        env = {"protocol_version": 1, "message_id": "m-1",
               "actions": [{"action_id": f"a{i}", "action_version": "1.0", **a} if isinstance(a, dict) else a
                           for i, a in enumerate(actions)]}
        code, out = self.call("POST", "/v1/kv/hints", env)
        assert code == 200, out
        assert out["message_id"] == "m-1" and len(out["outcomes"]) == len(actions)
        return list(out["outcomes"])

    def pool_tokens(self, tokens: list[int]) -> dict[str, int]:
        code, out = self.call("POST", "/v1/usable_prefix", {"model": MODEL, "token_ids": tokens})
        assert code == 200, out
        return dict(out["tiers"])

    def metric(self, name: str, **labels: str) -> float:
        code, text = self.call("GET", "/metrics")
        assert code == 200
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.decode().splitlines():
            m = re.match(rf'{name}\{{(.*)\}} (\S+)$', line)
            if m and ",".join(sorted(m.group(1).split(","))) == want:
                return float(m.group(2))
        return 0.0


def prefix(tokens: list[int], **payload: Any) -> dict[str, Any]:
    return {"model": MODEL, "token_ids": tokens, **payload}


class Node:
    def __init__(self, socket_path: str, router: Router, eng: SyntheticEngine) -> None:
        self.socket_path = socket_path
        self.router = router
        self.eng = eng

    def store(self, seed: int) -> list[int]:
        tokens = prompt_tokens(CHUNKS * C + 1, seed=seed)
        keys = chunk_keys(tokens, C)
        self.eng.store(self.eng.items(0, keys, 1))
        return tokens

    def drain_disk(self) -> None:
        deadline = time.monotonic() + 10
        while self.eng.client.status()["l2"]["queued"]:
            assert time.monotonic() < deadline, "the disk tier's queue did not drain"
            time.sleep(0.02)

    def flood(self, first_seed: int) -> None:
        for seed in range(first_seed, first_seed + FLOOD):
            self.store(seed)


@pytest.fixture
def node(daemon_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", str(C), "--metrics-port", str(port),
                       "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1")
    eng = SyntheticEngine(d.socket_path, SHAPES, **KW)
    yield Node(d.socket_path, Router(port), eng)
    eng.close()


FULL = CHUNKS * C  # the pool's answer for a whole prefix: 8 chunks (the prompt has one token more)


def test_pin_outlives_a_flood_and_demote_goes_first(node: Node) -> None:
    r = node.router
    pinned, control = node.store(1), node.store(2)
    [out] = r.hints({"action_type": "pin", "payload": prefix(pinned, ttl_s=60, session="chat-1")})
    assert out["outcome"] == "accepted" and out["chunks"] == CHUNKS and out["session"] == "chat-1", out
    node.flood(100)
    assert r.pool_tokens(pinned)["pool"] == FULL  # held through the flood
    assert r.pool_tokens(control)["pool"] < FULL  # its twin, unpinned, was evicted
    # Demote: of two prefixes stored last, the demoted one is evicted by the next store, the other stays.
    kept, demoted = node.store(3), node.store(4)
    node.drain_disk()  # entries being written to the disk tier are held (read) until written
    [out] = r.hints({"action_type": "kv.demote", "payload": prefix(demoted)})
    assert out["outcome"] == "accepted" and out["chunks"] == CHUNKS, out
    node.store(5)
    assert r.pool_tokens(demoted)["pool"] == 0
    assert r.pool_tokens(kept)["pool"] == FULL
    # Demote naming the session ends its pins: the pinned prefix goes first now.
    node.drain_disk()
    [out] = r.hints({"action_type": "Demote", "payload": prefix(pinned, session="chat-1")})
    assert out["outcome"] == "accepted" and out["unpinned"] == 1 and out["chunks"] == CHUNKS, out
    node.store(6)
    assert r.pool_tokens(pinned)["pool"] == 0
    assert r.pool_tokens(kept)["pool"] == FULL
    assert r.metric("hkvd_hints_total", action="pin", outcome="accepted") == 1
    assert r.metric("hkvd_hints_total", action="demote", outcome="accepted") == 2


def test_prefetch_reads_the_disk_tier_into_the_pool(node: Node) -> None:
    r = node.router
    wanted, later = node.store(1), node.store(2)
    node.drain_disk()
    node.flood(100)
    node.drain_disk()
    assert r.pool_tokens(wanted)["pool"] < FULL and r.pool_tokens(wanted)["disk"] == FULL
    [out] = r.hints({"action_type": "prefetch", "payload": prefix(wanted)})
    assert out["outcome"] == "accepted" and out["chunks"] == CHUNKS, out
    assert r.pool_tokens(wanted)["pool"] == FULL
    # The lookup hits it from memory: no disk read on the way.
    reads = node.eng.client.status()["counters"].get("l2_hits", 0)
    eng = SyntheticEngine(node.socket_path, SHAPES, **KW)
    try:
        hit, lease = eng.lookup(chunk_keys(wanted, C))
        assert hit == CHUNKS
        eng.client.release(lease)
    finally:
        eng.close()
    assert node.eng.client.status()["counters"].get("l2_hits", 0) == reads
    # Dynamo's kv.fetch@1.0 is a prefetch; wait: false answers before the reads end (deferred).
    [out] = r.hints({"action_type": "kv.fetch@1.0", "payload": prefix(later, wait=False)})
    assert out["action"] == "prefetch" and out["outcome"] == "deferred", out
    deadline = time.monotonic() + 10
    while r.pool_tokens(later)["pool"] < FULL:
        assert time.monotonic() < deadline, "the deferred prefetch never brought the prefix in"
        time.sleep(0.05)
    [out] = r.hints({"action_type": "prefetch", "payload": prefix(later)})
    assert out["outcome"] == "accepted" and "already" in out["reason"], out
    assert r.metric("hkvd_hints_total", action="prefetch", outcome="deferred") == 1
    assert r.metric("hkvd_hints_total", action="prefetch", outcome="accepted") == 2


def test_bad_input_gets_an_outcome_and_a_reason(node: Node) -> None:
    r = node.router
    stored = node.store(1)
    nowhere = prompt_tokens(CHUNKS * C + 1, seed=999)
    long = prompt_tokens(200 * C + 1, seed=7)  # 200 chunks: over the pin budget (about 125 entries)
    outs = r.hints(
        {"action_type": "evict-now", "payload": prefix(stored)},
        {"action_type": "pin", "payload": prefix(stored, ttl_s=-5)},
        {"action_type": "pin", "payload": prefix(stored, ttl_s=10 ** 9)},
        {"action_type": "pin", "payload": prefix(stored)},
        {"action_type": "prefetch", "payload": prefix(nowhere)},
        {"action_type": "retain", "payload": prefix(nowhere)},
        {"action_type": "pin", "payload": {"model": "no-such-model", "token_ids": stored, "ttl_s": 5}},
        {"action_type": "share", "payload": prefix(stored, destination="worker-b")},
        {"action_type": "prefetch", "payload": prefix(stored, source="peer")},
        {"action_type": "pin", "payload": prefix(long, ttl_s=30)},
        {"action_type": "pin", "action_version": "7", "payload": prefix(stored, ttl_s=5)},
        {"action_type": "retain", "payload": prefix(stored, colour="blue")},
        "not an object",
    )
    got = [(o["action"], o["outcome"]) for o in outs]
    assert got == [("unknown", "rejected"), ("pin", "rejected"), ("pin", "clipped"), ("pin", "rejected"),
                   ("prefetch", "rejected"), ("retain", "rejected"), ("pin", "rejected"), ("share", "rejected"),
                   ("prefetch", "rejected"), ("pin", "clipped"), ("pin", "rejected"), ("retain", "rejected"),
                   ("unknown", "rejected")], outs
    reasons = [o["reason"] for o in outs]
    assert "share, prefetch, demote, pin, retain" in reasons[0]
    assert "ttl_s=-5" in reasons[1] and "86400" in reasons[2] and outs[2]["ttl_s"] == 86400
    assert "needs payload.ttl_s" in reasons[3]
    assert "no tier" in reasons[4] and "pool" in reasons[5]
    assert "no-such-model" in reasons[6] and "GET /v1/models" in reasons[6]
    assert "destination" in reasons[7] and "peer" in reasons[8]
    assert "pin budget" in reasons[9] and 0 < outs[9]["chunks"] < 200
    assert "action_version" in reasons[10] and "colour" in reasons[11]
    # A body that is not a JSON object: a 400, counted as one rejected hint.
    code, err = r.call("POST", "/v1/kv/hints", raw=b"{not json")
    assert code == 400 and "not JSON" in err["error"] and "docs/hints.md" in err["error"]
    code, out = r.call("POST", "/v1/kv/hints", {"protocol_version": 9, "actions": []})
    assert code == 200 and out["outcomes"][0]["outcome"] == "rejected" and "protocol_version" in \
        out["outcomes"][0]["reason"]
    assert r.metric("hkvd_hints_total", action="unknown", outcome="rejected") == 4
    assert r.metric("hkvd_hints_total", action="pin", outcome="rejected") == 4
    assert r.metric("hkvd_hints_total", action="pin", outcome="clipped") == 2
    # The daemon serves on: the stored prefix is whole in the pool, and a good hint still works.
    assert r.pool_tokens(stored)["pool"] == FULL
    [ok] = r.hints({"action_type": "retain", "payload": prefix(stored)})
    assert ok["outcome"] == "accepted" and ok["chunks"] == CHUNKS
    [ok] = r.hints({"action_type": "share", "payload": prefix(stored)})
    assert ok["outcome"] == "accepted" and "admission is off" in ok["reason"]


def test_an_engines_hints_over_the_wire(node: Node) -> None:
    """What the shim sends for a request's kv_transfer_params hints: kv.Hints with the request's keys."""
    r, eng = node.router, node.eng
    assert eng.ack.hints
    pinned, demoted = node.store(1), node.store(2)
    node.drain_disk()
    eng.client.hints("", chunk_keys(pinned, C), [("pin", 30.0, "turn-7"), ("retain", 0.0, "")],
                     {"pin/accepted": 1, "prefetch/rejected": 2, "unknown/rejected": 1})
    eng.client.hints("", chunk_keys(demoted, C), [("demote", 0.0, "")], {})
    pins = eng.client.status()["pins"]  # answered after the hints (one connection, in order)
    assert pins["sessions"] == 1 and pins["longest"][0]["session"] == "turn-7"
    assert r.metric("hkvd_hints_total", action="pin", outcome="accepted") == 2  # the shim's and the daemon's
    assert r.metric("hkvd_hints_total", action="retain", outcome="accepted") == 1
    assert r.metric("hkvd_hints_total", action="demote", outcome="accepted") == 1
    assert r.metric("hkvd_hints_total", action="prefetch", outcome="rejected") == 2
    assert r.metric("hkvd_hints_total", action="unknown", outcome="rejected") == 1
    status = eng.client.status()
    assert status["hints"]["pin"] == {"accepted": 2} and status["hints"]["prefetch"] == {"rejected": 2}
    assert "hints     demote 1 accepted; pin 2 accepted; prefetch 2 rejected; retain 1 accepted; unknown 1 " \
        "rejected" in format_status(status)
    node.flood(100)
    assert r.pool_tokens(pinned)["pool"] == FULL and r.pool_tokens(demoted)["pool"] == 0
