# SPDX-License-Identifier: Apache-2.0
"""What hkvd served, in vLLM's own metrics: the connector's ``KVConnectorStats`` and its Prometheus counters.

Role
    vLLM 0.32 calls ``get_kv_connector_stats()`` on each worker's connector after every step that ran a
    model (``KVConnectorModelRunnerMixin``): the stats of the interval since the previous call, or None
    when there are none. ``StatsReporter.take`` turns the worker's running totals
    (``WorkerSide.transfer_totals``) into that: the difference from the totals of its previous call, as
    an ``HkvdConnectorStats`` (None when nothing moved). vLLM sums the workers' stats
    (``aggregate``, ``KVOutputAggregator``) and hands the plain ``data`` dict to the front end, which
    rebuilds it with ``HkvdConnector.build_kv_connector_stats``; there:

    - the log line ("KV Transfer metrics: ...") is ``reduce()`` of the stats aggregated over the
      logging interval;
    - ``HkvdPromMetrics`` (``HkvdConnector.build_prom_metrics``) adds each interval's stats to
      counters on vLLM's /metrics, labelled like vLLM's own (``model_name``, ``engine``):
      ``vllm:hkvd_loads_total{outcome="ok"|"failed"}``, ``vllm:hkvd_loaded_bytes_total``,
      ``vllm:hkvd_load_seconds_total`` and ``vllm:hkvd_stored_bytes_total``.

    Under tensor parallelism every rank loads and stores its own shard: the sums count each rank's
    loads, and the bytes of every rank.

Fields (``FIELDS``)
    ``loads_ok``, ``loads_failed``: loads reported to vLLM as finished, or as failed (it recomputes);
    ``loaded_bytes``: the bytes of the loads that succeeded; ``load_seconds``: their time from the
    Retrieve's submission to the daemon's reply being read, summed; ``stored_bytes``: the bytes the
    daemon copied out of the worker's KV cache (stores and Mamba step-event offers).

    Sampled verification (``verify_fraction``, ``hkvd.shim.verify``): ``verify_sampled`` (scheduler side):
    requests with a hit computed instead of loaded; ``verifies`` and ``verifies_failed``:
    Verify requests answered, or answered with an error (counted and logged, the request unaffected);
    ``verify_checks``, ``verify_matches``, ``verify_divergences``, ``verify_missing``: entries, as the
    daemon's ``VerifyResult`` counts them; ``verify_boundary_states``: Mamba states sent in step events
    (compared by the daemon once confirmed, counted there); ``verify_max_error``: the largest difference
    any reply reported, and ``verify_max_error_full``/``_swa`` the largest per group kind (each Verify
    holds one kind): running maxima (``MAX_FIELDS``: sent as is, combined by max), on /metrics as the
    gauge ``vllm:hkvd_verify_max_error{kind="all"|"full"|"swa"}``.

    Decode chunks not stored (scheduler side, ``hkvd.shim.decode_stores``): ``decode_chunks_not_stored_<reason>`` and
    ``decode_bytes_not_stored_<reason>``, reason ``template``, ``request`` or ``config``; on /metrics as
    ``vllm:hkvd_decode_chunks_not_stored_total{reason}`` and ``vllm:hkvd_decode_bytes_not_stored_total{reason}``.

    Session pins (scheduler side, docs/agents.md): ``pins_sent``: finished requests whose chunks were pinned (a
    ``Pin`` sent to the daemon); ``pins_refused``: requests whose ``kv_transfer_params`` asked for a pin in a shape
    the shim refused (each ran unpinned, with a warning).

    What costs a request scheduling steps: ``lookups_deferred`` (scheduler side): times a waiting
    request was passed over in a step because its lookup's reply had not come within the scheduler's
    lookup wait (``lookup_wait_fraction``); ``load_settles_won``: loads reported in the step that started
    them, or a later one, thanks to the end-of-step wait (``load_settle_fraction``), which took
    ``load_settle_seconds`` in all; ``loads_reported_early`` (scheduler side): loads it reported
    once the daemon said every rank's copy was in, before any worker did (``early_load_reports``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from hkvd.shim.decode_stores import REASONS as DECODE_REASONS
from hkvd.shim.decode_stores import STAT_NAMES as DECODE_FIELDS

if TYPE_CHECKING:  # vLLM's types, for annotations only
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

FIELDS = ("loads_ok", "loads_failed", "loaded_bytes", "load_seconds", "stored_bytes",
          "lookups_deferred", "load_settles_won", "load_settle_seconds", "loads_reported_early",
          "verify_sampled", "verifies", "verifies_failed", "verify_checks", "verify_matches", "verify_divergences",
          "verify_missing", "verify_boundary_states",
          "verify_max_error", "verify_max_error_full", "verify_max_error_swa", "pins_sent", "pins_refused",
          "in_step_loads", "tiers_refused", *DECODE_FIELDS)
# Fields that are a running maximum, not a sum: reported as is, combined by max (every other field by sum).
MAX_FIELDS = frozenset({"verify_max_error", "verify_max_error_full", "verify_max_error_swa"})


@dataclass
class HkvdConnectorStats(KVConnectorStats):
    """One interval's (or the sum of several intervals' and workers') ``FIELDS``, in ``data``."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s fields into these (another worker's, or a later interval's); returns self."""
        for k, v in other.data.items():
            self.data[k] = max(self.data.get(k, 0), v) if k in MAX_FIELDS else self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        ok = int(d.get("loads_ok", 0))
        out: dict[str, int | float] = {"loads_ok": ok, "loads_failed": int(d.get("loads_failed", 0)),
                "loaded_MiB": round(d.get("loaded_bytes", 0) / 2**20, 3),
                "avg_load_ms": round(d.get("load_seconds", 0) / ok * 1e3, 3) if ok else 0.0,
                "stored_MiB": round(d.get("stored_bytes", 0) / 2**20, 3),
                "lookups_deferred": int(d.get("lookups_deferred", 0)),
                "load_settles_won": int(d.get("load_settles_won", 0)),
                "loads_reported_early": int(d.get("loads_reported_early", 0))}
        if d.get("in_step_loads", 0):
            out["in_step_loads"] = int(d["in_step_loads"])
        if d.get("verify_sampled", 0) or d.get("verifies", 0) or d.get("verifies_failed", 0):  # only when some ran
            out.update({k: int(d.get(k, 0)) for k in ("verify_sampled", "verify_checks", "verify_matches",
                                                      "verify_divergences", "verify_missing", "verifies_failed")})
            out.update({k: float(d.get(k, 0.0)) for k in sorted(MAX_FIELDS)})
        if d.get("pins_sent", 0) or d.get("pins_refused", 0):
            out.update({k: int(d.get(k, 0)) for k in ("pins_sent", "pins_refused")})
        not_stored = sum(int(d.get(f"decode_bytes_not_stored_{r}", 0)) for r in DECODE_REASONS)
        if not_stored:
            out["decode_not_stored_MiB"] = round(not_stored / 2**20, 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in MAX_FIELDS)


