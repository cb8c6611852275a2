"""The hybrid hit rule: how many leading chunks every KV-cache group of an engine can serve.

Role
    A hybrid model (vLLM HMA) keeps one KV-cache *group* per layer kind: full attention,
    sliding-window attention (swa) and Mamba/GDN state. A prefix hit of ``n`` chunks is only
    usable if *every* group can rebuild its state at token ``n * chunk_size``. This module
    decides that ``n`` and which entries a retrieve of that hit must load. The index
    (lookups) and the store path share :func:`required_chunks`, so "what a hit needs" is
    defined in exactly one place.

Threading model
    Pure functions over immutable values: no I/O, no asyncio, no locks. ``present`` is the
    caller's callback (an index probe); it is called at most once per (group, chunk) per
    :func:`plan_hit` call and must not mutate the index.

Contracts (docs/design.md, "Hybrid hit rule")
    - full: chunks ``[0, n)``.
    - swa with a window of ``w`` tokens: the chunks covering tokens ``[max(0, n*C - w), n*C)``,
      i.e. chunk indices ``max(0, n*C - w) // C`` .. ``n - 1``.
    - mamba: the *confirmed* state after exactly ``n*C`` tokens, which is entry ``n - 1``.
      Only the caller knows confirmation (``hkvd.daemon.engines.snapshots``); ``present`` must answer
      False for an unconfirmed state.
    - ``n = 0`` is always served. Groups disagree -> minimum. Never rounded up: a mamba state
      at chunk ``k`` does not make a hit of ``k+1`` or of any ``n`` whose state is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

GroupKind = Literal["full", "swa", "mamba"]
SUPPORTED_KINDS: tuple[str, ...] = get_args(GroupKind)

#: ``present(group_id, chunk_index)``: is that group's entry for that chunk available now?
PresentFn = Callable[[int, int], bool]


@dataclass(frozen=True, slots=True)
class GroupRule:
    """What one KV-cache group needs from the cache to serve a prefix.

    ``window_tokens`` is the sliding window in tokens for ``swa`` groups and is ignored for
    the other kinds (vLLM reports 0 or the model length there).
    """

    group_id: int
    kind: GroupKind
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_KINDS:
            raise ValueError(
                f"group {self.group_id}: unknown kind {self.kind!r}; expected one of {SUPPORTED_KINDS}"
            )
        if self.group_id < 0:
            raise ValueError(f"group_id must be >= 0, got {self.group_id}")
        if self.kind == "swa" and self.window_tokens <= 0:
            # A zero window would make every swa hit need nothing, silently serving garbage.
            raise ValueError(
                f"swa group {self.group_id}: window_tokens must be > 0, got {self.window_tokens}"
            )


class HitPlan(NamedTuple):
    """The outcome of :func:`plan_hit`.

    ``hit_chunks``: the largest ``n`` every group serves (0 = miss).
    ``needed``: for every group id, exactly the chunk indices a retrieve of that hit must
    load, ascending: ``[0, n)`` for full, the window suffix for swa, ``[n-1]`` for mamba, and
    ``[]`` for every group when ``n == 0``.
    """

    hit_chunks: int
    needed: dict[int, list[int]]


def required_chunks(rule: GroupRule, n: int, chunk_size: int) -> range:
    """The chunk indices ``rule``'s group must load to rebuild its state after ``n`` chunks.

    This is the *load* side: an swa group loads only the suffix that covers its window and
    a mamba group only the single state at chunk ``n - 1``. The *store* side still stores
    every swa chunk and every kept mamba state it is offered, because each of them is the
    suffix (or the state) of some future hit length ``n``; which ``n`` a later lookup will
    need is unknown at store time.

    The swa boundary: the window of ``w`` tokens before position ``L = n*C`` is tokens
    ``L-w .. L-1``, so the first needed chunk is the one holding token ``L-w``, i.e.
    ``(L-w) // C``. (vLLM attends to the ``w - 1`` tokens before the next one, so this is at
    most one token conservative: it may need one extra chunk, never one too few.)
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return range(0)
    if rule.kind == "full":
        return range(n)
    if rule.kind == "swa":
        first_token = max(0, n * chunk_size - rule.window_tokens)
        return range(first_token // chunk_size, n)
    # mamba: one state, the one after exactly n*C tokens.
    return range(n - 1, n)


def mamba_checkpoint_keep(chunk_index: int, interval_k: int) -> bool:
    """Whether the store side keeps the mamba state after chunk ``chunk_index``.

    Keeping every ``K``-th state ((chunk_index + 1) % K == 0) bounds pool use for long
    prompts; mamba hits then land on multiples of ``K`` chunks (the planner sees the other
    states as absent). ``K = 1`` keeps all of them.
    """
    if interval_k < 1:
        raise ValueError(f"mamba checkpoint interval must be >= 1, got {interval_k}")
    if chunk_index < 0:
        raise ValueError(f"chunk_index must be >= 0, got {chunk_index}")
    return (chunk_index + 1) % interval_k == 0


def plan_hit(
    rules: Sequence[GroupRule],
    num_chunks: int,
    chunk_size: int,
    present: PresentFn,
    max_chunks: int | None = None,
) -> HitPlan:
    """Find the largest ``n <= min(num_chunks, max_chunks)`` that every group serves.

    ``num_chunks`` is how many full chunks the request's prefix has (only full chunks have
    keys); ``max_chunks`` lets the caller cap the hit (e.g. vLLM must recompute at least
    the last token, so the scheduler asks for at most ``(prompt_len - 1) // C`` chunks).

    Cost: O(num_chunks) ``present`` calls per group, each (group, chunk) probed at most
    once. Full groups bound ``n`` by their leading run (one forward scan); then candidates
    only move downward: a missing mamba state moves the candidate down by one, a hole in
    an swa window jumps it straight to the hole (every ``n`` above the hole still needs
    it), and swa chunks already seen present are not probed again.
    """
    _check_plan_args(rules, num_chunks, chunk_size)
    limit = num_chunks if max_chunks is None else max(0, min(num_chunks, max_chunks))
    limit = _full_limit(rules, limit, present)

    # Downward search over swa and mamba groups. For each swa group the interval [lo, hi)
    # already verified present is kept; because candidates only decrease and the window's
    # start is monotone in n, a chunk is probed at most once.
    others = [r for r in rules if r.kind != "full"]
    verified: dict[int, tuple[int, int]] = {r.group_id: (limit, limit) for r in others if r.kind == "swa"}
    n = limit
    while n > 0:
        candidate = n
        for rule in others:
            if rule.kind == "mamba":
                if not present(rule.group_id, n - 1):
                    candidate = n - 1
                    break
                continue
            hole = _swa_hole(rule, n, chunk_size, present, verified)
            if hole >= 0:
                candidate = hole
                break
        if candidate == n:
            break
        n = candidate

    needed = {r.group_id: list(required_chunks(r, n, chunk_size)) for r in rules}
    return HitPlan(n, needed)


def _check_plan_args(rules: Sequence[GroupRule], num_chunks: int, chunk_size: int) -> None:
    """Reject the arguments :func:`plan_hit` cannot plan for."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if num_chunks < 0:
        raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
    if not rules:
        # An engine always has at least one group; an empty list is a registry bug that
        # would otherwise look like "everything hits".
        raise ValueError("plan_hit needs at least one group rule")
    ids = [r.group_id for r in rules]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate group ids in {ids}")


def _full_limit(rules: Sequence[GroupRule], limit: int, present: PresentFn) -> int:
    """``limit`` cut to the leading run of every full group: a hit never passes a full group's first hole."""
    for rule in rules:
        if rule.kind != "full":
            continue
        run = 0
        while run < limit and present(rule.group_id, run):
            run += 1
        limit = run
        if limit == 0:
            break
    return limit


def _swa_hole(
    rule: GroupRule,
    n: int,
    chunk_size: int,
    present: PresentFn,
    verified: dict[int, tuple[int, int]],
) -> int:
    """The highest missing chunk of ``rule``'s window for a hit of ``n`` chunks, or -1 when it is whole.

    Extends ``verified[rule.group_id]`` downward, probing only chunks not yet seen present.
    """
    lo, hi = verified[rule.group_id]
    if hi > n:
        # The window for n ends at n; chunks >= n are irrelevant from now on.
        hi = n
        lo = min(lo, n)
    first = required_chunks(rule, n, chunk_size).start
    while lo > first:
        if present(rule.group_id, lo - 1):
            lo -= 1
        else:
            # Every n' in (hole, n] needs chunk `hole`; the best remaining is n' = hole.
            hole = lo - 1
            verified[rule.group_id] = (hole, hole)
            return hole
    verified[rule.group_id] = (lo, hi)
    return -1
