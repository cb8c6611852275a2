# SPDX-License-Identifier: Apache-2.0
"""Worker side of the connector: registration, asynchronous loads, stores, boundary step events.

Role
    Runs in each vLLM worker process, in the model runner's execute loop. It registers the
    engine's KV memory with the daemon once (one region per distinct backing storage: host
    memory, or a CUDA IPC export through ``shim/gpu.py``; one view per layer), then per step:

    0. In-step loads (``in_step_loads``, ``hkvd.shim.pool_reads``): a hit the daemon placed in its pool, which
       this process maps read-only, is copied here, not retrieved: its Mamba/GDN states at the end of
       ``handle_preemptions`` (align mode's ``preprocess_mamba`` copies them onward right after), its
       attention blocks in ``start_load_kv``, which vLLM calls before the forward in a step with a synchronous
       load (and after it zeroed the new attention blocks of a hybrid model). Nothing reports them.
    1. ``handle_preemptions`` (before vLLM zeroes this step's new blocks): fence. Copies still
       reading a block that this step allocates anew are waited for (``fence_timeout_s``,
       then aborted and treated as failed). So are the state copies of the step event two
       steps back, which the daemon drops unless they end before this step is reported
       (``state_copy_wait_s``, then left to be dropped).
    2. ``start_load_kv`` (after the forward): submit every load of the step and return
       (``hkvd.shim.loads``). The scheduler reports loads as asynchronous, so their requests
       wait (WAITING_FOR_REMOTE_KVS) while the other requests keep stepping, and no forward
       reads their blocks until the load is reported: ``get_transfer_results`` reports each as
       finished once the daemon's reply for it has been read, and a failed one also as failed
       (``failed_recving``): vLLM recomputes the request. (The scheduler side may report a
       host-memory load first, once the daemon says every rank's copy is in:
       ``ShimConfig.early_load_reports``.) A load not done within ``load_timeout_s`` is aborted
       and still waits for the reply. A load expected to end within a fifth of the step's time
       (``load_settle_fraction``, at most ``load_settle_max_s``) is waited for at the step's end,
       so that its request runs in the next step rather than the one after. Block-level load
       errors are never reported (vLLM 0.32 stops the engine on them for models with several
       KV-cache groups). Mamba layers get no per-layer hooks, so every group is moved in bulk by
       one Retrieve.
    3. ``wait_for_save`` (after the forward): submit the step's attention stores (each with its
       request's tenant, ``hkvd.shim.tenants``, to a daemon that keeps tenant quotas), the
       ``Verify`` of each sampled hit's recomputed chunks (``hkvd.shim.verify``), and one
       ``StepEvent`` carrying this step's Mamba offers (and a sampled hit's recomputed states, as
       its verifies) and the confirms of earlier step events whose StepResult arrived before any block
       they read was reused. A Verify that fails is counted and logged; nothing waits on it but
       the free of its request's blocks, as for a store.
    4. ``get_finished``: report requests whose free was delayed once their copies are done.

Threading model
    Only vLLM's execute thread calls in; completions are read by polling the daemon client
    from these hooks. The daemon reads (stores, offers) and writes (loads) this process's
    memory with process_vm_readv/writev while vLLM keeps running, which is why blocks that
    are about to be reused are fenced. Blocks being loaded need no fence: vLLM neither
    schedules nor frees a request in WAITING_FOR_REMOTE_KVS before its load is reported.

Failure handling
    Daemon down: loads fail (recompute), stores and offers are skipped, delayed frees are
    released at once; the link reconnects and re-registers every ``reconnect_interval_s``
    (new engine id, step-event seq restarts). Never serve garbage: a load counts as done
    only on the daemon's RetrieveResult for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hkvd.cuda.export import export_tensor
from hkvd.shim.client import DaemonClient
from hkvd.shim.gpu import GpuOrdering, one_device
from hkvd.shim.jobs import item_blocks
from hkvd.shim.kv_views import check_layer_tensor, config_place
from hkvd.shim.link import DaemonLink
from hkvd.shim.loads import Loads
from hkvd.shim.metadata import HkvdConnectorMetadata
from hkvd.shim.pd import PullLoads
from hkvd.shim.pool_reads import InStepLoads
from hkvd.shim.ptrace import allow_ptracer
from hkvd.shim.results import Completion
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.spec import build_engine_spec, resolved_layout, validate_vllm
from hkvd.shim.timeline import OFF, Timeline
from hkvd.shim.verify import VerifyTally
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import DaemonUnavailable, KVTimeout
from hkvd.transport.layout import GroupSpec
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.events import COPY_DEADLINE_STEPS, StepResult
from hkvd.transport.wire.kv import RetrieveResult, StoreResult, VerifyResult

if TYPE_CHECKING:  # vLLM's and torch's types, for annotations only
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("hkvd.shim")


@dataclass(slots=True)
class _Job:
    kind: str  # store | step | verify
    blocks: set[int]
    reqs: set[str] = field(default_factory=set)
    group_kind: str = ""  # verify: the group kind of its items
    step: int = 0  # step: the step whose offers it copies
    awaited: bool = False  # step: waited for once before the step that ends its copy's time (never twice)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig | None, kv_cache_config: KVCacheConfig | None,
                 cfg: ShimConfig) -> None:
        """``vllm_config`` and ``kv_cache_config`` are None only in tests that script the daemon and
        never register KV caches."""
        if vllm_config is not None and kv_cache_config is not None:
            # Workers start (and allocate KV) before the scheduler: fail here, with the fix.
            validate_vllm(vllm_config, kv_cache_config, cfg)
        self.cfg = cfg
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._regions: list[Region] = []
        self._layer_addr: dict[str, tuple[int, int, tuple[tuple[int, int], ...]]] = {}
        self.link = DaemonLink(cfg, "worker", "vllm-worker", self._spec, on_connected=self._connected)
        self._gen = 0
        self._seq = 0
        self._jobs: dict[int, _Job] = {}
        self._req_jobs: dict[str, set[int]] = {}
        self._finishing: set[str] = set()
        self._confirmable: list[int] = []
        # Per-request events (timeline_path; hkvd.shim.timeline) under the step of the metadata bound last.
        self.timeline = Timeline(cfg.timeline_path) if cfg.timeline_path else OFF
        self.loads = Loads(cfg.load_timeout_s, on_loaded=self._loaded, timeline=self.timeline)  # every load in flight
        self._pd = PullLoads(cfg.pull_timeout_s, self.loads)  # prefill/decode loads that pull first (hkvd.shim.pd)
        self._gpu: GpuOrdering | None = None  # when the KV caches are on a GPU
        self._meta: HkvdConnectorMetadata | None = None
        self._step_began = time.monotonic()  # when this step's metadata was bound (before its forward)
        # load_settles: steps that waited for a load about to end (_settle); _won: ones that got it.
        # stored_bytes: the bytes the daemon copied out of this worker's KV cache (stores and step-event offers).
        self.stats = {"stores": 0, "stores_failed": 0, "step_events": 0, "fence_waits": 0, "fence_timeouts": 0,
                      "state_copy_waits": 0, "state_copy_timeouts": 0,
                      "stored_bytes": 0, "load_settles": 0, "load_settles_won": 0, "load_settle_seconds": 0.0,
                      "boundary_verifies": 0}
        # In-step loads: the daemons' pools this process maps, and the copies from them (hkvd.shim.pool_reads).
        self.in_step = InStepLoads(self.timeline, self._layout_for_copies)
        self.verify = VerifyTally()  # sampled checks' results (Verify replies), for vLLM's connector stats

    # ---- registration --------------------------------------------------------------------------
    def _configs(self) -> tuple[VllmConfig, KVCacheConfig]:
        if self._vllm_config is None or self._kv_cache_config is None:
            raise RuntimeError("hkvd worker: built without vLLM's configs, so it cannot register KV caches")
        return self._vllm_config, self._kv_cache_config

    def _spec(self) -> EngineSpec:
        vllm_config, kv_cache_config = self._configs()
        return build_engine_spec(vllm_config, kv_cache_config, self.cfg, regions=self._regions,
                                 layer_addr=lambda name: self._layer_addr[name])

    def _connected(self, client: DaemonClient) -> None:
        """Before registering: let the daemon attach to this process, and map its pool when it offers it to a
        host engine that asks for in-step loads (the registration then names the pool mapped)."""
        if client.daemon_pid:
            allow_ptracer(int(client.daemon_pid))
        if self.cfg.in_step_loads and client.pool and self._regions and self._gpu is None:
            client.mapped_pool = self.in_step.maps.map(int(client.daemon_pid), client.server_id, client.pool)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register every layer's KV memory: each tensor is checked against the place ``KVCacheConfig`` and
        the resolved layout give it (``hkvd.shim.kv_views``); a mismatch raises ``ValueError`` with the fix."""

        vllm_config, kv_cache_config = self._configs()
        layout = resolved_layout(vllm_config, kv_cache_config)
        where = {name: (t, g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups for name in g.layer_names
                 for t in kv_cache_config.kv_cache_tensors if name in t.layers}
        tensors = {name: (t[0] if isinstance(t, list | tuple) else t) for name, t in kv_caches.items()
                   if name in where}
        device_types = {t.device.type for t in tensors.values()}
        if device_types - {"cpu", "cuda"} or len(device_types) > 1:
            raise ValueError(f"hkvd: KV caches on {sorted(device_types)}; hkvd registers either host (CPU) or "
                             "CUDA KV caches, one kind per engine. Remove the hkvd kv_transfer_config for others.")
        export: Callable[[int, torch.Tensor], Region] | None = None  # None: host memory, the storage's address here
        if device_types == {"cuda"}:

            export = export_tensor
            self._gpu = GpuOrdering(one_device(tensors))
        region_of: dict[int, int] = {}
        num_blocks = int(kv_cache_config.num_blocks)
        for name, tensor in tensors.items():
            kvt, spec = where[name]
            place = config_place(name, spec, layout, kvt, num_blocks)
            offset, pieces = check_layer_tensor(name, tensor, place, spec, layout, kvt, num_blocks)
            storage = tensor.untyped_storage()
            base = storage.data_ptr()
            if base not in region_of:
                # Aliased layers (vLLM packs every group into one int8 buffer) share a region.
                rid = region_of[base] = len(self._regions)
                self._regions.append(export(rid, tensor) if export is not None else
                                     Region(region_id=rid, kind="host", size=int(storage.nbytes()), addr=int(base)))
            self._layer_addr[name] = (region_of[base], offset, pieces)
        logger.info("hkvd worker: %d KV layers in %d region(s) (%.1f GiB, layout %s)", len(self._layer_addr),
                    len(self._regions), sum(r.size for r in self._regions) / 2**30, layout)
        self._ensure(startup=True)

    def _ensure(self, startup: bool = False) -> DaemonClient | None:
        if not self._regions:
            return None
        client = self.link.ensure(startup=startup)
        if client is not None and self.link.generation != self._gen:
            self._gen = self.link.generation
            self._seq = 0
            self._forget_jobs()
        return client

    def _forget_jobs(self) -> None:
        """The connection that owned them is gone: they failed (the daemon dropped them too)."""
        self._jobs.clear()
        self._req_jobs.clear()
        self._confirmable.clear()
        self._pd.forget("the daemon connection was lost")
        self.loads.forget("the daemon connection was lost")

    def _lost(self, exc: BaseException) -> None:
        self.link.lost(exc)
        self._forget_jobs()

    # ---- completions ---------------------------------------------------------------------------
    def _pump(self, timeout_s: float = 0.0) -> None:
        client = self.link.client
        if client is None:
            return
        try:
            done = client.poll(timeout_s)
        except Exception as e:
            self._lost(e)
            return
        self._absorb(done)
        if not client.connected:
            self._lost(ConnectionError("connection lost"))

    def _absorb(self, completions: Iterable[Completion]) -> None:

        lost: BaseException | None = None
        for c in completions:
            if (self._pd.in_flight and self._pd.absorb(c, self.link.client)) or self.loads.absorb(c):
                continue
            job = self._jobs.pop(c.req_id, None)
            if job is None:
                continue
            for r in job.reqs:
                s = self._req_jobs.get(r)
                if s is not None:
                    s.discard(c.req_id)
            if job.kind == "verify":  # never a store's failure, never the link's unless it is down
                if c.ok:
                    self.verify.result(",".join(job.reqs), c.get(VerifyResult), job.group_kind)
                else:
                    self.verify.failed(",".join(job.reqs), c.error)
                    if isinstance(c.error, DaemonUnavailable):
                        lost = c.error
                continue
            if c.ok:
                if job.kind == "step":
                    self._confirmable.append(c.req_id)
                    self.stats["stored_bytes"] += c.get(StepResult).nbytes  # the offers' copy (0 if none ran)
                else:
                    self.stats["stores"] += 1
                    self.stats["stored_bytes"] += c.get(StoreResult).nbytes
            else:
                self.stats["stores_failed"] += 1
                logger.debug("hkvd: %s job %d failed: %s", job.kind, c.req_id, c.error)
                if isinstance(c.error, DaemonUnavailable):
                    lost = c.error
        if lost is not None:
            self._lost(lost)

    def _loaded(self, loaded: RetrieveResult) -> None:
        if self._gpu is not None and loaded.event:
            # Before the load is reported: the forward that reads the blocks runs in a later step
            # on this stream, after the daemon's copy.
            self._gpu.wait_loaded(loaded.event)

    def _track(self, rid: int, job: _Job) -> None:
        self._jobs[rid] = job
        for r in job.reqs:
            self._req_jobs.setdefault(r, set()).add(rid)

    # ---- per step ------------------------------------------------------------------------------
    def bind(self, meta: HkvdConnectorMetadata) -> None:
        self._meta = meta
        self._step_began = time.monotonic()
        self.timeline.step = meta.step
        self._finishing.update(meta.delayed_free)

    def handle_preemptions(self, meta: HkvdConnectorMetadata) -> None:
        """Fence the step's new blocks, then copy the Mamba/GDN states of its in-step loads into them: align
        mode's ``preprocess_mamba`` copies a hit's state onward right after this hook. Their attention blocks
        follow in ``start_load_kv``: in between, vLLM zeroes the attention blocks a synchronous load got
        (hybrid models), and only an asynchronous load's are spared (``skip_zeroing_group_ids``)."""
        self.timeline.step = meta.step  # vLLM calls this before it binds the step's metadata
        self._pump()
        self._await_state_copies(meta.step)
        self._fence(meta)
        if any(job.places is not None for job in meta.loads):
            self.in_step.copy(meta.loads, states=True)

    def _fence(self, meta: HkvdConnectorMetadata) -> None:
        if not meta.fence_blocks or not self._jobs:
            return
        hit = [rid for rid, j in self._jobs.items() if j.blocks & meta.fence_blocks]
        if not hit:
            return
        client = self.link.client
        if client is None:
            return
        self.stats["fence_waits"] += 1
        try:
            self._absorb(client.wait(hit, self.cfg.fence_timeout_s).values())
        except Exception as e:

            if not isinstance(e, KVTimeout):
                self._lost(e)
                return
            # Still copying from blocks vLLM is about to reuse: abort, never confirm, never
            # count them as stored. The daemon drops an aborted or unconfirmed copy.
            self.stats["fence_timeouts"] += 1
            logger.warning("hkvd: %d copies still running after %.1f s at a block reuse; dropping them",
                           len(hit), self.cfg.fence_timeout_s)
            for rid in hit:
                job = self._jobs.pop(rid, None)
                if job is None:
                    continue
                for r in job.reqs:
                    self._req_jobs.get(r, set()).discard(rid)
                try:
                    client.abort(rid)
                except Exception as e2:
                    self._lost(e2)
                    return

    def _await_state_copies(self, step: int) -> None:
        """Wait for the offers' copies of step ``step - 2`` and earlier: the daemon drops a state whose copy
        has not ended when the engine reports step s + 2 (``COPY_DEADLINE_STEPS``), and this step's event
        reports ``step``. Only a daemon that falls two steps behind costs the engine this wait; a lost state
        costs a later request its hit (the stored prefix ends at the state before it)."""
        client = self.link.client
        late = [rid for rid, j in self._jobs.items()
                if j.kind == "step" and j.blocks and not j.awaited and j.step <= step - COPY_DEADLINE_STEPS]
        if client is None or not late:
            return
        for rid in late:
            self._jobs[rid].awaited = True
        self.stats["state_copy_waits"] += 1
        try:
            self._absorb(client.wait(late, self.cfg.state_copy_wait_s).values())
        except KVTimeout:
            # Left running: the daemon drops them once this step is reported, and ignores their confirms.
            self.stats["state_copy_timeouts"] += 1
            logger.warning("hkvd: %d state copies still running after %.1f s, two steps after their offer; "
                           "the daemon drops them (a later prompt hits less of that prefix)", len(late),
                           self.cfg.state_copy_wait_s)
        except Exception as e:
            self._lost(e)

    def _layout_for_copies(self) -> tuple[dict[int, GroupSpec], dict[int, Region], int]:
        """This rank's groups, regions and rank, as registered (for in-step copies)."""
        spec = self._spec()
        return {g.group_id: g for g in spec.groups}, {r.region_id: r for r in self._regions}, spec.rank

    def start_load_kv(self) -> None:
        """Submit the step's loads and return: their replies end them (``hkvd.shim.loads``).

        vLLM calls this after the forward for asynchronous loads. On CPU engines the forward's
        threads hold every core, so a copy submitted before it would wait for its end anyway.
        In-step loads are copied here (their attention blocks; their states went in ``handle_preemptions``):
        vLLM calls this before the forward in a step with synchronous loads."""
        meta = self._meta
        if meta is None or not meta.loads:
            return
        if any(job.places is not None for job in meta.loads):
            self.in_step.copy(meta.loads, states=False)  # before the forward: vLLM calls this first for sync loads
        client = self._ensure()
        for job in meta.loads:
            if job.places is not None:
                continue
            if client is None:
                self.loads.fail(job, "the daemon is unavailable")
                continue
            try:
                if job.pull is not None:
                    self._pd.start(client, job)
                elif not job.items:
                    self.loads.fail(job, "the load plan was refused (null block in it)")
                else:
                    self.loads.start(client, job, job.lease_id)
                    self.timeline.note(job.req_id, "load_issued")
            except Exception as e:
                if job.pull is None:  # PullLoads.start reports its own failure
                    self.loads.fail(job, f"could not submit it: {e}")
                self._lost(e)
                client = None

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        self._pump()  # notices a dead connection, so _ensure() reconnects before submitting
        client = self._ensure()
        if client is None:
            return
        try:
            # GPU: the daemon's stream waits for the end of this step's forward before reading.
            copies = meta.stores or meta.offers or meta.verifies or meta.boundary_verifies
            event = self._gpu.step_end_event() if self._gpu is not None and copies else b""
            pins = bool(self.link.ack is not None and self.link.ack.pins)  # an older daemon takes no tenant
            ends = bool(self.link.ack is not None and self.link.ack.turn_ends)  # nor turn-end offsets
            tiers = bool(self.link.ack is not None and self.link.ack.request_tiers)  # nor store tiers
            for sj in meta.stores:
                rid = client.submit_store(sj.items, wait_event=event, notes=sj.notes,
                                          tenant=sj.tenant if pins else "", turn_end=sj.turn_end if ends else 0,
                                          skip_tiers=sj.skip_tiers if tiers else 0)
                self._track(rid, _Job("store", item_blocks(sj.items), {sj.req_id}))
            for vj in meta.verifies:  # sampled hits (hkvd.shim.verify): where their stores would have gone
                rid = client.submit_verify(vj.items, wait_event=event)
                self._track(rid, _Job("verify", item_blocks(vj.items), {vj.req_id}, vj.kind))
            offers = [it for _, it in meta.offers]
            checks = [it for _, it in meta.boundary_verifies]
            # Each offered state's tenant, to a daemon that takes them (an older one counts them all as "").
            tenants = ([meta.offer_tenants.get(r, "") for r, _ in meta.offers]
                       if meta.offer_tenants and self.link.ack is not None and self.link.ack.step_tenants else [])
            # And the tiers each one's store tiers leave out, to a daemon that takes them.
            skips = [meta.offer_skips.get(r, 0) for r, _ in meta.offers] if meta.offer_skips and tiers else []
            confirms, self._confirmable = self._confirmable, []
            self._seq += 1
            rid = client.submit_step_event(self._seq, meta.step, offers, confirms,
                                           wait_event=event if offers or checks else b"", notes=meta.offer_notes,
                                           verifies=checks, tenants=tenants, skip_tiers=skips)
            self._track(rid, _Job("step", item_blocks(offers) | item_blocks(checks),
                                  {r for r, _ in meta.offers} | {r for r, _ in meta.boundary_verifies},
                                  step=meta.step))
            self.stats["boundary_verifies"] += len(checks)
            self.stats["step_events"] += 1
        except Exception as e:
            self._lost(e)
            return
        self._pump()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._pump()
        if not self._finishing:
            return None, None
        ready = {r for r in self._finishing if not self._req_jobs.get(r)}
        self._finishing -= ready
        for r in ready:
            self._req_jobs.pop(r, None)
        return (ready or None), None

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving): every load of the step is
        reported finished once, done or failed; a failed one is in both receiving sets."""
        sending, _ = self.get_finished(finished_req_ids)
        if self._pd.in_flight:
            self._pd.expire(self.link.client)
        if self.loads.in_flight:
            self._settle()
            self.loads.expire(self.link.client)
        recved, failed = self.loads.take()
        self.timeline.flush()  # once per step: get_transfer_results ends every step of the worker
        return set(sending or ()), recved, failed

    def _settle(self) -> None:
        """Wait a little for loads about to end (``ShimConfig.load_settle_fraction``): reported now,
        their requests run in the next step instead of the one after."""
        now = time.monotonic()
        budget = min(self.cfg.load_settle_max_s, self.cfg.load_settle_fraction * (now - self._step_began))
        deadline = now + budget
        if budget <= 0 or not self.loads.due_within(budget):
            return
        self.stats["load_settles"] += 1
        done = self.loads.stats["loads_ok"] + self.loads.stats["loads_failed"]
        while self.loads.in_flight and self.link.client is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.loads.due_within(left):
                break
            self._pump(left)
        self.stats["load_settle_seconds"] += time.monotonic() - now
        if self.loads.stats["loads_ok"] + self.loads.stats["loads_failed"] > done:
            self.stats["load_settles_won"] += 1

    def transfer_totals(self) -> dict[str, float]:
        """What this worker moved since it started (``hkvd.shim.connector_stats``: vLLM's connector stats are
        the differences between two calls): loads that succeeded and failed, their bytes and seconds, the
        bytes stored, and the end-of-step waits for loads (``_settle``)."""
        loads = self.loads.stats
        return {"loads_ok": loads["loads_ok"], "loads_failed": loads["loads_failed"],
                "loaded_bytes": loads["loaded_bytes"] + self.in_step.stats["in_step_bytes"],
                "load_seconds": loads["load_seconds"],
                "stored_bytes": self.stats["stored_bytes"], "load_settles_won": self.stats["load_settles_won"],
                "load_settle_seconds": self.stats["load_settle_seconds"],
                "in_step_loads": self.in_step.stats["in_step_loads"],
                "verify_boundary_states": self.stats["boundary_verifies"], **self.verify.totals}

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of in-step loads that could not be copied (a bug; ``InStepLoads.copy``). Every other failed
        load is reported per request (``get_transfer_results``)."""
        return self.in_step.take_errors()

    def shutdown(self) -> None:
        self.link.close()
        self.in_step.maps.close()
        self.timeline.close()
        if self._gpu is not None:
            self._gpu.close()
