# SPDX-License-Identifier: Apache-2.0
"""Session pins asked for in a request's ``kv_transfer_params``: parsed and checked, never fatal.

Role
    A request may carry ``kv_transfer_params={"hkvd": {"pin_s": 300, "session": "chat-42"}}`` (vLLM's
    OpenAI server passes ``kv_transfer_params`` through to the connector as given, beside any
    prefill/decode keys of ``hkvd.shim.pd``). ``parse`` turns the ``"hkvd"`` part into a ``PinAsk``;
    the scheduler side (``hkvd.shim.scheduler``) sends a ``kv.Pin`` of the request's chunk keys for it
    when the request finishes (docs/agents.md).

Contracts
    - ``parse`` never raises. No ``"hkvd"`` key (or an empty map under it): ``(None, "")``. Anything
      wrong with it: ``(None, warning)``, one line naming the first problem and the fix; the request
      runs as if it had asked for no pin.
    - Valid: ``"pin_s"`` a number with 0 < pin_s <= 86400 (``kv.MAX_PIN_S``) and ``"session"`` a
      string ``control.check_session`` accepts (1 to 128 printable ASCII characters, no spaces), both
      given, no other key but ``"store_decode"`` (``hkvd.shim.decode_stores``; alone, it asks for no pin).

Threading
    Pure functions; no state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.control import MAX_SESSION, check_session
from hkvd.transport.wire.kv import MAX_PIN_S

KEY = "hkvd"  # the part of kv_transfer_params that is ours
FIELDS = ("pin_s", "session")
OTHER_FIELDS = ("store_decode",)  # under the same key, read by hkvd.shim.decode_stores


@dataclass(frozen=True, slots=True)
class PinAsk:
    """Hold this request's chunks for ``ttl_s`` seconds as pin ``session``."""

    session: str
    ttl_s: float


def parse(params: object) -> tuple[PinAsk | None, str]:
    """(the pin asked for, or None; a warning line, or "") from a request's ``kv_transfer_params``."""
    if not isinstance(params, Mapping) or KEY not in params:
        return None, ""
    ours = params[KEY]
    if not isinstance(ours, Mapping):
        return None, _unpinned(f"is a {type(ours).__name__}, not a map; send "
                               '{"hkvd": {"pin_s": SECONDS, "session": "ID"}}')
    if not ours:
        return None, ""
    unknown = sorted(str(k)[:40] for k in ours if k not in FIELDS and k not in OTHER_FIELDS)[:8]
    if unknown:
        return None, _unpinned(f"has unknown keys {unknown}; the known keys are {[*FIELDS, *OTHER_FIELDS]}")
    if not any(k in ours for k in FIELDS):  # only other fields: no pin asked
        return None, ""
    if "pin_s" not in ours or "session" not in ours:
        missing = "session" if "pin_s" in ours else "pin_s"
        return None, _unpinned(f"lacks {missing!r}; a pin needs both pin_s (seconds) and session (an id)")
    ttl, session = ours["pin_s"], ours["session"]
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) \
            or not 0 < ttl <= MAX_PIN_S:
        return None, _unpinned(f"has pin_s={repr(ttl)[:40]}; pin_s is a number of seconds, more than 0 and "
                               f"at most {MAX_PIN_S:.0f}")
    if not isinstance(session, str):
        return None, _unpinned(f"has a session of type {type(session).__name__}; session is a string of 1 to "
                               f"{MAX_SESSION} printable ASCII characters without spaces")
    try:
        check_session(session, "session")
    except ProtocolViolation as e:
        return None, _unpinned(f"has a bad {e.message}")
    return PinAsk(session, float(ttl)), ""


def _unpinned(problem: str) -> str:
    return f"hkvd: the request runs unpinned: kv_transfer_params[{KEY!r}] {problem}"
