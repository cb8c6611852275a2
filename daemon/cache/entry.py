"""An index entry: its key, its pool pages, its state and what holds it (``daemon/cache/index.py``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hkvd.daemon.cache.pool import Allocation

EntryKey = tuple[bytes, int, bytes]


class EntryState(enum.Enum):
    WRITING = "writing"
    PENDING = "pending"
    READY = "ready"
    CORRUPT = "corrupt"  # failed its checksum: never served, dropped once unpinned and unleased


@dataclass(slots=True)
class Entry:
    key: EntryKey
    alloc: Allocation
    nbytes: int
    kind: str  # group kind: full | swa | mamba
    state: EntryState = EntryState.WRITING
    pins: int = 0
    leases: int = 0
    job_id: int = 0  # the store job that wrote it (for pending confirmation)
    parent: bytes = b""  # chunk key of the previous chunk (prefix chain), b"" if chunk 0 or unknown
    tracked: bool = False  # READY and known to the chain tracker
    # XXH3-64 of its bytes once taken after it turned READY (daemon/integrity/checksums.py); 0: not yet.
    checksum: int = 0
    tenant: str = ""  # the tenant whose store wrote it (daemon/cache/quotas.py); "" for the unsalted share
    held: bool = False  # a session pin holds its chunk (daemon/cache/pins.py): in no eviction order
    chunk: int = -1  # its chunk index in the prompt (position / chunk size); -1: not known (recompute_cost.py)
