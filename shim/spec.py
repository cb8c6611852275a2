# SPDX-License-Identifier: Apache-2.0
"""Shim configuration, the ``EngineSpec`` built from vLLM objects, and the daemon link.

Role
    Both halves of the connector (scheduler side in EngineCore, worker side per rank) need
    the same three things, kept here so they cannot drift apart:

    - ``ShimConfig``: ``kv_connector_extra_config`` parsed once, defaults matching
      ``hkvd serve``'s defaults.
    - ``build_groups`` / ``build_engine_spec``: our ``GroupSpec``/``View`` table from
      ``KVCacheConfig``. The scheduler side has no tensors, so it describes views from
      ``KVCacheConfig.kv_cache_tensors``; the worker side passes the measured address of every
      layer. Both emit one view per layer in ``group.layer_names`` order, so the format part
      (kind, tokens per block, window, dtype, (num_layers, page_bytes) per view) and hence the
      daemon's layout fingerprint are identical on both sides.
    - ``DaemonLink``: one ``DaemonClient`` plus the "daemon is down" policy: recompute, log a
      single warning per outage, retry the connection every ``reconnect_interval_s`` and
      register again on its own.

Threading model
    Everything here is called from vLLM's own threads (scheduler loop, worker execute loop).
    ``DaemonLink`` is not thread-safe; each connector half owns one. Nothing blocks except
    ``DaemonLink.ensure()`` (connect + register, bounded by ``connect_timeout_s``), which runs
    at most once per ``reconnect_interval_s`` while the daemon is down.

Errors
    Validation problems that a restart with other flags fixes (``ValueError`` from
    ``validate_vllm``, ``RegistrationError`` from the daemon) propagate so vLLM's startup
    fails with the fix in the message. Connectivity problems never propagate: the link goes
    down and the engine recomputes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from hkvd.shim.client import DaemonClient
from hkvd.shim.identity import engine_identity
from hkvd.transport.errors import KVError, RegistrationError
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.paths import default_socket_path
from hkvd.transport.wire.control import EngineSpec

logger = logging.getLogger("hkvd.shim")

# The sizes a chunk may take are checked by the daemon; the shim only needs vLLM's side.
_KIND_FULL, _KIND_SWA, _KIND_MAMBA = "full", "swa", "mamba"


@dataclass(frozen=True, slots=True)
class ShimConfig:
    """``kv_connector_extra_config`` keys (all optional)."""

    socket_path: str = ""  # "" -> hkvd.transport.paths.default_socket_path(), as `hkvd serve`
    # Tokens per chunk. 0 = auto: vLLM's block size N for models with Mamba/GDN layers, else the
    # daemon's --chunk-size. Mamba states exist only at block boundaries and, with vLLM's default
    # retention, only at the last one before the prompt's end, so any chunk larger than N makes
    # about half of the prompts miss (601 tokens, N=128: 512 is a 256-multiple; 900: 896 is not).
    chunk_size: int = 0
    connect_timeout_s: float = 5.0  # connect + register, and every blocking client call
    # A lookup is submitted when the request arrives (on_new_request); the scheduler then
    # waits at most this long for the reply before answering "ask again" (None). A UDS round
    # trip is ~0.1 ms, so 2 ms almost always answers on the first call.
    lookup_wait_s: float = 0.002
    lookup_timeout_s: float = 2.0  # a lookup still unanswered after this is a miss
    load_timeout_s: float = 30.0  # sync loads block the step at most this long, then recompute
    fence_timeout_s: float = 10.0  # waiting for a copy out of a block about to be reused
    reconnect_interval_s: float = 5.0
    # vLLM's default "fail" turns a failed load into a failed request; a cache should recompute.
    load_failure_policy: str = "recompute"
    require_daemon: bool = False  # True: vLLM's startup fails when the daemon is unreachable
    # Prefill/decode pairs (hkvd.shim.pd). Producer: the HOST:PORT of its daemon's peer listener put in
    # kv_transfer_params ("" = ask the daemon: its --peer-advertise or --peer-listen). Consumer: the
    # budget of one pull + load (the request waits in WAITING_FOR_REMOTE_KVS meanwhile).
    peer_address: str = ""
    pull_timeout_s: float = 30.0

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
            try:
                values[name] = _to_bool(value) if isinstance(default, bool) else type(default)(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"hkvd: kv_connector_extra_config[{name!r}]={value!r} is not a {type(default).__name__}"
                ) from None
        cfg = cls(**values)
        if not cfg.socket_path:
            cfg = _replace(cfg, socket_path=default_socket_path())
        if cfg.chunk_size < 0:
            raise ValueError("hkvd: chunk_size must be >= 0 (0 = the daemon's --chunk-size)")
        if cfg.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("hkvd: load_failure_policy must be 'recompute' or 'fail'")
        for name in ("connect_timeout_s", "lookup_timeout_s", "load_timeout_s", "fence_timeout_s",
                     "reconnect_interval_s"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"hkvd: {name} must be > 0 seconds")
        return cfg


def _to_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _replace(cfg: ShimConfig, **changes: Any) -> ShimConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


# --------------------------------------------------------------------------- vLLM -> EngineSpec


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What the scheduler needs to turn a block table into items, per KV-cache group."""

    group_id: int
    kind: str  # full | swa | mamba
    block_size: int  # tokens per block
    window_tokens: int  # swa only, else 0


