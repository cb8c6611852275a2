"""Sampled hits, recomputed: compare with the entries held, never store (daemon/integrity; docs/verification.md).

Role
    Serves ``Verify`` (the engine recomputed a sampled hit: copy its blocks into scratch pool room,
    compare each with the entry under its key) and compares the boundary states a step event copied
    for a sampled hit once the engine confirms them (``start_check``, in the background). Counts per
    (fingerprint, group) go to the ``Quarantine``, which withholds a diverged pair from every plan.

Threading
    Event loop; the comparisons run on the copy thread pool. Scratch room is freed by ``check``
    whatever it finds, or by ``free_scratch`` for a copy never compared.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, NamedTuple

from hkvd.daemon.cache import Allocation, Cache, Entry, EntryState, Extent
from hkvd.daemon.engines.connection import registered_engine
from hkvd.daemon.integrity.compare import entry_error, tolerance
from hkvd.transport import layout
from hkvd.transport.copy_engine import Direction
from hkvd.transport.errors import Aborted
from hkvd.transport.layout import GroupSpec
from hkvd.transport.wire.kv import Item, VerifyResult

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from hkvd.daemon.config import ConfigCell, DaemonConfig
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.copies import Copies
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.integrity.quarantine import Quarantine
    from hkvd.transport.wire import kv

log = logging.getLogger("hkvd.service")


class Scratch(NamedTuple):
    """A sampled hit's recomputed entry: the item naming it, its group, the pool room holding the copy."""

    item: Item
    group: GroupSpec
    alloc: Allocation


def _gather(buffer: memoryview, extents: tuple[Extent, ...]) -> bytes:
    """An allocation's bytes, in entry order."""
    return b"".join(buffer[x.pool_offset:x.pool_offset + x.length] for x in extents)


