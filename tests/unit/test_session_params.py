"""Session pins in ``kv_transfer_params`` (``hkvd.shim.sessions``): the good shape gives a pin, every bad
one gives no pin and one warning line naming its problem, and nothing raises."""

from __future__ import annotations

from typing import Any

import pytest

from hkvd.shim import pd
from hkvd.shim.sessions import PinAsk, parse
from hkvd.transport.keys import chunk_keys


def test_a_pin_with_a_session_is_parsed() -> None:
    assert parse({"hkvd": {"pin_s": 300, "session": "chat-42"}}) == (PinAsk("chat-42", 300.0), "")
    assert parse({"hkvd": {"pin_s": 0.5, "session": "a" * 128}}) == (PinAsk("a" * 128, 0.5), "")
    assert parse({"hkvd": {"pin_s": 86400, "session": "x"}}) == (PinAsk("x", 86400.0), "")


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"hkvd": {}}, "not a map", 7])
def test_no_pin_asked_is_no_pin_and_no_warning(params: Any) -> None:
    assert parse(params) == (None, "")


BAD = [
    ({"hkvd": "pin please"}, "is a str, not a map"),
    ({"hkvd": [300, "s"]}, "is a list, not a map"),
    ({"hkvd": {"pin_s": 300, "session": "s", "ttl": 5}}, "unknown keys ['ttl']"),
    ({"hkvd": {"pin_s": 300}}, "lacks 'session'"),
    ({"hkvd": {"session": "s"}}, "lacks 'pin_s'"),
    ({"hkvd": {"pin_s": 0, "session": "s"}}, "pin_s=0"),
    ({"hkvd": {"pin_s": -5, "session": "s"}}, "pin_s=-5"),
    ({"hkvd": {"pin_s": 86401, "session": "s"}}, "pin_s=86401"),
    ({"hkvd": {"pin_s": float("nan"), "session": "s"}}, "pin_s=nan"),
    ({"hkvd": {"pin_s": float("inf"), "session": "s"}}, "pin_s=inf"),
    ({"hkvd": {"pin_s": True, "session": "s"}}, "pin_s=True"),
    ({"hkvd": {"pin_s": "300", "session": "s"}}, "pin_s='300'"),
    ({"hkvd": {"pin_s": 300, "session": ""}}, "bad session"),
    ({"hkvd": {"pin_s": 300, "session": "a" * 129}}, "bad session"),
    ({"hkvd": {"pin_s": 300, "session": "two words"}}, "bad session"),
    ({"hkvd": {"pin_s": 300, "session": "line\nbreak"}}, "bad session"),
    ({"hkvd": {"pin_s": 300, "session": "caf\u00e9"}}, "bad session"),
    ({"hkvd": {"pin_s": 300, "session": 42}}, "session of type int"),
]


@pytest.mark.parametrize(("params", "names"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_runs_unpinned_with_one_warning_line_naming_the_problem(params: Any, names: str) -> None:
    pin, warning = parse(params)
    assert pin is None
    assert warning.startswith("hkvd: the request runs unpinned: kv_transfer_params['hkvd'] ")
    assert names in warning, warning
    assert "\n" not in warning  # one line in the log, whatever the input held


def test_a_huge_bad_session_is_cut_in_the_warning() -> None:
    _, warning = parse({"hkvd": {"pin_s": 300, "session": "z" * 100_000}})
    assert 0 < len(warning) < 400


def test_pins_and_prefill_decode_params_share_one_dict() -> None:
    """A proxy's prefill/decode keys and the hkvd pin travel in the same kv_transfer_params: each reader takes
    its own keys and ignores the other's."""
    ask = {"do_remote_decode": True, "hkvd": {"pin_s": 60, "session": "s1"}}
    assert pd.wants_params("kv_both", ask)
    assert parse(ask) == (PinAsk("s1", 60.0), "")

    keys = chunk_keys(list(range(64)), 16)
    handed = {**pd.producer_params("10.0.0.1:7000", keys, 3, 16, 9), "hkvd": {"pin_s": 60, "session": "s1"}}
    plan = pd.consumer_plan(handed, keys, 3, 16)
    assert plan is not None and plan[0] == 3 and plan[1].keys == keys[:3]
    assert parse(handed) == (PinAsk("s1", 60.0), "")