def _dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.")


def group_infos(kv_cache_config: Any) -> list[GroupInfo]:
    """Classify vLLM's KV-cache groups; raise (with the fix) on kinds hkvd cannot cache."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        if isinstance(s, MambaSpec):
            out.append(GroupInfo(gid, _KIND_MAMBA, s.block_size, 0))
        elif isinstance(s, SlidingWindowSpec):
            out.append(GroupInfo(gid, _KIND_SWA, s.block_size, int(s.sliding_window)))
        elif isinstance(s, FullAttentionSpec):
            # With the hybrid manager off, vLLM marks SWA layers as FullAttentionSpec with a
            # sliding_window; their blocks are all kept, so "full" is exact for them too.
            out.append(GroupInfo(gid, _KIND_FULL, s.block_size, 0))
        else:
            raise ValueError(
                f"hkvd: KV-cache group {gid} ({type(s).__name__}, layers {g.layer_names[:3]}...) is not a "
                "kind hkvd caches (full attention, sliding window, Mamba/GDN). Remove the hkvd "
                "kv_transfer_config for this model."
            )
    return out


def _page_and_dtype(spec: Any) -> tuple[int, str]:
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec):
        # The real state bytes only: the padding up to the attention page size is never read.
        shapes = ";".join(f"{_dtype_name(d)}{list(s)}" for s, d in zip(spec.shapes, spec.dtypes, strict=True))
        return int(spec.real_page_size_bytes), f"state:{shapes}"
    return int(spec.real_page_size_bytes), _dtype_name(spec.dtype)


LayerAddr = Callable[[str], tuple[int, int]]  # layer name -> (region_id, byte offset in region)


def build_groups(kv_cache_config: Any, layer_addr: LayerAddr | None = None) -> list[Any]:
    """Our ``GroupSpec`` list: one ``View`` per layer, in ``group.layer_names`` order.

    ``layer_addr=None`` (scheduler side) places layer l of a ``KVCacheTensor`` at
    ``offset + l * layer_stride`` of region 0: only the format matters for a lookup-only
    registration. The worker passes the measured (region, offset) of each layer.
    """

    placement: dict[str, tuple[int, int]] = {}  # layer -> (offset from the config, block_stride)
    for t in kv_cache_config.kv_cache_tensors:
        for idx, name in enumerate(t.layers):
            placement.setdefault(name, (t.offset + idx * t.layer_stride, t.block_stride))
    infos = group_infos(kv_cache_config)
    groups = []
    for info, g in zip(infos, kv_cache_config.kv_cache_groups, strict=True):
        page_bytes, dtype = _page_and_dtype(g.kv_cache_spec)
        views = []
        for name in g.layer_names:
            if name not in placement:
                raise ValueError(f"hkvd: layer {name} of group {info.group_id} has no KVCacheTensor")
            cfg_offset, block_stride = placement[name]
            region_id, offset = layer_addr(name) if layer_addr else (0, cfg_offset)
            views.append(View(region_id, offset, 1, block_stride * kv_cache_config.num_blocks,
                              block_stride, page_bytes))
        groups.append(GroupSpec(
            group_id=info.group_id, kind=info.kind, tokens_per_block=info.block_size,
            window_tokens=info.window_tokens, num_blocks=int(kv_cache_config.num_blocks), dtype=dtype,
            views=tuple(views),
        ))
    return groups


def validate_vllm(vllm_config: Any, kv_cache_config: Any, cfg: ShimConfig) -> None:
    """Checks on vLLM's own settings that make hkvd useless or wrong; raise with the fix."""
    infos = group_infos(kv_cache_config)
    cache = vllm_config.cache_config
    has_mamba = any(i.kind == _KIND_MAMBA for i in infos)
    if has_mamba and (not cache.enable_prefix_caching or getattr(cache, "mamba_cache_mode", "none") != "align"):
        raise ValueError(
            "hkvd: this model has Mamba/GDN layers; hkvd stores their states only in vLLM's align "
            "mode. Start vLLM with --enable-prefix-caching --mamba-cache-mode align."
        )
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp > 1:
        raise ValueError(
            f"hkvd: pipeline_parallel_size={pp} is not supported (each stage holds other layers, and hkvd "
            "keys entries per tensor-parallel rank only). Serve with pipeline_parallel_size=1 (tensor "
            "parallelism is supported), or remove the hkvd kv_transfer_config."
        )
    block = int(cache.block_size)
    if cfg.chunk_size and cfg.chunk_size % block:
        raise ValueError(
            f"hkvd: chunk_size {cfg.chunk_size} is not a multiple of vLLM's block size N={block}; "
            f"set kv_connector_extra_config chunk_size (and hkvd serve --chunk-size) to {block} or a "
            "multiple of it."
        )
    for i in infos:
        if i.block_size != block:
            raise ValueError(
                f"hkvd: group {i.group_id} uses block size {i.block_size}, not the unified {block}; "
                "hkvd needs one block size across groups (keep the hybrid KV-cache manager on)."
            )


