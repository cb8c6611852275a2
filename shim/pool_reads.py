# SPDX-License-Identifier: Apache-2.0
"""In-step loads: the engine's read-only map of its daemon's pool, and the copies it makes from it.

Role
    A daemon offers host engines its pool (``HelloAck.pool``: the memfd's number in the daemon and the
    pool's size). ``PoolMaps.map`` opens it through ``/proc/<daemon pid>/fd/<n>`` and maps it read-only,
    keyed by the daemon's server id; the worker then registers with ``mapped_pool`` set to that id, and the
    daemon answers that engine world's leased lookups with the pool extents of every entry the hit loads
    (``LookupReply.places``). ``InStepLoads`` runs a worker's in-step loads: ``copy_in_step`` copies a load's
    entries from the map into the engine's KV blocks with ``memmove``, in the step that planned the load, before
    vLLM's runner reads them: the Mamba/GDN states in ``handle_preemptions`` (align mode's ``preprocess_mamba``
    copies them onward right after it), the attention blocks in ``start_load_kv`` (vLLM zeroes a synchronous
    load's new attention blocks of a hybrid model in between).

Why this cannot fail once planned
    The daemon leased every entry named (it neither evicts nor rewrites them until the lease is used or
    expires, and the scheduler side plans an in-step load only with most of the lease left); the map
    stays valid when the daemon dies or stops, since the engine holds the memfd's pages itself. A map of
    a daemon that is gone is kept until the next daemon's pool is mapped and a step no longer names it.

Trust
    Opening the memfd needs the access that reading the daemon's memory needs (the same user, or root):
    such an engine reads every entry of the pool, not only its grants (docs/security.md, "In-step
    loads"). Where the open fails, the worker says why once and every hit stays a ``Retrieve``.

Page tables
    A fresh map has none: the first read of each 4 KiB page faults, which halved the rate of copies from parts of
    the pool no load had read yet. Each map therefore starts a ``Populator`` (``hkvd.shim.map_populator``: its
    measurements and costs) that maps the pool's resident pages ahead of the copies, on a thread of its own.

Threading
    The worker's thread, and each map's populate thread, which only maps pages (``madvise``) and is stopped and
    joined before its map is unmapped.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hkvd.shim.jobs import LoadJob
from hkvd.shim.map_populator import Populator
from hkvd.shim.timeline import Timeline
from hkvd.transport import layout
from hkvd.transport.copy_engine import Region, host_iovecs
from hkvd.transport.errors import CopyFailedError
from hkvd.transport.wire.kv import Item

logger = logging.getLogger("hkvd.shim")

KEEP_MAPS = 2  # the current daemon's pool and the one before it (loads planned just before a restart)


@dataclass(slots=True)
class PoolMap:
    server_id: str
    size: int
    mm: mmap.mmap
    view: Any  # a NumPy view of the map: its address; released before the map is closed
    base: int  # the map's address in this process
    populator: Populator | None = None  # maps its pages ahead of the copies; stopped before the map is closed

    def close(self) -> None:
        if self.populator is not None:
            self.populator.stop()
        self.view = None
        self.mm.close()


class PoolMaps:
    """The pools this engine process mapped, newest last (at most ``KEEP_MAPS``)."""

    def __init__(self, *, populate: bool = True) -> None:
        self.populate = populate  # map each pool's pages ahead of the copies (module docstring, "Page tables")
        self._maps: dict[str, PoolMap] = {}
        self._refused = False  # said once why the pool could not be mapped

    def map(self, daemon_pid: int, server_id: str, offer: Sequence[int]) -> str:
        """Map the pool ``offer`` (``[fd, size]`` in the daemon ``daemon_pid``) read-only: the server id to
        register with (``Register.mapped_pool``), or "" when not offered or not mappable (said once)."""
        if not offer or not server_id:
            return ""
        if server_id in self._maps:
            return server_id
        fd_num, size = int(offer[0]), int(offer[1])
        path = f"/proc/{daemon_pid}/fd/{fd_num}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        except OSError as e:
            if not self._refused:
                self._refused = True
                logger.warning("hkvd worker: cannot map the daemon's pool (%s: %s): every hit loads through the "
                               "daemon, a step later. Run the engine as the daemon's user (or root) for in-step "
                               "loads (docs/security.md, \"In-step loads\")", path, e.strerror or e)
            return ""
        view = np.frombuffer(mm, dtype=np.uint8)  # ctypes' from_buffer wants a writable map
        pool = self._maps[server_id] = PoolMap(server_id, size, mm, view, int(view.ctypes.data))
        if self.populate:
            pool.populator = Populator(pool.base, size)
            pool.populator.start()
        while len(self._maps) > KEEP_MAPS:
            self._maps.pop(next(iter(self._maps))).close()
        logger.info("hkvd worker: mapped the daemon's pool read-only (%.1f GiB) for in-step loads", size / 2**30)
        return server_id

    def get(self, server_id: str) -> PoolMap | None:
        return self._maps.get(server_id)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


Layout = tuple[dict[int, layout.GroupSpec], dict[int, Region], int]  # groups, regions, rank


class InStepLoads:
    """A worker's in-step loads: its pool maps, the copies of each step's loads, and the blocks of any that could
    not be copied. ``layout`` gives this rank's registered groups, regions and rank (asked once)."""

    def __init__(self, timeline: Timeline, layout_of: Callable[[], Layout]) -> None:
        self.maps = PoolMaps()
        self.timeline = timeline
        self._layout_of = layout_of
        self._layout: Layout | None = None
        self._errors: set[int] = set()  # blocks of loads that could not be copied (a bug)
        self._failed: set[str] = set()  # this step's loads whose states could not be copied
        self.stats = {"in_step_loads": 0, "in_step_bytes": 0}

    def copy(self, loads: Iterable[LoadJob], states: bool) -> None:
        """Copy the Mamba/GDN states (``states``: in ``handle_preemptions``) or the attention blocks (in
        ``start_load_kv``, which ends the step's copies) of the in-step ``loads``. Nothing can fail them but a
        bug (a pool no longer mapped, a place out of bounds): their blocks are then load errors
        (``take_errors``), which vLLM recomputes for a model of one KV-cache group and stops the engine for
        others, rather than run a forward over blocks not written."""
        if self._layout is None:
            self._layout = self._layout_of()
        groups, regions, rank = self._layout
        for job in loads:
            if job.places is None or job.req_id in self._failed:
                continue
            items = [it for it in job.items if (groups[it.group_id].kind == "mamba") is states]
            self.timeline.note(job.req_id, "load_issued" if states else "attention_copy")
            pool = self.maps.get(job.pool)
            try:
                if pool is None:
                    raise ValueError(f"the pool of daemon {job.pool!r} is not mapped here")
                if not 0 <= rank < len(job.places):
                    raise ValueError(f"no places for rank {rank} ({len(job.places)} ranks placed)")
                places = {(int(g), int(c)): ext for g, c, ext in job.places[rank]}
                nbytes = copy_in_step(pool, items, places, groups, regions) if items else 0
                if states:
                    self.timeline.note(job.req_id, "states_copied")
            except (ValueError, KeyError, TypeError) as e:
                logger.error("hkvd worker: in-step load of %s could not be copied (%s); its %d blocks are reported "
                             "as load errors", job.req_id, e, len(job.block_ids))
                self._errors.update(job.block_ids)
                self._failed.add(job.req_id)
                self.timeline.note(job.req_id, "load_failed")
                continue
            self.stats["in_step_bytes"] += nbytes
            if not states:
                self.stats["in_step_loads"] += 1
                self.timeline.note(job.req_id, "load_done")
        if not states:
            self._failed.clear()

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


