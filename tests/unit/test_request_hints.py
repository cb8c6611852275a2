"""A request's KV hints on the scheduler side (hkvd.shim.hints, docs/hints.md): sent when it finishes as one
kv.Hints with its chunk keys and the outcomes the shim decided (its session pin counted as a pin); bad hints
never fail the request: one warning, counted as rejected; an older daemon gets none."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: make vllm")

from tests.unit.test_connector_metadata import PIN, TABLE, pinned, scheduler_output

pytestmark = pytest.mark.vllm  # vLLM's Request and scheduler types (through test_connector_metadata)

PIN_AND_HINTS: dict[str, Any] = {**PIN, "kv_hints": {"protocol_version": 1, "message_id": "m", "actions": [
    {"action_type": "kv.pin", "payload": {"ttl_s": 60, "session": "agent-3"}},
    {"action_type": "demote"},
    {"action_type": "evict-now"},
    {"action_type": "prefetch"},
]}}


def finish(params: Any, *, hints: bool = True) -> Any:
    sched, client, req = pinned("r1", params)
    assert sched.link.ack is not None
    sched.link.ack = dataclasses.replace(sched.link.ack, hints=hints)
    sched.build_connector_meta(scheduler_output(req, computed=0, scheduled=100))
    sched.request_finished(req, TABLE)
    return client


def test_hints_go_out_with_the_requests_keys_when_it_finishes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hkvd.shim"):
        client = finish(PIN_AND_HINTS)
    [sent] = client.kinds("hints")
    keys = client.kinds("lookup")[0][2][:3]  # its prompt's three whole chunks (100 tokens)
    assert sent[2:] == ("", keys, [("pin", 60.0, "agent-3"), ("demote", 0.0, "")],
                        {"pin/accepted": 1, "unknown/rejected": 1, "prefetch/rejected": 1})
    assert len(client.kinds("pin")) == 2  # the session pin still goes out as kv.Pin (arrival, finish)
    [warning] = [r.getMessage() for r in caplog.records if "KV hint" in r.getMessage()]
    assert "kv_transfer_params['kv_hints'] actions[2]" in warning and "(and 1 more)" in warning


def test_malformed_hints_never_fail_the_request() -> None:
    for bad in ({"kv_hints": "pin everything"}, {"kv_hint": {"actions": [None, 3]}}, {"kv_hints": None}):
        client = finish(bad)
        assert client.kinds("lookup")  # the request ran
        [sent] = client.kinds("hints")
        assert sent[3] == [] and sent[4] == [] and sum(sent[5].values()) >= 1
        assert set(sent[5]) == {"unknown/rejected"}


def test_an_older_daemon_gets_no_hints_and_a_bad_pin_counts_as_a_rejected_pin() -> None:
    assert finish(PIN_AND_HINTS, hints=False).kinds("hints") == []
    [sent] = finish({"hkvd": {"pin_s": -4, "session": "x"}}).kinds("hints")
    assert sent[4] == [] and sent[5] == {"pin/rejected": 1}
    assert finish({}).kinds("hints") == []
