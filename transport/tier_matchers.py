# SPDX-License-Identifier: Apache-2.0
"""A request's load and store tiers: vLLM's ``kv_load_tiers`` / ``kv_store_tiers`` matchers, mapped onto hkvd's tiers.

Role
    vLLM's offloading API (``kv_transfer_params``) lets a request name the tiers it reads from
    (``kv_load_tiers``: lookup and promotion) and the tiers it writes to (``kv_store_tiers``: offload and the
    cascade to lower tiers). Each is a list of matchers; a tier takes part when it matches any of them, and a
    matcher is an AND of the fields it gives (``medium``: ``"cpu"`` or ``"storage"``; ``locality``:
    ``"local"`` or ``"global"``), a field left out matching every tier. Left out: every tier. ``[]``: none.

    hkvd's tiers as those fields (docs/hints.md, "Load and store tiers"):

    ====================  ==========  ==========  ========================================================
    tier                  medium      locality    why
    ====================  ==========  ==========  ========================================================
    pool (``POOL``)       cpu         local       host DRAM of this node, the engine's own daemon
    disk (``DISK``)       storage     local       files under ``--l2-path`` on this node; survive a restart
    cluster (``CLUSTER``) cpu         global      Mooncake Store: every node's contributed DRAM, reached
                                                  from every node; lost with its node or master
    ====================  ==========  ==========  ========================================================

    On the wire a request's tiers travel as the tiers it *leaves out* (``Lookup.skip_tiers``,
    ``Store.skip_tiers``: a bit per tier, ``TIER_BITS``): 0, the default that an older client sends by sending
    nothing, is every tier, and a tier added later is taken part in by every request that did not name it.

    vLLM 0.32 spells the non-local locality ``"remote"`` and matches values in any case; both are taken.

Contracts
    ``parse`` never raises: bad input (not a list, a matcher that is not a map, an unknown field or value) is
    ``(None, warning)``, one line naming the field and the fix; the request then gets the engine's default
    (every tier).

Threading
    Pure functions; no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

LOAD_KEY = "kv_load_tiers"
STORE_KEY = "kv_store_tiers"
FIELDS = ("medium", "locality")
MEDIA = ("cpu", "storage")
LOCALITIES = ("local", "global")
_ALIASES = {"remote": "global"}  # vLLM 0.32's Locality.REMOTE
MAX_MATCHERS = 16  # more is a mistake: there are four (medium, locality) pairs

POOL, DISK, CLUSTER = 1, 2, 4
TIER_BITS = POOL | DISK | CLUSTER  # a skip_tiers field holds no other bit
TIER_NAMES = {POOL: "pool", DISK: "disk", CLUSTER: "cluster"}
# Each tier's (medium, locality).
TIER_FIELDS = {POOL: ("cpu", "local"), DISK: ("storage", "local"), CLUSTER: ("cpu", "global")}


class Matcher(NamedTuple):
    """One matcher: None matches every tier's value."""

    medium: str | None = None
    locality: str | None = None

    def matches(self, tier: int) -> bool:
        medium, locality = TIER_FIELDS[tier]
        return self.medium in (None, medium) and self.locality in (None, locality)


def skip_of(matchers: list[Matcher]) -> int:
    """The tiers no matcher matches, as ``TIER_BITS`` bits (``Lookup.skip_tiers``, ``Store.skip_tiers``)."""
    return sum(tier for tier in TIER_FIELDS if not any(m.matches(tier) for m in matchers))


def names(skip: int) -> str:
    """``skip``'s tiers by name, for log lines and metric labels: "disk,cluster"; "" for none."""
    return ",".join(name for bit, name in TIER_NAMES.items() if skip & bit)


def parse(params: object, key: str) -> tuple[int, str]:
    """(the tiers ``params[key]`` leaves out, as bits; a warning line, or "") from a request's ``kv_transfer_params``.
    Absent, or any bad input: 0 (every tier)."""
    if not isinstance(params, Mapping) or params.get(key) is None:
        return 0, ""
    raw = params[key]
    if not isinstance(raw, list) or len(raw) > MAX_MATCHERS:
        got = f"{len(raw)} matchers" if isinstance(raw, list) else f"a {type(raw).__name__}"
        return 0, _warn(key, f"is {got}; send a list of at most {MAX_MATCHERS} matchers, each a map such as "
                             '{"medium": "cpu", "locality": "local"} ([] for no tier)')
    matchers: list[Matcher] = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            return 0, _warn(key, f"[{i}] is a {type(m).__name__}; a matcher is a map of medium and/or locality")
        unknown = sorted(str(k)[:40] for k in m if k not in FIELDS)[:4]
        if unknown:
            return 0, _warn(key, f"[{i}] has unknown fields {unknown}; a matcher takes only {list(FIELDS)}")
        values: dict[str, str | None] = {}
        for name, allowed in (("medium", MEDIA), ("locality", LOCALITIES)):
            v = m.get(name)
            if v is None:
                values[name] = None
                continue
            word = _ALIASES.get(v.lower(), v.lower()) if isinstance(v, str) else None
            if word not in allowed:
                return 0, _warn(key, f"[{i}][{name!r}]={repr(v)[:40]} is not one of {list(allowed)}; "
                                     f"leave {name} out to match every tier")
            values[name] = word
        matchers.append(Matcher(values["medium"], values["locality"]))
    return skip_of(matchers), ""


def _warn(key: str, problem: str) -> str:
    sep = "" if problem.startswith("[") else " "
    return f"hkvd: kv_transfer_params[{key!r}]{sep}{problem}; the request uses every tier (the engine's default)"