def copy_in_step(pool: PoolMap, items: Iterable[Item], places: Mapping[tuple[int, int], Sequence[int]],
                 groups: Mapping[int, layout.GroupSpec], regions: Mapping[int, Region]) -> int:
    """Copy ``items`` from ``pool`` into the engine's blocks: bytes copied.

    ``places``: (group id, chunk index) -> the entry's flat extents ``[offset, length, ...]`` in the pool
    (this rank's, from the lookup reply). Every segment is checked against the pool's and its region's
    bounds before any byte moves, as the daemon's host copy engine checks them (``host_iovecs``);
    ``ValueError`` names the first that is out of them (a daemon bug)."""
    entries: list[tuple[layout.GroupSpec, list[int], list[tuple[int, int]]]] = []
    for it in items:
        flat = places.get((it.group_id, it.chunk_index))
        if flat is None:
            raise ValueError(f"no pool place for group {it.group_id} chunk {it.chunk_index}")
        extents = [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
        g = groups[it.group_id]
        if 0 not in it.block_ids:
            entries.append((g, list(it.block_ids), extents))
            continue
        if g.kind == "mamba":
            raise ValueError(f"group {g.group_id}'s state block is vLLM's null block")
        # A sliding window that starts inside the chunk: vLLM nulled the blocks below it, which no forward
        # reads; the others get their part of the entry.
        bb = g.block_bytes
        entries.extend((g, [b], slice_extents(extents, k * bb, bb)) for k, b in enumerate(it.block_ids) if b)
    if any(r.kind != "host" for r in regions.values()):
        raise ValueError("in-step copy out of bounds: the engine's KV caches are not in host memory")
    try:
        local, remote, total = host_iovecs(layout.segments_for_entries(entries), regions, pool.base, pool.size)
    except CopyFailedError as e:
        raise ValueError(f"in-step copy out of bounds: {e.message}") from None
    memmove = ctypes.memmove
    for i in range(0, len(local), 2):
        memmove(remote[i], local[i], local[i + 1])
    return total


def slice_extents(extents: Sequence[tuple[int, int]], start: int, nbytes: int) -> list[tuple[int, int]]:
    """The pool extents of logical bytes [start, start + nbytes) of an entry laid into ``extents``."""
    out: list[tuple[int, int]] = []
    pos, end = 0, start + nbytes
    for off, length in extents:
        lo, hi = max(start, pos), min(end, pos + length)
        if lo < hi:
            out.append((off + lo - pos, hi - lo))
        pos += length
        if pos >= end:
            break
    if sum(n for _, n in out) != nbytes:
        raise ValueError(f"the entry's extents hold {pos} bytes, not [{start}, {end})")
    return out
