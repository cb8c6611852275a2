"""What holds the index's entries besides a copy's pin: leases, and session pins within their budget.

Role
    ``hold``/``unhold`` are the lease table's callbacks (``daemon/cache/leases.py``): a lease holds a
    READY entry against eviction. ``pin_changed`` is the session pin table's (``daemon/cache/pins.py``):
    an entry of a pinned chunk leaves the eviction order and counts in ``pinned_bytes``, and returns to
    the order (as most recently used) when the pin ends. ``keep_budget`` lapses the oldest pins while
    ``pinned_bytes`` exceeds ``budget_bytes``. A CORRUPT entry goes once nothing holds it
    (``drop_if_corrupt``).

Threading
    Event-loop only, as the index that owns it (``daemon/cache/index.py``); it reads the index's entry
    table and group ids in place and removes entries through the index's ``drop``.
"""

from __future__ import annotations

from collections.abc import Callable

from hkvd.daemon.cache.entry import Entry, EntryKey, EntryState
from hkvd.daemon.cache.eviction import EvictionPolicy
from hkvd.daemon.cache.pins import Pins


class Holds:
    """Lease and session-pin holds on ``entries``; ``group_ids`` maps a fingerprint to its format's group ids."""

    def __init__(self, entries: dict[EntryKey, Entry], policy: EvictionPolicy, drop: Callable[[Entry], None], *,
                 group_ids: dict[bytes, tuple[int, ...]], budget_bytes: int) -> None:
        self.policy = policy
        self.budget_bytes = budget_bytes
        self.pinned_bytes = 0  # bytes of the entries session pins hold
        self._entries = entries
        self._drop = drop
        self._group_ids = group_ids

    def drop_if_corrupt(self, entry: Entry) -> None:
        if entry.state is EntryState.CORRUPT and entry.pins <= 0 and entry.leases <= 0:
            self._drop(entry)

    def hold(self, key: EntryKey) -> bool:
        """A lease takes ``key``: held against eviction if it is READY (False if there is no such entry)."""
        e = self._entries.get(key)
        if e is None or e.state is not EntryState.READY:
            return False
        e.leases += 1
        self.policy.touch(key)
        return True

    def unhold(self, key: EntryKey) -> None:
        e = self._entries.get(key)
        if e is not None:
            e.leases -= 1
            if e.state is EntryState.CORRUPT:
                self.drop_if_corrupt(e)

    def keep_budget(self, pins: Pins) -> None:
        """Lapse the oldest pins while their entries' bytes exceed the budget."""
        while self.pinned_bytes > self.budget_bytes and (oldest := pins.oldest()) is not None:
            pins.lapse(oldest, "budget")

    def pin_changed(self, fp: bytes, chunk_key: bytes, held: bool) -> None:
        """``fp``'s entries of ``chunk_key`` became held by a pin (out of the eviction order) or free (back in
        it, as most recently used)."""
        entries = self._entries
        for gid in self._group_ids.get(fp, ()):
            e = entries.get((fp, gid, chunk_key))
            if e is None or e.held is held:
                continue
            e.held = held
            if held:
                self.pinned_bytes += e.nbytes
                self.policy.remove(e.key)
            else:
                self.pinned_bytes -= e.nbytes
                if e.state is EntryState.READY:
                    self.policy.insert(e.key)
