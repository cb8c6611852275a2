# SPDX-License-Identifier: Apache-2.0
"""A request's chunk keys on the scheduler side: the prompt's, and past it over the tokens vLLM knows.

Role
    ``ChunkKeys`` computes and caches ``RequestRecord.keys``: rolling chunk keys over the prompt's full
    chunks with vLLM's extra keys mixed in (``hkvd.shim.identity``), extended with ``store_decode`` (the
    engine's, or the request's own: ``RequestRecord.store_decode``) over the output tokens sampled so far,
    so the next turn's prompt, which repeats them, computes the same keys. A request that cannot be keyed
    is marked uncacheable once (``RequestRecord.uncacheable``), counted, and reported through
    ``on_uncacheable``; it is never looked up or stored.

Threading
    vLLM's scheduler thread only, like the scheduler side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hkvd.shim.identity import ChunkIdentity, Uncacheable
from hkvd.shim.request_state import RequestRecord
from hkvd.transport.keys import ROOT_KEY, chunk_keys

if TYPE_CHECKING:  # vLLM's type, for annotations only
    from vllm.v1.request import Request


class ChunkKeys:
    """Chunk keys of requests at ``chunk_size`` tokens per chunk (0: not known yet, nothing is keyed)."""

    def __init__(self, chunk_size: int, store_decode: bool,
                 on_uncacheable: Callable[[RequestRecord, Uncacheable], None] | None = None) -> None:
        self.chunk_size = chunk_size
        self.store_decode = store_decode
        self.identity = ChunkIdentity()
        self._on_uncacheable = on_uncacheable

    def prompt(self, st: RequestRecord) -> list[bytes]:
        """The prompt's chunk keys, extra keys mixed in; [] for a request that cannot be keyed (never cached)."""
        if not st.keys and self.chunk_size and not st.uncacheable:
            n = len(st.tokens) // self.chunk_size
            try:
                extras = self.identity.extras(st.request, self.chunk_size, n) if st.request is not None else None
            except Uncacheable as e:
                self._uncacheable(st, e)
                return []
            st.keys = chunk_keys(st.tokens, self.chunk_size, extras=extras)
        return st.keys

    def through(self, st: RequestRecord, n: int) -> list[bytes]:
        """The chunk keys, extended past the prompt up to ``n`` chunks over the tokens vLLM knows.

        Only with ``store_decode``; the extension continues the prompt's rolling keys, so the next
        turn's prompt, which repeats these tokens, computes the same keys.
        """
        keys = self.prompt(st)
        C = self.chunk_size
        if len(keys) >= n or not C or not self.decode(st) or st.request is None or st.uncacheable:
            return keys
        tokens = st.request.all_token_ids  # prompt + output tokens sampled so far (no placeholders)
        n = min(n, len(tokens) // C)
        first = len(keys)
        if n <= first:
            return keys
        try:
            extras = self.identity.extras(st.request, C, n, first)
        except Uncacheable as e:
            self._uncacheable(st, e)
            return keys
        keys.extend(chunk_keys(list(tokens[first * C:n * C]), C, parent=keys[-1] if keys else ROOT_KEY,
                               extras=extras))
        return keys

    def decode(self, st: RequestRecord) -> bool:
        """Whether the request's chunks past its prompt are keyed (and so stored): its own decision, else
        ``store_decode`` (hkvd.shim.decode_stores)."""
        return self.store_decode if st.store_decode is None else st.store_decode

    def known_tokens(self, st: RequestRecord) -> int:
        """Tokens a stored chunk may end at: the prompt's, and with store_decode the output tokens known."""
        if self.decode(st) and st.request is not None:
            return max(st.num_tokens, int(st.request.num_tokens))
        return st.num_tokens

    def has_extras(self, request: Request) -> bool:
        """Whether vLLM may key the request's blocks by extra keys (LoRA, multimodal, salt, embeddings): partial
        keys carry none, so such a request gets no partial chunks."""
        try:
            return self.identity.extras(request, self.chunk_size, 0) is not None
        except Uncacheable:
            return True

    def _uncacheable(self, st: RequestRecord, exc: Uncacheable) -> None:
        st.uncacheable = exc.reason
        self.identity.note(str(getattr(st.request, "request_id", "?")), exc)
        if self._on_uncacheable is not None:
            self._on_uncacheable(st, exc)
