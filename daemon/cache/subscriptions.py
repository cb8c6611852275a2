"""The cache's events as subscriptions: an entry turned READY, an entry left the cache, a checksum is due.

Role
    The index calls one hook per event (``Index.on_ready``, ``on_drop``, ``on_checksum``); ``Subscriptions``
    owns those hooks and fans each event out to the callbacks subscribed to it (``Cache.subscribe``), so no
    code outside ``daemon/cache/`` assigns to the index. With no subscriber the hook is None (the index skips
    the call); with one, that callback is the hook itself (no fan-out on the store path).

Contracts
    Callbacks run on the event loop, inside the index's state change: they only read the entry (KV events,
    daemon/routing/announcer.py) or hand it to another thread's queue (checksums, daemon/integrity/). The
    returned call ends the subscription; calling it twice is harmless.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from hkvd.daemon.cache.entry import Entry
from hkvd.daemon.cache.index import Index

#: ``ready``: after an entry turned READY; ``drop``: after any entry left the cache, whatever its state;
#: ``checksum``: after an entry turned READY, its checksum to be taken (off the loop).
EventKind = Literal["ready", "drop", "checksum"]
Callback = Callable[[Entry], None]


class Subscriptions:
    """The callbacks subscribed to each of the index's events (module docstring)."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._subs: dict[EventKind, list[Callback]] = {"ready": [], "drop": [], "checksum": []}

    def subscribe(self, kind: EventKind, fn: Callback) -> Callable[[], None]:
        """Call ``fn(entry)`` on every event ``kind`` from now on; the returned call ends that."""
        self._subs[kind].append(fn)
        self._wire(kind)

        def end() -> None:
            subs = self._subs[kind]
            if fn in subs:
                subs.remove(fn)
                self._wire(kind)

        return end

    def _wire(self, kind: EventKind) -> None:
        subs = self._subs[kind]
        hook: Callback | None
        if not subs:
            hook = None
        elif len(subs) == 1:
            hook = subs[0]
        else:
            fns = tuple(subs)

            def hook(entry: Entry) -> None:
                for f in fns:
                    f(entry)

        if kind == "ready":
            self._index.on_ready = hook
        elif kind == "drop":
            self._index.on_drop = hook
        else:
            self._index.on_checksum = hook
