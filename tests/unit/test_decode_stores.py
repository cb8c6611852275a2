"""Whether decode chunks are stored (``hkvd.shim.decode_stores``): the ``store_decode`` setting, the chat template
read for ``"auto"``, a request's own ``{"hkvd": {"store_decode": ...}}``, and the counters of chunks not stored."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hkvd.shim import sessions
from hkvd.shim.decode_stores import MARKER, STAT_NAMES, DecodeStores, parse, template_drops_thinking
from hkvd.shim.shim_config import ShimConfig


@pytest.mark.parametrize(("value", "want"), [(True, True), (False, False), ("auto", "auto"), ("AUTO", "auto"),
                                             ("true", True), ("off", False), ("0", False), (1, True), (0, False)])
def test_the_setting_takes_a_bool_or_auto(value: Any, want: Any) -> None:
    assert ShimConfig.from_extra({"store_decode": value}).store_decode == want


def test_auto_is_the_default_and_anything_else_is_refused_with_the_choices() -> None:
    assert ShimConfig.from_extra({}).store_decode == "auto"
    for bad in ("maybe", 2, None, 0.5):
        with pytest.raises(ValueError, match=r"store_decode.*is not true, false or \"auto\""):
            ShimConfig.from_extra({"store_decode": bad})


@pytest.mark.parametrize(("params", "want"), [
    (None, None), ({}, None), ({"hkvd": {}}, None), ({"hkvd": {"pin_s": 5, "session": "s"}}, None),
    ({"hkvd": {"store_decode": False}}, False), ({"hkvd": {"store_decode": True}}, True),
    ({"hkvd": "x"}, None), ({"do_remote_decode": True}, None)])
def test_a_request_says_true_false_or_nothing(params: Any, want: bool | None) -> None:
    assert parse(params) == (want, "")


@pytest.mark.parametrize("bad", ["no", 0, 1, None, [False], "false"])
def test_a_value_that_is_not_a_bool_is_one_warning_naming_the_field_and_the_fix(bad: Any) -> None:
    asked, warning = parse({"hkvd": {"store_decode": bad}})
    assert asked is None
    assert "kv_transfer_params['hkvd']['store_decode']" in warning and "send true" in warning
    assert "the engine's store_decode applies" in warning


def test_the_field_rides_beside_a_pin_without_refusing_it() -> None:
    pin = sessions.PinAsk("chat-1", 60.0)
    assert sessions.parse({"hkvd": {"pin_s": 60, "session": "chat-1", "store_decode": False}}) == (pin, "")
    assert sessions.parse({"hkvd": {"store_decode": False}}) == (None, "")
    assert parse({"hkvd": {"pin_s": 60, "session": "chat-1", "store_decode": False}}) == (False, "")


class _Tokenizer:
    """A tokenizer whose template keeps or drops the text up to "</think>" of an answer before the last user
    message, or fails."""

    def __init__(self, drops: bool, template: str | None = "{{ messages }}", fails: bool = False) -> None:
        self.drops, self.chat_template, self.fails = drops, template, fails

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize and add_generation_prompt
        if self.fails:
            raise TypeError("'NoneType' object is not iterable")
        texts = [m["content"].split("</think>")[-1] if self.drops and m["role"] == "assistant" else m["content"]
                 for m in messages]
        return "".join(f"<{m['role']}>{t}" for m, t in zip(messages, texts, strict=True)) + "<assistant>"


MODEL = SimpleNamespace(skip_tokenizer_init=False)


def test_the_template_is_rendered_and_the_marker_looked_for() -> None:
    assert template_drops_thinking(MODEL, lambda _m: _Tokenizer(drops=True))[0] is True
    assert template_drops_thinking(MODEL, lambda _m: _Tokenizer(drops=False))[0] is False
    assert MARKER not in _Tokenizer(drops=True).apply_chat_template(
        [{"role": "assistant", "content": f"<think>{MARKER}</think>ok"}], tokenize=False, add_generation_prompt=True)


def _no_tokenizer(_m: Any) -> Any:
    raise OSError("no tokenizer.json")


@pytest.mark.parametrize(("model", "load", "why"), [
    (None, lambda _m: _Tokenizer(True), "no model config"),
    (SimpleNamespace(skip_tokenizer_init=True), lambda _m: _Tokenizer(True), "without a tokenizer"),
    (MODEL, lambda _m: None, "without a tokenizer"),
    (MODEL, _no_tokenizer, "could not be loaded (OSError: no tokenizer.json)"),
    (MODEL, lambda _m: _Tokenizer(True, template=None), "has no chat template"),
    (MODEL, lambda _m: _Tokenizer(True, fails=True), "could not be rendered (TypeError"),
])
def test_a_template_that_cannot_be_read_says_why_and_tells_nothing(model: Any, load: Any, why: str) -> None:
    drops, reason = template_drops_thinking(model, load)
    assert drops is None and why in reason


def test_the_engine_decides_once_and_a_request_overrides(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []

    def detect(m: Any) -> tuple[bool | None, str]:
        calls.append(m)
        return True, "its chat template drops it"

    stats: dict[str, int] = {}
    with caplog.at_level("INFO", logger="hkvd.shim"):
        d = DecodeStores("auto", MODEL, stats, detect)  # type: ignore[arg-type]
    assert calls == [MODEL] and (d.store, d.reason) == (False, "template")
    assert [r.getMessage() for r in caplog.records if "store_decode auto" in r.getMessage()] == [
        "hkvd: store_decode auto: its chat template drops it; the chunks a request generates are not stored (a "
        'request stores them with kv_transfer_params={"hkvd": {"store_decode": true}})']
    assert d.for_request(None) == (False, "template")
    assert d.for_request(True) == (True, "")
    assert d.for_request(False) == (False, "request")
    assert set(stats) == set(STAT_NAMES) and not any(stats.values())

    keeps = DecodeStores("auto", MODEL, {}, lambda _m: (False, "keeps"))  # type: ignore[arg-type]
    unknown = DecodeStores("auto", MODEL, {}, lambda _m: (None, "no template"))  # type: ignore[arg-type]
    assert (keeps.store, unknown.store) == (True, True)
    off = DecodeStores(False, MODEL, {}, detect)  # type: ignore[arg-type]
    on = DecodeStores(True, MODEL, {}, detect)  # type: ignore[arg-type]
    assert (off.store, off.reason, on.store, on.reason) == (False, "config", True, "") and len(calls) == 1
    assert off.for_request(None) == (False, "config") and on.for_request(False) == (False, "request")


def test_chunks_not_stored_are_counted_by_reason() -> None:
    stats: dict[str, int] = {}
    d = DecodeStores(False, None, stats)
    d.not_stored("template", 3, 1000)
    d.not_stored("request", 2, 1000)
    d.not_stored("config", 0, 1000)
    d.not_stored("request", -1, 1000)
    assert stats["decode_chunks_not_stored_template"] == 3 and stats["decode_bytes_not_stored_template"] == 3000
    assert stats["decode_chunks_not_stored_request"] == 2 and stats["decode_bytes_not_stored_request"] == 2000
    assert stats["decode_chunks_not_stored_config"] == 0
