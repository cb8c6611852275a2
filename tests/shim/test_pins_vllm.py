# SPDX-License-Identifier: Apache-2.0
"""Session pins and tenants from real vLLM (CPU, tiny Gemma3) to a real ``hkvd serve`` (docs/agents.md).

One engine runs four requests (vLLM's own prefix cache emptied before each, so hits come from hkvd):

- ``kv_transfer_params={"hkvd": {"pin_s": 300, "session": "agent-1"}}`` on a prompt of four full chunks;
- ``cache_salt="tenant-a"``: its entries count against tenant ``salt:`` + the salt's digest, never the
  salt in clear;
- the session's next turn (the first prompt and one chunk more, ``pin_s`` 600): it hits the four pinned
  chunks, and its pin of five chunks supersedes the first, so the daemon's status lists session agent-1
  with one pin (unsalted tenant ""), pool bytes held and more than 300 s left;
- ``{"hkvd": {"pin_s": 0, ...}}``: one warning line names pin_s, the request completes, nothing is pinned;
- KV hints (docs/hints.md) on the salted request: a retain the daemon applies, an unknown action the shim
  rejects with one warning; the daemon counts every hint, the pins above among them;
- load and store tiers (docs/hints.md, vLLM's ``kv_load_tiers`` / ``kv_store_tiers``): a request whose store
  tiers leave the pool out (``[{"medium": "storage"}]``) is not stored, and its bad ``kv_load_tiers`` is one
  warning naming the key; the first prompt again with load tiers that leave the pool out misses, though the
  daemon holds it pinned.

vLLM's own counters say one request pinned and one refused, and one request's tiers refused. The pin and
tenant checks need a daemon that takes pins (``RegisterAck.pins``): against one that does not, the shim says so
once, and they skip.
"""

from __future__ import annotations

import pytest

from hkvd.shim.client import DaemonClient
from hkvd.shim.tenants import tenant

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


PINNED, SALTED, BAD, UNSTORED = _seq(601, 7, 3), _seq(601, 13, 1), _seq(601, 11, 5), _seq(601, 17, 9)
TURN2 = PINNED + _seq(100, 3, 2)  # five full chunks; the first four are PINNED's
# KV hints on the salted request (docs/hints.md): a retain the daemon applies, an unknown action the shim rejects.
HINTS = {"protocol_version": 1, "actions": [{"action_type": "kv.retain"}, {"action_type": "evict-now"}]}


def test_a_pinned_session_its_next_turn_a_salted_request_and_a_bad_pin(tiny_lib, outputs, models_root, daemon_factory,
                                                     engine_runner) -> None:
    model = tiny_lib.build("gemma3", models_root)
    d = daemon_factory(BLOCK)
    run = engine_runner({"model": str(model), "socket": d.socket, "max_num_batched_tokens": BLOCK,
                         "vllm_metrics": True, "prompts": [
                             {"ids": PINNED, "kv_transfer_params": {"hkvd": {"pin_s": 300, "session": "agent-1"}}},
                             {"ids": SALTED, "salt": "tenant-a", "kv_transfer_params": {"kv_hints": HINTS}},
                             {"ids": TURN2, "kv_transfer_params": {"hkvd": {"pin_s": 600, "session": "agent-1"}}},
                             {"ids": BAD, "kv_transfer_params": {"hkvd": {"pin_s": 0, "session": "agent-2"}}},
                             {"ids": UNSTORED, "kv_transfer_params": {"kv_store_tiers": [{"medium": "storage"}],
                                                                      "kv_load_tiers": "pool"}},
                             {"ids": PINNED, "kv_transfer_params": {"kv_load_tiers": [{"medium": "storage"}]}},
                         ]})
    log = run["log"]
    # Bad input: the request completes, one warning line names the problem, nothing fails.
    assert [len(r["tokens"]) for r in run["results"]] == [8] * 6, log[-3000:]
    warned = [line for line in log.splitlines() if "runs unpinned" in line]
    assert len(warned) == 1 and "pin_s=0" in warned[0], warned
    m = run["vllm_metrics"]
    assert m.get("vllm:hkvd_pins_refused") == 1, m
    assert m.get("vllm:hkvd_tiers_refused") == 1, m
    tiers_warned = [line for line in log.splitlines() if "kv_transfer_params['kv_load_tiers']" in line]
    assert len(tiers_warned) == 1 and "is a str" in tiers_warned[0] and "every tier" in tiers_warned[0], tiers_warned

    if "takes none" in log:
        pytest.skip("the daemon's RegisterAck.pins is false: this hkvd serve takes no session pins or tenants")
    assert m.get("vllm:hkvd_pins_sent") == 4, m  # two pinned requests, each pinned on arrival and at finish
    assert outputs.hits(run)[2] == 4 * BLOCK, log[-3000:]  # the next turn loads the pinned chunks

    with DaemonClient(d.socket, client_name="test", role="tool") as c:
        status = c.status()
    pins, tenants = status["pins"], status["tenants"]
    sessions = {s["session"]: s for s in pins["longest"]}
    assert set(sessions) == {"agent-1"}, pins
    one = sessions["agent-1"]
    assert one["tenant"] == "" and one["pins"] == 1 and 300 < one["ttl_left_s"] <= 600, one  # superseded
    assert pins["sessions"] == 1 and pins["pinned_bytes"] > 0, pins

    label = tenant(type("R", (), {"cache_salt": "tenant-a", "lora_request": None})())
    assert tenants["bytes"].get(label, 0) > 0, tenants
    assert tenants["bytes"].get("", 0) > 0, tenants  # the other two requests: the unsalted share
    assert "tenant-a" not in str(status)  # the salt never reaches the daemon in clear
    # The hints: the two good pins and the bad one counted as pins, the salted request's retain applied to its
    # four stored chunks, its unknown action rejected by the shim with one warning naming the field.
    assert status["hints"] == {"pin": {"accepted": 2, "rejected": 1}, "retain": {"accepted": 1},
                               "unknown": {"rejected": 1}}, status["hints"]
    hinted = [line for line in log.splitlines() if "a KV hint was rejected" in line]
    assert len(hinted) == 1 and "kv_transfer_params['kv_hints'] actions[1]" in hinted[0], hinted
    # The tiers travelled from the engine: the pool-less store was refused (every group's entry of its four
    # chunks), and the first prompt, asked for again from no tier hkvd loads from, missed.
    assert status["keeping"]["stores"].get("store_tiers", 0) >= 4, status["keeping"]
    assert outputs.hits(run)[5] == 0, log[-3000:]
    assert status["counters"].get("lookup_tiers_left_out", 0) >= 2, status["counters"]  # the pool and the cluster
