# SPDX-License-Identifier: Apache-2.0
"""The shim's configuration: ``kv_connector_extra_config`` parsed once, for both connector halves.

Defaults match ``hkvd serve``'s. An unknown key, a value of the wrong type or an impossible one
is a ``ValueError`` naming the key, raised while vLLM starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from hkvd.transport.paths import default_socket_path


@dataclass(frozen=True, slots=True)
class ShimConfig:
    """``kv_connector_extra_config`` keys (all optional)."""

    socket_path: str = ""  # "" -> hkvd.transport.paths.default_socket_path(), as `hkvd serve`
    # Tokens per chunk: a multiple of vLLM's block size N. 0 = auto: N, the granularity of vLLM's own
    # prefix cache. A larger chunk means fewer, larger entries but rounds every hit down to its
    # multiple: a 950-token prompt (N=128, chunk 256) leaves [768, 896) to vLLM alone, and for
    # Mamba/GDN models, whose states exist only at block boundaries and (with vLLM's default
    # retention) only at the last one before the prompt's end, about half of the prompts miss.
    chunk_size: int = 0
    connect_timeout_s: float = 5.0  # connect + register, and every blocking client call
    # A lookup is submitted when the request arrives (on_new_request); the scheduler then waits for the
    # reply before answering "ask again" (None), which costs the request a whole step of the running
    # batch. The wait is the larger of lookup_wait_s and lookup_wait_fraction of the engine's longest recent
    # step (from one scheduling to the next), at most lookup_wait_max_s, and the waits of one scheduling
    # share that budget: every running request waits with it. A UDS round trip is ~0.1 ms, so 2 ms
    # answers on the first call wherever the daemon has a core; long steps (CPU engines, long
    # prefills), where the daemon may wait for a core, buy a longer wait. 0: lookup_wait_s alone.
    lookup_wait_s: float = 0.002
    lookup_wait_fraction: float = 0.05
    lookup_wait_max_s: float = 0.025
    lookup_timeout_s: float = 2.0  # a lookup still unanswered after this is a miss
    # A load (its request waits, the other requests keep stepping) not done after this is
    # aborted; the request then waits for the daemon to end the copy, and loads or recomputes.
    load_timeout_s: float = 30.0
    # A load whose reply is read after the step's forward has ended is reported with the next step,
    # and vLLM runs its request a step later: a whole step of every running request. At the end of a
    # step the worker waits for a load expected to end soon (by its blocks and the engine's past
    # loads), at most this fraction of the step's time so far and at most load_settle_max_s: the
    # running requests' step is that much longer, the loaded request runs a step earlier. 0: never.
    load_settle_fraction: float = 0.2
    load_settle_max_s: float = 0.010
    # The scheduler side watches each load's lease and reports the load finished as soon as the
    # daemon says every rank's copy is in (host KV caches). Under vLLM's async scheduling a step's
    # output is read after the next step has run, so a worker's report reaches the scheduler a step
    # later than this one. False: only the workers report loads.
    early_load_reports: bool = True
    # In-step loads (hkvd.shim.pool_reads): a host engine that maps its daemon's pool copies a leased hit from
    # the pool itself, before the forward of the step that plans it (vLLM's synchronous load: no step waits).
    # Only while at least in_step_lease_margin of the lease's time is left; otherwise, and for GPU KV caches,
    # prefill/decode pulls and hits the daemon does not place, the load is a Retrieve a step later.
    in_step_loads: bool = False
    in_step_lease_margin: float = 0.5
    fence_timeout_s: float = 10.0  # waiting for a copy out of a block about to be reused
    # Waiting, before a step's forward, for the Mamba/SWA state copies offered two steps earlier: the daemon
    # drops a state whose copy has not ended when the engine reports that step (docs/design.md,
    # "Step-ordered snapshots"). The engine stalls only while its daemon is two steps behind.
    state_copy_wait_s: float = 2.0
    reconnect_interval_s: float = 5.0
    # vLLM's default "fail" turns a failed load into a failed request; a cache should recompute.
    load_failure_policy: Literal["recompute", "fail"] = "recompute"  # vLLM's kv_load_failure_policy values
    require_daemon: bool = False  # True: vLLM's startup fails when the daemon is unreachable
    # Prefill/decode pairs (hkvd.shim.pd). Producer: the HOST:PORT of its daemon's peer listener put in
    # kv_transfer_params ("" = ask the daemon: its --peer-advertise or --peer-listen). Consumer: the
    # budget of one pull + load (the request waits in WAITING_FOR_REMOTE_KVS meanwhile).
    peer_address: str = ""
    pull_timeout_s: float = 30.0
    # Store the chunks that fill while the engine generates (their attention KV, sliding-window
    # blocks and the Mamba states vLLM offers there), under keys that continue the prompt's, so a
    # chat's next turn (prompt + answer + new message) also hits the answer. False: prompt chunks only.
    # "auto": stored unless the model's chat template drops an earlier answer's thinking part from the
    # next prompt (a reasoning model's: those chunks can never hit; hkvd.shim.decode_stores). A request
    # may decide for itself: kv_transfer_params={"hkvd": {"store_decode": false}} (or true).
    store_decode: bool | Literal["auto"] = "auto"
    # With partial chunks (vLLM's prefix_match_unit below its block size, a Mamba model in align mode): store
    # each finished request's state after its last computed token, and probe there in later lookups, so a
    # chat's next turn resumes where the previous one ended (docs/design.md, "Hit granularity"). No effect
    # without partial chunks. False: only the positions vLLM checkpoints.
    turn_end_states: bool = True
    # Sampled verification (docs/verification.md): this fraction of the requests with an hkvd hit is
    # computed by the engine instead of loaded, and the chunks it computes are sent to the daemon to
    # compare with the entries under their keys. 0: off; 1: every hit. Which requests: a hash of
    # verify_seed and the request id (hkvd.shim.verify.sampled), so the same id is always treated alike.
    verify_fraction: float = 0.01
    verify_seed: int = 0
    # Per-request timeline (hkvd.shim.timeline, docs/design.md "Timeline"): every process of the engine appends
    # one JSON line per event of each request (arrival, lookup, scheduling, load, first forward, finish) to
    # this file, written once per step. "" (the default): off, and free.
    timeline_path: str = ""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ShimConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"hkvd: unknown kv_connector_extra_config keys {unknown}; known keys: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default: Any = known[name].default
            if name == "timeline_path" and not isinstance(value, str):  # str(None) would name a file "None"
                raise ValueError(f"hkvd: kv_connector_extra_config['timeline_path']={value!r} is not a path "
                                 "(a string; \"\" = no timeline)")
            if name == "store_decode":
                values[name] = _store_decode(value)
                continue
            try:
                values[name] = _to_bool(value) if isinstance(default, bool) else type(default)(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"hkvd: kv_connector_extra_config[{name!r}]={value!r} is not a {type(default).__name__}"
                ) from None
        cfg = cls(**values)
        if not cfg.socket_path:
            cfg = _replace(cfg, socket_path=default_socket_path())
        if cfg.timeline_path:
            _check_timeline_path(cfg.timeline_path)
        if cfg.chunk_size < 0:
            raise ValueError("hkvd: chunk_size must be >= 0 (0 = vLLM's block size N)")
        if cfg.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("hkvd: load_failure_policy must be 'recompute' or 'fail'")
        if not 0.0 <= cfg.load_settle_fraction <= 1.0:
            raise ValueError("hkvd: load_settle_fraction must be in [0, 1] (0 = never wait for a load)")
        if not 0.0 <= cfg.verify_fraction <= 1.0:  # NaN fails too
            raise ValueError(f"hkvd: verify_fraction={cfg.verify_fraction!r} must be in [0, 1] (0 = no sampled "
                             "verification, 0.01 = one hit in a hundred, 1 = every hit)")
        if not 0.0 <= cfg.in_step_lease_margin < 1.0:
            raise ValueError(f"hkvd: in_step_lease_margin={cfg.in_step_lease_margin!r} must be in [0, 1): the "
                             "fraction of a lease's time that must be left to load its hit in the step (0.5)")
        if not 0.0 <= cfg.lookup_wait_fraction <= 1.0:
            raise ValueError("hkvd: lookup_wait_fraction must be in [0, 1] (0 = wait lookup_wait_s only)")
        for name in ("load_settle_max_s", "lookup_wait_s", "lookup_wait_max_s"):
            if not getattr(cfg, name) >= 0:  # NaN fails too
                raise ValueError(f"hkvd: {name} must be >= 0 seconds")
        for name in ("connect_timeout_s", "lookup_timeout_s", "load_timeout_s", "fence_timeout_s",
                     "state_copy_wait_s", "reconnect_interval_s"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"hkvd: {name} must be > 0 seconds")
        return cfg


def _check_timeline_path(path: str) -> None:
    """A timeline file every process of the engine can append to: not a folder, in a writable folder."""
    if os.path.isdir(path):
        raise ValueError(f"hkvd: timeline_path {path!r} is a folder; name a file (the engine's processes append "
                         "JSON lines to it)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"hkvd: timeline_path {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"hkvd: timeline_path {path!r} is not writable by this process")


def _store_decode(v: object) -> bool | Literal["auto"]:
    """``store_decode``: a bool (or "true"/"false", "1"/"0", "yes"/"no", "on"/"off"), or "auto"."""
    if isinstance(v, bool) or v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        word = v.strip().lower()
        if word == "auto":
            return "auto"
        if word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return _to_bool(word)
    raise ValueError(f"hkvd: kv_connector_extra_config['store_decode']={v!r} is not true, false or \"auto\" (auto: "
                     "stored unless the model's chat template drops an earlier answer's thinking part)")


def _to_bool(v: object) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _replace(cfg: ShimConfig, **changes: Any) -> ShimConfig:
    return dataclasses.replace(cfg, **changes)
