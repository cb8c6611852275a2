# SPDX-License-Identifier: Apache-2.0
"""Where turn-end states lie: offsets of partial chunks by the key of the whole chunk before them.

Kept on both sides (docs/design.md, "Hit granularity"): the engine's scheduler side remembers where its own
requests ended, to send those positions as lookup tails; the daemon remembers where every engine's turn-end
stores ended (``Store.turn_end``) and names them in a lookup's reply (``LookupReply.ends``), so a turn that
ended on another engine of the node, or before an engine restarted, is found too.
"""

from __future__ import annotations

from collections import OrderedDict


class TurnEnds:
    """Where stored turn-end states lie: the key of the whole chunk before one (``ROOT_KEY`` for chunk 0) ->
    their offsets inside the next chunk. Bounded: ``limit`` chunk keys, least recently used out first, and
    ``per_key`` offsets each, oldest out first. A remembered position only says where to probe: the probe's
    key, over the new prompt's tokens, decides whether it is the same prefix."""

    def __init__(self, limit: int = 4096, per_key: int = 32) -> None:
        if limit < 1 or per_key < 1:
            raise ValueError(f"TurnEnds needs limit >= 1 and per_key >= 1, got {limit}, {per_key}")
        self._limit, self._per_key = limit, per_key
        self._at: OrderedDict[bytes, dict[int, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def add(self, parent: bytes, offset: int) -> None:
        offsets = self._at.pop(parent, {})
        offsets.pop(offset, None)
        offsets[offset] = None
        while len(offsets) > self._per_key:
            del offsets[next(iter(offsets))]
        self._at[parent] = offsets
        while len(self._at) > self._limit:
            self._at.popitem(last=False)

    def offsets(self, parent: bytes) -> list[int]:
        """The offsets remembered after ``parent``'s chunk, newest first."""
        offsets = self._at.get(parent)
        if offsets is None:
            return []
        self._at.move_to_end(parent)
        return list(reversed(offsets))

    def positions(self, parent: bytes, chunk_start: int, num_tokens: int) -> list[int]:
        """The remembered positions after ``parent``'s chunk that leave the prompt's last token to compute,
        newest first."""
        return [chunk_start + o for o in self.offsets(parent) if chunk_start + o < num_tokens]