class StatsReporter:
    """A worker's totals -> the stats since the previous ``take`` (see the module docstring)."""

    def __init__(self) -> None:
        self._reported: dict[str, float] = dict.fromkeys(FIELDS, 0)

    def take(self, totals: Mapping[str, float]) -> HkvdConnectorStats | None:
        delta = {k: totals.get(k, 0) - self._reported[k] for k in FIELDS if k not in MAX_FIELDS}
        self._reported = {k: totals.get(k, 0) for k in FIELDS}
        if not any(delta.values()):
            return None
        # A running maximum goes as is: the maximum over intervals is the maximum so far.
        return HkvdConnectorStats(data={**delta, **{k: totals.get(k, 0) for k in MAX_FIELDS}})


COUNTERS = {  # FIELDS but the loads' outcomes -> vLLM's /metrics counter (vllm:hkvd_<name>_total), its help
    "loaded_bytes": "Bytes loaded from hkvd into the KV cache (every rank's)",
    "load_seconds": "Seconds of the loads from hkvd that succeeded, submission to reply, summed",
    "stored_bytes": "Bytes hkvd copied out of the KV cache (stores and Mamba states; every rank's)",
    "lookups_deferred": "Steps a waiting request was passed over because its lookup's reply had not come "
                        "within the scheduler's wait (lookup_wait_fraction of a step)",
    "load_settles_won": "Loads reported a step earlier thanks to the end-of-step wait (load_settle_fraction)",
    "load_settle_seconds": "Seconds the worker waited at steps' ends for loads about to end",
    "loads_reported_early": "Loads the scheduler reported once hkvd said every rank's copy was in, before any "
                            "worker read its reply (early_load_reports)",
    "in_step_loads": "Hits the engine copied from hkvd's pool before the forward of the step that planned them "
                     "(in_step_loads; counted by every rank)",
    "verify_sampled": "Requests with an hkvd hit computed instead of loaded, to be checked (verify_fraction)",
    "verifies": "Sampled hits' Verify requests hkvd answered",
    "verifies_failed": "Sampled hits' Verify requests that got an error (nothing compared; the request is unaffected)",
    "verify_checks": "Entries hkvd compared with a sampled hit's recomputed chunks",
    "verify_matches": "Compared entries within their group kind's tolerance",
    "verify_divergences": "Compared entries past their group kind's tolerance",
    "verify_missing": "Entries of a sampled hit hkvd no longer held (not compared)",
    "verify_boundary_states": "Recomputed Mamba boundary states sent for comparison in step events",
    "pins_sent": "Finished requests whose chunks were pinned for their session (a Pin sent to hkvd)",
    "pins_refused": "Requests whose kv_transfer_params asked for a pin in a shape refused (run unpinned, warned)",
    "tiers_refused": "Requests whose kv_transfer_params kv_load_tiers or kv_store_tiers could not be read (they "
                     "used every tier, warned)",
}


