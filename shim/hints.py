"""KV hints asked for in a request's ``kv_transfer_params``: parsed and checked, never fatal (docs/hints.md).

Role
    A request may carry the hint envelope of vLLM's RFC #53421 / Dynamo's ``KvHint`` (``hkvd.transport.hint_envelope``)
    under ``kv_transfer_params["kv_hints"]`` (the RFC's request field) or ``["kv_hint"]`` (Dynamo's vLLM
    bridge). Its actions are about the request's own prefix: a payload's prefix fields (``model``,
    ``token_ids``...) are not read. ``parse`` turns it into a ``RequestHints``; the scheduler side sends it as
    one ``kv.Hints`` with the request's chunk keys when the request finishes (``hkvd.shim.store_planner``),
    where the daemon applies each action and counts its outcome (``hkvd_hints_total``).

    Decided here, and counted with the daemon's (``RequestHints.counted``): a hint that cannot be read
    (``rejected``, one warning per request naming the field and the fix), a ``prefetch`` (``rejected``: the
    request's own lookup reads its prefix from the lower tiers; a router sends prefetch ahead of the request to
    ``POST /v1/kv/hints``), a ``share`` to another worker (``rejected``), and the ``{"hkvd": {"pin_s",
    "session"}}`` pin of ``hkvd.shim.sessions`` (counted as a ``pin``: ``accepted`` when asked well, it is
    sent as ``kv.Pin``; ``rejected`` when not).

Contracts
    ``parse`` never raises; a request without hints (and without a pin) gives ``(None, "")``.

Threading
    Pure functions; no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hkvd.transport.hint_envelope import Action, Refusal, parse_envelope
from hkvd.transport.wire.kv import HINT_ACTIONS, MAX_HINT_TTL_S

KEYS = ("kv_hints", "kv_hint")  # vLLM RFC #53421's request field; Dynamo's kv_transfer_params key


@dataclass(frozen=True, slots=True)
class HintAsk:
    """One action the daemon applies to the request's chunks: ``ttl_s`` 0 and ``session`` "" when not given."""

    action: str
    ttl_s: float = 0.0
    session: str = ""


@dataclass(slots=True)
class RequestHints:
    """A request's hints: those the daemon applies (``asks``), those decided here (``counted``,
    ``"<action>/<outcome>"`` -> how many)."""

    asks: list[HintAsk] = field(default_factory=list)
    counted: dict[str, int] = field(default_factory=dict)

    def count(self, action: str, outcome: str) -> None:
        label = f"{action}/{outcome}"
        self.counted[label] = self.counted.get(label, 0) + 1

    def reject_asks(self) -> None:
        """The asks cannot be applied (no whole chunk, no daemon that takes them): counted as rejected."""
        for a in self.asks:
            self.count(a.action, "rejected")
        self.asks = []


def pin_outcome(pinned: bool, params: object) -> str:
    """How the request's ``{"hkvd": {"pin_s", "session"}}`` pin counts (``hkvd.shim.sessions``): "accepted" when it
    pins, "rejected" when it asked for one (either field given) that was refused, "" when it asked none."""
    if pinned:
        return "accepted"
    ours = params.get("hkvd") if isinstance(params, Mapping) else None
    return "rejected" if isinstance(ours, Mapping) and ("pin_s" in ours or "session" in ours) else ""


def parse(params: object, pin: str = "") -> tuple[RequestHints | None, str]:
    """(the request's hints, or None; a warning line, or "") from its ``kv_transfer_params``. ``pin``: the
    outcome of its ``hkvd.shim.sessions`` pin ("accepted", "rejected", "" when it asked none)."""
    out = RequestHints()
    if pin:
        out.count("pin", pin)
    key = next((k for k in KEYS if isinstance(params, Mapping) and k in params), None)
    if key is None:
        return (out if out.counted else None), ""
    assert isinstance(params, Mapping)
    _, parsed = parse_envelope(params[key])
    problems: list[str] = []
    for i, p in enumerate(parsed):
        if isinstance(p, Refusal):
            out.count(p.action, "rejected")
            problems.append(f"actions[{i}]: {p.reason}")
            continue
        if p.action not in HINT_ACTIONS:  # prefetch: the request's own lookup reads the lower tiers
            out.count(p.action, "rejected")
            problems.append(f"actions[{i}]: a prefetch riding a request does nothing its own lookup does not (it "
                            "reads the prefix from the disk and cluster tiers); send it ahead of the request to "
                            "POST /v1/kv/hints on hkvd's metrics port")
            continue
        if p.action == "share" and p.payload.get("destination") is not None:
            out.count(p.action, "rejected")
            problems.append(f"actions[{i}]: share to another worker is not supported; leave destination out")
            continue
        out.asks.append(_ask(p))
    if not problems:
        return out, ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return out, f"hkvd: a KV hint was rejected: kv_transfer_params[{key!r}] {problems[0]}{more}"


def _ask(a: Action) -> HintAsk:
    ttl = min(a.ttl_s, MAX_HINT_TTL_S) if a.ttl_s is not None else 0.0  # over a day: the daemon clips and says so
    return HintAsk(a.action, ttl, a.session or "")
