"""Places: where in the pool a leased hit's entries lie, for engines that copy them themselves (in-step loads).

Role
    With ``--in-step-loads on``, a daemon offers engines its pool (``HelloAck.pool``: the memfd's number and
    size); a host engine process that mapped it read-only registers with ``Register.mapped_pool`` naming this
    daemon's server id. ``Places.of`` answers a leased lookup that asked (``Lookup.places``) with the pool
    extents of every entry the hit loads, rank by rank (``LookupReply.places``), so the engine copies them
    into its KV blocks in the step that plans the load instead of sending a ``Retrieve``.

When a lookup gets places
    Only when every rank of the asking engine's world (``LookupPlan.fingerprints``) has a worker *of that
    engine* registered whose regions are all host memory (never CUDA) and whose process mapped this daemon's
    pool; where a rank has several, every one of them must have. A worker is the asking engine's when it runs
    in the asking (scheduler side's) process or in a child of it: vLLM runs a TP=1 worker in its engine core
    process and the workers of a larger world as that process's children. Workers of another engine of the
    same format do not count: just after a daemon restart one engine's worker may have mapped the new pool
    while another's has not registered again yet, and places sent to the latter would fail its copy (a load
    error, which stops a hybrid engine). Workers in no such relation (another launcher) get no places.
    Otherwise, where an entry of the plan is not READY in the pool, or where the hit has more entries in all
    than a message carries items (``MAX_ITEMS``: the reply stays far below a frame's bound), no places: the
    hit is a ``Retrieve``.

Why the extents stay true
    The lookup's lease (``Cache.lease``) holds every entry named: none is evicted or rewritten until the
    lease is used, released or expires. The engine's scheduler side releases it (``Release``) once the
    step that copied has run; an engine that stops stepping leaves it to expire.

Trust (docs/security.md, "In-step loads: engines read the pool")
    An engine that can open ``/proc/<daemon pid>/fd/<n>`` reads the whole pool, not only its grants; the
    places only say where its own hit lies.

Threading
    Event loop only: the registry and the cache are read in one call, without awaiting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hkvd.daemon.cache import EntryState
from hkvd.transport.wire.message import MAX_ITEMS

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache, LookupPlan
    from hkvd.daemon.engines.registry import EngineState, Registry

HOST = "host"


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (``/proc/<pid>/stat``), or -1 when it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def of_engine(worker: EngineState, asker: EngineState) -> bool:
    """Whether ``worker`` runs in the process of ``asker`` (an engine's scheduler side) or in a child of it."""
    return worker.pid == asker.pid or parent_pid(worker.pid) == asker.pid


def maps_pool(engine: EngineState, server_id: str) -> bool:
    """Whether ``engine`` is a host worker whose process mapped the pool of the daemon ``server_id``."""
    return (engine.can_copy and engine.mapped_pool == server_id and bool(engine.spec.regions)
            and all(r.kind == HOST for r in engine.spec.regions))


class Places:
    """``LookupReply.places`` for the daemon ``server_id`` (module docstring)."""

    def __init__(self, index: Cache, registry: Registry, server_id: str) -> None:
        self.index = index
        self.registry = registry
        self.server_id = server_id

    def world_mapped(self, fingerprints: tuple[bytes, ...], asker: EngineState) -> bool:
        """Whether every rank of ``fingerprints`` has a worker of ``asker``'s engine, and each of them maps the
        pool. Ranks are told apart by fingerprint and rank: a replicated world's ranks share one fingerprint."""
        workers: dict[tuple[bytes, int], list[EngineState]] = {(fp, r): [] for r, fp in enumerate(fingerprints)}
        for e in self.registry.engines():
            if e.can_copy and (e.fingerprint, e.spec.rank) in workers and of_engine(e, asker):
                workers[(e.fingerprint, e.spec.rank)].append(e)
        return all(ws and all(maps_pool(e, self.server_id) for e in ws) for ws in workers.values())

    def of(self, plan: LookupPlan, asker: EngineState) -> list[list[list[object]]]:
        """Per rank of ``plan`` (the lookup of ``asker``), ``[group_id, chunk_index, [offset, length, ...]]`` of
        each entry it loads; [] where the asker's workers do not map the pool or an entry is not READY."""
        entries = len(plan.fingerprints) * sum(len(chunks) for chunks in plan.needed.values())
        if not entries or entries > MAX_ITEMS or not self.world_mapped(plan.fingerprints, asker):
            return []
        get, keys = self.index.get, plan.keys
        out: list[list[list[object]]] = []
        for fp in plan.fingerprints:
            rank: list[list[object]] = []
            for gid, chunks in plan.needed.items():
                for c in chunks:
                    entry = get((fp, gid, keys[c]))
                    if entry is None or entry.state is not EntryState.READY:
                        return []
                    rank.append([gid, c, [x for ext in entry.alloc.extents for x in ext]])
            out.append(rank)
        return out