class HkvdPromMetrics(KVConnectorPromMetrics):
    """The stats as counters on vLLM's /metrics (``vllm:hkvd_*``), per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls  # prometheus_client.Counter or vLLM's subclass of it
        self._loads = counter(name="vllm:hkvd_loads", documentation="Loads from hkvd, by outcome (ok; failed: "
                              "recomputed)", labelnames=[*labelnames, "outcome"])
        self._bytes = {name: counter(name=f"vllm:hkvd_{name}", labelnames=labelnames, documentation=doc)
                       for name, doc in COUNTERS.items()}
        gauge: Any = self._gauge_cls
        self._max_error = gauge(name="vllm:hkvd_verify_max_error", documentation="The largest difference a "
                                "sampled check found, per group kind (hkvd's tolerance units)",
                                labelnames=[*labelnames, "kind"])
        self._max_seen: dict[tuple[int, str], float] = {}
        self._not_stored = {
            what: counter(name=f"vllm:hkvd_decode_{what}_not_stored", labelnames=[*labelnames, "reason"],
                          documentation=f"{doc} not stored by hkvd, by reason (template: the model's chat template "
                          "drops an earlier answer's thinking part; request: its kv_transfer_params said so; config: "
                          "store_decode false)")
            for what, doc in (("chunks", "Chunks a request generated"),
                              ("bytes", "Bytes of the entries of the chunks requests generated"))}
        for labels in per_engine_labelvalues.values():  # every series from 0, before the first load
            for outcome in ("ok", "failed"):
                self._loads.labels(*labels, outcome)
            for c in self._bytes.values():
                c.labels(*labels)
            for c in self._not_stored.values():
                for reason in DECODE_REASONS:
                    c.labels(*labels, reason)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        labels = self.per_engine_labelvalues[engine_idx]
        for outcome in ("ok", "failed"):
            if n := transfer_stats_data.get(f"loads_{outcome}", 0):
                self._loads.labels(*labels, outcome).inc(n)
        for name, c in self._bytes.items():
            if v := transfer_stats_data.get(name, 0):
                c.labels(*labels).inc(v)
        for what, c in self._not_stored.items():
            for reason in DECODE_REASONS:
                if v := transfer_stats_data.get(f"decode_{what}_not_stored_{reason}", 0):
                    c.labels(*labels, reason).inc(v)
        for name in MAX_FIELDS:
            kind = name.removeprefix("verify_max_error").lstrip("_") or "all"
            v = float(transfer_stats_data.get(name, 0.0))
            if v > self._max_seen.get((engine_idx, kind), 0.0):
                self._max_seen[(engine_idx, kind)] = v
                self._max_error.labels(*labels, kind).set(v)
