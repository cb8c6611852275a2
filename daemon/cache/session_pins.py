"""Session pins as the rest of the daemon asks for them (``Cache.sessions``; the rules: daemon/cache/pins.py).

Role
    A router or an engine pins a session's chunks for a TTL (``PinChunks``); the daemon unpins them when
    the session ends, and the disk tier's cap passes over pinned chunks' files. These are the verbs it has
    for that; the pins' table, budget and eviction effects stay inside the index.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

from collections.abc import Sequence

from hkvd.daemon.cache.entry import EntryKey
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.pins import PinStats


class Sessions:
    """Pin, unpin and read session pins of one cache's index."""

    def __init__(self, index: Index) -> None:
        self._index = index

    def pin(self, world: tuple[bytes, ...], session: str, tenant: str, keys: list[bytes], ttl_s: float,
            partial_keys: Sequence[bytes] = ()) -> bool:
        """Hold ``keys`` (and ``partial_keys``) of every rank of ``world`` for ``ttl_s`` as pin ``session``;
        False: refused (too many sessions)."""
        return self._index.pin_session(world, session, tenant, keys, ttl_s, partial_keys)

    def unpin(self, session: str) -> int:
        """End every pin of ``session``; how many."""
        return self._index.unpin_session(session)

    def holds(self, key: EntryKey) -> bool:
        """Whether a session pin holds ``key``'s chunk (of its fingerprint)."""
        return self._index.pins.is_pinned(key[0], key[2])

    def statistics(self) -> PinStats:
        return self._index.pin_statistics()
