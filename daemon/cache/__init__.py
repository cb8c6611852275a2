"""The cache: the one place that decides what counts as a hit and what gets leased.

``core`` is the facade (``Cache``: the closed set of verbs over a private index: what a lookup gets,
leases, stores, reads, a read-only entry view, session pins, quotas, ``formats``, the one record of
engine formats, ``Formats``, and ``subscribe`` for the index's events, ``subscriptions``); under it,
``lookup_plan`` decides what a lookup gets (``Cache.plan_lookup`` its one caller), ``session_pins``
is the session pins' verbs (``Cache.sessions``), ``index`` keeps entry keys -> pool pages with their
states and pins, ``leases`` the lookup leases, ``hybrid`` the hybrid hit rule, ``chains`` which
entries can serve no hit any more, ``eviction`` the eviction policies (``recompute_cost`` the value the
``cost`` policy weighs), ``admission`` whether an engine's store may evict (over ``frequency_sketch``),
and ``pool`` (with ``backing`` and ``prefault``) the huge-page pool and its accounting. Code outside this
package imports the names below, never the modules under it, and uses only ``Cache``'s verbs
(``tests/unit/test_layers.py``).
"""

from hkvd.daemon.cache.admission import ADMISSIONS, NotAdmitted
from hkvd.daemon.cache.core import Cache
from hkvd.daemon.cache.entry import Entry, EntryKey, EntryState
from hkvd.daemon.cache.eviction import POLICIES, EvictionPolicy, make_policy
from hkvd.daemon.cache.formats import MAX_WORLDS, Formats, WorldFormat
from hkvd.daemon.cache.hybrid import GroupRule, mamba_checkpoint_keep
from hkvd.daemon.cache.index import IndexStats
from hkvd.daemon.cache.lookup_plan import HasFn, LookupPlan, Shape, Tail, TailSource
from hkvd.daemon.cache.pins import PinStats
from hkvd.daemon.cache.pool import (
    MIN_SUPERBLOCK_BYTES,
    Allocation,
    Extent,
    HugePagePool,
    PoolStats,
    smallest_pool_bytes,
    superblocks_needed,
)
from hkvd.daemon.cache.prefault import Prefaulter, default_threads, first_slice_bytes
from hkvd.daemon.cache.quotas import Tenants, TenantStats

__all__ = [
    "ADMISSIONS", "MAX_WORLDS", "MIN_SUPERBLOCK_BYTES", "POLICIES", "Allocation", "Cache", "Entry", "EntryKey",
    "EntryState", "EvictionPolicy", "Extent", "Formats", "GroupRule", "HasFn", "HugePagePool", "IndexStats",
    "LookupPlan", "NotAdmitted", "PinStats", "PoolStats", "Prefaulter", "Shape", "Tail", "TailSource", "TenantStats",
    "Tenants", "WorldFormat", "default_threads", "first_slice_bytes", "make_policy", "mamba_checkpoint_keep",
    "smallest_pool_bytes", "superblocks_needed",
]