def effective_chunk_size(vllm_config: Any, kv_cache_config: Any, cfg: ShimConfig) -> int:
    """The chunk size the shim asks for (0 = the daemon's default); see ``ShimConfig.chunk_size``."""
    if cfg.chunk_size:
        return cfg.chunk_size
    if any(i.kind == _KIND_MAMBA for i in group_infos(kv_cache_config)):
        return int(vllm_config.cache_config.block_size)
    return 0


def layout_tag(kv_cache_config: Any) -> str:
    from vllm.platforms import current_platform

    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    return f"{current_platform.device_type}/{layout}"


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (tests driving the worker half directly): single rank
        return 0


def build_engine_spec(
    vllm_config: Any, kv_cache_config: Any, cfg: ShimConfig, *, regions: list[Any], layer_addr: LayerAddr | None,
) -> Any:

    par = vllm_config.parallel_config
    return EngineSpec(
        model=str(vllm_config.model_config.model),
        world_size=int(par.world_size),
        # The scheduler looks up with rank 0's format; each worker registers its own rank.
        rank=_worker_rank() if layer_addr else 0,
        layout_tag=layout_tag(kv_cache_config),
        chunk_size=effective_chunk_size(vllm_config, kv_cache_config, cfg),
        block_size=int(vllm_config.cache_config.block_size),
        max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        mamba_cache_mode=str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none")),
        regions=regions,
        groups=build_groups(kv_cache_config, layer_addr),
        identity=engine_identity(vllm_config),
    )