class Verification:
    """Sampled hits' comparisons; ``quarantine`` counts them (the service's, read by ``status``)."""

    def __init__(self, config: ConfigCell, index: Cache, copies: Copies, executor: Executor,
                 quarantine: Quarantine) -> None:
        self.config = config
        self.index = index
        self.copies = copies
        self.executor = executor
        self.quarantine = quarantine
        self._checks: set[asyncio.Task[VerifyResult]] = set()  # comparisons of confirmed boundary states

    async def verify(self, conn: Conn, msg: kv.Verify) -> None:
        """Copy the engine's blocks of ``msg.items`` into scratch room, compare each with the entry held
        under its key, count and maybe quarantine; answer a ``VerifyResult``. Entries no longer held are
        missing (neither copied nor compared)."""
        engine = registered_engine(conn, copy=True)
        fp = engine.fingerprint
        checked = [(it, engine.check_item(it)) for it in msg.items]  # all or nothing: check before any copy
        held: list[tuple[Item, GroupSpec]] = []
        absent: list[tuple[Item, GroupSpec]] = []
        for it, g in checked:
            (held if self.index.is_ready((fp, g.group_id, it.key)) else absent).append((it, g))
        keep = [e for it, g in held if (e := self.index.get((fp, g.group_id, it.key))) is not None]
        unpin = self.index.pin_for_read(keep)  # the scratch room below must not evict what it is compared with
        try:
            scratch = await self.copy_scratch(conn, engine, [it for it, _ in held], msg.wait_event, urgent=False)
            if msg.req_id in conn.aborted:
                self.free_scratch(scratch)
                conn.aborted.discard(msg.req_id)
                raise Aborted(f"job {msg.req_id} was aborted by the client; nothing was compared")
            result = await self.check(engine, scratch, absent, msg.req_id)
        finally:
            unpin()
        conn.send(result)

    async def copy_scratch(self, conn: Conn, engine: EngineState, items: list[Item], wait_event: bytes, *,
                           urgent: bool) -> list[Scratch]:
        """The engine's blocks of ``items``, copied into scratch pool room (freed by ``check``)."""
        if not items:
            return []
        scratch: list[Scratch] = []
        try:
            for it in items:
                g = engine.check_item(it)
                scratch.append(Scratch(it, g, self.index.scratch(engine.entry_bytes[g.group_id])))
            segments = layout.segments_for_entries([(s.group, s.item.block_ids, s.alloc.extents) for s in scratch])
            await self.copies.run(conn, engine.attachment, segments, Direction.TO_POOL, wait_event, urgent=urgent)
        except BaseException as exc:
            self.copies.release_after(exc, functools.partial(self.free_scratch, scratch))
            raise
        return scratch

    def free_scratch(self, scratch: list[Scratch]) -> None:
        for s in scratch:
            self.index.pool.free(s.alloc)

    def start_check(self, engine: EngineState, scratch: list[Scratch]) -> None:
        """Compare confirmed boundary states in the background: the step event's own copies go first."""
        task = asyncio.create_task(self.check(engine, scratch, []))
        self._checks.add(task)
        task.add_done_callback(self._check_done)

    def _check_done(self, task: asyncio.Task[VerifyResult]) -> None:
        self._checks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("comparing a sampled hit's boundary states failed: %r", exc)

    async def check(self, engine: EngineState, scratch: list[Scratch],
                    absent: list[tuple[Item, GroupSpec]], req_id: int = 0) -> VerifyResult:
        """Compare each scratch copy with the entry under its key (absent now: missing); free the scratch;
        count per (fingerprint, group) and quarantine past the threshold. The result answers ``req_id``'s
        ``Verify`` (0: a step event's boundary states, whose result nobody reads)."""
        fp, cfg, pool = engine.fingerprint, self.config.current, self.index.pool
        try:
            pairs: list[tuple[Scratch, Entry]] = []
            for s in scratch:
                e = self.index.get((fp, s.group.group_id, s.item.key))
                if e is None or e.state is not EntryState.READY:
                    absent.append((s.item, s.group))
                else:
                    pairs.append((s, e))
            unpin = self.index.pin_for_read([e for _, e in pairs])
            try:
                def compare() -> list[float]:
                    return [entry_error(_gather(pool.buffer, s.alloc.extents), _gather(pool.buffer, e.alloc.extents),
                                        s.group) for s, e in pairs]
                errors = await asyncio.get_running_loop().run_in_executor(self.executor, compare) if pairs else []
            finally:
                unpin()
        finally:
            self.free_scratch(scratch)
        by_group: dict[int, tuple[GroupSpec, list[tuple[Item, float]], int]] = {}
        for (s, _), err in zip(pairs, errors, strict=True):
            by_group.setdefault(s.group.group_id, (s.group, [], 0))[1].append((s.item, err))
        for _it, g in absent:
            g_, seen, n = by_group.get(g.group_id, (g, [], 0))
            by_group[g.group_id] = (g_, seen, n + 1)
        diverged_total, quarantined, worst = 0, False, 0.0
        for gid, (g, seen, n_missing) in sorted(by_group.items()):
            diverged, worst_g, held = self._record(cfg, fp, gid, g, seen, n_missing)
            diverged_total += diverged
            worst = max(worst, worst_g)
            quarantined |= held
        nbytes = sum(s.alloc.nbytes for s in scratch)
        return VerifyResult(req_id, nbytes, len(pairs), diverged_total, len(absent), worst, quarantined)

    def _record(self, cfg: DaemonConfig, fp: bytes, gid: int, g: GroupSpec, seen: list[tuple[Item, float]],
                n_missing: int) -> tuple[int, float, bool]:
        """Count one group's comparisons with the quarantine: (entries past tolerance, the largest error,
        whether the pair is quarantined now)."""
        tol = tolerance(g.kind, cfg.verify_tolerance, cfg.verify_mamba_tolerance)
        bad = [(it, err) for it, err in seen if err > tol]
        worst_g = max((err for _, err in seen), default=0.0)
        evidence = "; ".join(f"chunk {it.chunk_index} key {it.key.hex()[:16]} error {err:.4g}"
                             for it, err in bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
        if bad:
            log.warning("sampled hit diverged: fingerprint %s group %d (%s), %d of %d entries past tolerance "
                        "%g: %s", fp.hex(), gid, g.kind, len(bad), len(seen), tol, evidence)
        quarantined = self.quarantine.record(
            fp, gid, g.kind, checked=len(seen), diverged=len(bad), missing=n_missing, max_error=worst_g,
            evidence=f"{evidence} (tolerance {tol:g})", threshold=cfg.quarantine_after,
            window_s=cfg.quarantine_window_s)
        return len(bad), worst_g, quarantined
