"""Registration validation for hybrid engines: refuse configurations hkvd cannot serve correctly.

Role
    Called by the registry when an engine registers (after ``chunk_size`` 0 was resolved to
    the daemon's ``--chunk-size``). Each rule raises :class:`RegistrationError` whose message
    says what is wrong *and which flag fixes it*: a refused registration is the user's first
    contact with these rules, and the engine log is all they will read.
    :func:`validate_hybrid` checks every rule and reports all failures in one error, so one
    restart fixes everything.

Threading model
    Pure functions, no I/O. Groups are read through attribute access only (``group_id``,
    ``kind``, ``tokens_per_block``), so ``hkvd.transport.layout.GroupSpec`` and test doubles both
    fit :class:`GroupLike`.

Batched-token budget (why we differ from LMCache)
    LMCache 0.5.1-0.5.3 required ``block_size <= max_num_batched_tokens < 2 * block_size``
    (serialized prefill) so that every block boundary gets a Mamba state. hkvd accepts any
    budget ``>= N``: we store every boundary state vLLM offers, whichever step offers it.
    With a budget in ``[N, 2N)`` every block boundary gets a state; with a larger budget only
    step-end boundaries do (vLLM's ``_mamba_block_aligned_split`` ends chunks on block
    boundaries, but keeps one state per step), so hits land on fewer boundaries. vLLM's
    ``--prefix-cache-retention-interval`` controls which boundaries it offers at all (default
    0: only the replay boundary; ``None``: every one; ``K``: every K-th). Below ``N`` a
    prefill step may not complete a block, and a Mamba state would sit mid-block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from hkvd.transport.errors import RegistrationError

SUPPORTED_KINDS: tuple[str, ...] = ("full", "swa", "mamba")
# vLLM keeps reusable Mamba states at block boundaries only in "align" mode; "none" keeps a
# single running state per request (mamba_block_size = max_model_len), nothing to cache.
REQUIRED_MAMBA_CACHE_MODE = "align"


class GroupLike(Protocol):
    """The attributes validation reads from a KV-cache group (``GroupSpec`` fits)."""

    @property
    def group_id(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def tokens_per_block(self) -> int: ...


def check_group_kinds(groups: Sequence[GroupLike]) -> None:
    """Every group must be of a kind the hit rule knows; list all offenders at once."""
    if not groups:
        raise RegistrationError(
            "the engine registered no KV cache groups; register the worker-side KV caches "
            "(register_kv_caches) before connecting, or check that the model has attention layers"
        )
    bad = [f"group {g.group_id}: {g.kind!r}" for g in groups if g.kind not in SUPPORTED_KINDS]
    if bad:
        raise RegistrationError(
            f"hkvd cannot serve this model's KV cache groups: {'; '.join(bad)}. Supported kinds are "
            f"{', '.join(SUPPORTED_KINDS)} (full attention, sliding window, Mamba/linear attention); "
            "serve this model without the hkvd connector (drop --kv-transfer-config)"
        )


def check_chunk_size(chunk_size: int, block_size: int, groups: Sequence[GroupLike]) -> None:
    """Chunks must end on block boundaries of vLLM's unified block size and of every group."""
    _raise(_chunk_problems(chunk_size, block_size, groups))


def check_mamba(
    groups: Sequence[GroupLike], block_size: int, max_num_batched_tokens: int, mamba_cache_mode: str
) -> None:
    """Rules that only apply when the model has Mamba/linear-attention groups."""
    _raise(_mamba_problems(groups, block_size, max_num_batched_tokens, mamba_cache_mode))


def validate_hybrid(
    *,
    chunk_size: int,
    block_size: int,
    max_num_batched_tokens: int,
    mamba_cache_mode: str,
    groups: Sequence[GroupLike],
) -> None:
    """Run every rule; raise one :class:`RegistrationError` listing each failure and its fix.

    The kind check runs first and alone: with an unknown kind the other rules' advice
    (flags to change) would be misleading, since no flag makes that model servable.
    """
    check_group_kinds(groups)
    _raise(
        _chunk_problems(chunk_size, block_size, groups)
        + _mamba_problems(groups, block_size, max_num_batched_tokens, mamba_cache_mode)
    )


def _chunk_problems(chunk_size: int, block_size: int, groups: Sequence[GroupLike]) -> list[str]:
    if block_size <= 0:
        # Only a shim bug can send this; no flag fixes it.
        return [
            f"vLLM block size must be positive, got {block_size}; upgrade the hkvd shim to match the daemon"
        ]
    flag = "hkvd serve --chunk-size (or kv_connector_extra_config chunk_size)"
    if chunk_size <= 0:
        return [f"chunk size must be positive, got {chunk_size}; set {flag} to a multiple of {block_size}"]
    problems: list[str] = []
    if chunk_size % block_size:
        problems.append(
            f"hkvd chunk size {chunk_size} must be a multiple of vLLM's block size {block_size}; "
            f"set {flag} to {_round_up(chunk_size, block_size)}"
        )
    bad = [g for g in groups if g.tokens_per_block <= 0 or chunk_size % g.tokens_per_block]
    if bad:
        # Every group's entry is a whole number of its blocks; the lcm is the smallest chunk
        # that is a block multiple for vLLM and for each offending group.
        lcm = math.lcm(block_size, *(g.tokens_per_block for g in bad if g.tokens_per_block > 0))
        detail = "; ".join(f"group {g.group_id} ({g.kind}) has {g.tokens_per_block}" for g in bad)
        problems.append(
            f"every group's tokens_per_block must divide chunk size {chunk_size}: {detail}; "
            f"set {flag} to a multiple of {lcm}"
        )
    return problems


def _mamba_problems(
    groups: Sequence[GroupLike], block_size: int, max_num_batched_tokens: int, mamba_cache_mode: str
) -> list[str]:
    mamba = [g for g in groups if g.kind == "mamba"]
    if not mamba:
        return []
    problems: list[str] = []
    if mamba_cache_mode != REQUIRED_MAMBA_CACHE_MODE:
        problems.append(
            f"Mamba groups need mamba_cache_mode='{REQUIRED_MAMBA_CACHE_MODE}' (got {mamba_cache_mode!r}: "
            "no reusable state snapshots); start vLLM with --enable-prefix-caching "
            f"--mamba-cache-mode {REQUIRED_MAMBA_CACHE_MODE}"
        )
    sizes = sorted({g.tokens_per_block for g in mamba})
    if len(sizes) > 1:
        problems.append(
            f"all Mamba groups must use one physical block size; got {sizes} tokens per block; "
            "remove per-group block size overrides and set one --block-size so vLLM aligns every "
            "Mamba group to it"
        )
    if max_num_batched_tokens < block_size:
        problems.append(
            f"Mamba-hybrid models need max_num_batched_tokens >= block size {block_size} (got "
            f"{max_num_batched_tokens}) so every prefill step advances at least one full block; "
            f"start vLLM with --max-num-batched-tokens {block_size} or larger "
            f"([{block_size}, {2 * block_size}) stores a state at every block boundary)"
        )
    return problems


def _raise(problems: list[str]) -> None:
    if problems:
        raise RegistrationError(" | ".join(problems))


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)