# --------------------------------------------------------------------------- daemon link


class DaemonLink:
    """A ``DaemonClient`` that is either up (registered) or down (recompute, retry later).

    ``ensure()`` returns the registered client or None; it reconnects at most once per
    ``reconnect_interval_s``. ``lost(exc)`` marks the link down after a transport error. One
    WARNING per outage, one INFO when it comes back; ``generation`` increases on every
    registration so callers can drop state (leases, job ids, step seq) tied to a dead one.
    """

    def __init__(self, cfg: ShimConfig, role: str, name: str, spec_fn: Callable[[], Any],
                 on_connected: Callable[[Any], None] | None = None) -> None:
        self.cfg = cfg
        self.role = role
        self.name = name
        self._spec_fn = spec_fn
        self._on_connected = on_connected
        self.client: Any = None
        self.ack: Any = None
        self.generation = 0
        self._next_try = 0.0
        self._warned = False

    @property
    def up(self) -> bool:
        return self.client is not None

    def ensure(self, *, startup: bool = False) -> Any:
        if self.client is not None:
            return self.client
        now = time.monotonic()
        if now < self._next_try and not startup:
            return None
        self._next_try = now + self.cfg.reconnect_interval_s

        client = DaemonClient(self.cfg.socket_path, client_name=self.name, role=self.role,
                              timeout_s=self.cfg.connect_timeout_s)
        try:
            client.connect()
            if self._on_connected is not None:
                self._on_connected(client)
            ack = client.register(self._spec_fn())
        except RegistrationError as e:
            _close_quietly(client)
            if startup:
                raise  # a configuration problem: vLLM's startup must fail with the fix
            # A daemon restarted with other settings: keep serving (recompute), say why once.
            if not self._warned:
                logger.error("hkvd %s: the daemon at %s refused registration: %s", self.role,
                             self.cfg.socket_path, e)
            self._warned = True
            return None
        except (KVError, OSError, TimeoutError) as e:
            _close_quietly(client)
            if startup and self.cfg.require_daemon:
                raise RuntimeError(
                    f"hkvd: daemon unreachable at {self.cfg.socket_path} ({e}); start it with "
                    f"`hkvd serve --socket {self.cfg.socket_path}` or set require_daemon=false"
                ) from e
            self._warn_down(e)
            return None
        self.client, self.ack = client, ack
        self.generation += 1
        if self._warned:
            logger.info("hkvd %s: daemon back at %s (engine %s); caching resumes", self.role,
                        self.cfg.socket_path, getattr(ack, "engine_id", "?"))
        else:
            logger.info("hkvd %s: registered with daemon at %s (engine %s, chunk %s tokens)", self.role,
                        self.cfg.socket_path, getattr(ack, "engine_id", "?"), getattr(ack, "chunk_size", "?"))
        self._warned = False
        return client

    def lost(self, exc: BaseException) -> None:
        if self.client is None:
            return
        _close_quietly(self.client)
        self.client = None
        self.ack = None
        # Try again at the next call: a restarted daemon is usually listening already. Only a
        # failed attempt backs off for reconnect_interval_s.
        self._next_try = 0.0
        self._warn_down(exc)

    def close(self) -> None:
        if self.client is not None:
            _close_quietly(self.client)
            self.client = None

    def _warn_down(self, exc: BaseException) -> None:
        if self._warned:
            logger.debug("hkvd %s: daemon still unreachable: %s", self.role, exc)
            return
        self._warned = True
        logger.warning(
            "hkvd %s: daemon at %s unavailable (%s); serving without the external cache (recompute), "
            "retrying every %.1f s", self.role, self.cfg.socket_path, exc, self.cfg.reconnect_interval_s)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # close() must never turn an outage into a crash
        logger.debug("hkvd: client close failed", exc_info=True)
