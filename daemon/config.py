"""Daemon configuration: one frozen dataclass, built from flags and an optional TOML file.

How a user writes each value (flag, TOML key, parser, help) is declared once, in
``hkvd.daemon.options``; this module holds the values and checks them together.

Units are in the names (``_bytes``, ``_s``). Every value is validated here, at start-up, with a
message that says what is wrong and what to write instead: a bad flag must never surface later as
an odd failure under load.
"""

from __future__ import annotations

import dataclasses
import grp
from dataclasses import dataclass, field
from typing import Any

from hkvd.daemon.cache import ADMISSIONS, MIN_SUPERBLOCK_BYTES, POLICIES
from hkvd.daemon.heap import DEFAULT_FREEZE_EVERY
from hkvd.daemon.peers.auth import PeerConfigError, parse_allow, split_address
from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.paths import default_socket_path
from hkvd.transport.wire.control import check_tenant

GIB = 1 << 30
EVICTION_POLICIES = POLICIES  # lru, hybrid, cost (daemon/cache/eviction.py)
ADMISSION_POLICIES = ADMISSIONS  # none, tinylfu (daemon/cache/admission.py)
HUGEPAGE_MODES = ("auto", "require", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(StartupError, ValueError):
    """A configuration value is invalid; the message names the fix."""

    exit_code = 2


COPY_ENGINES = ("host", "cuda")
CUDA_COPY_METHODS = ("auto", "memcpy", "kernel")  # hkvd.cuda.copy.METHODS (kept import-free here)
EVENT_LOOPS = ("uvloop", "asyncio")
CLUSTER_PROTOCOLS = ("tcp", "rdma")
ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


# Addresses that mean "every interface" to bind(), and nothing a peer can connect to.
_UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    socket_path: str = field(default_factory=default_socket_path)
    chunk_size: int = 256  # tokens; LMCache's default, and a multiple of every common block size
    l1_size_bytes: int = 1 * GIB
    eviction_policy: str = "lru"
    admission: str = "none"  # none (every store admitted) or tinylfu (daemon/cache/admission.py)
    pin_max_fraction: float = 0.5  # the share of the pool session pins may hold (daemon/cache/pins.py)
    tenant_quota: float = 1.0  # each tenant's share of the pool; 1.0: no quotas (daemon/cache/quotas.py)
    tenant_quotas: tuple[tuple[str, float], ...] = ()  # (label, fraction) overrides of tenant_quota
    hugepages: str = "auto"
    log_level: str = "info"
    lease_ttl_s: float = 30.0
    max_frame_bytes: int = 16 << 20
    socket_mode: int = 0o660
    socket_group: str = ""  # empty: the daemon's own group
    allowed_uids: tuple[int, ...] = ()  # empty: the daemon's own uid (and root)
    copy_threads: int = 2
    copy_engine: str = "host"  # host (process_vm_readv/writev) or cuda (CUDA IPC; hkvd[gpu])
    cuda_copy_method: str = "auto"  # auto, memcpy (DMA copy engines) or kernel (SMs); hkvd.cuda.copy
    cuda_pin_chunk_gib: int = 512  # the pool's pinned registrations, at most this many GiB each (hkvd.cuda.hostreg)
    event_loop: str = "uvloop"  # uvloop (a dependency) or asyncio (the standard library's loop)
    # In-step loads (docs/security.md): host engines may map the pool read-only (HelloAck.pool) and copy leased
    # hits themselves (LookupReply.places); off: every hit is a Retrieve. Read at start-up (not reloadable).
    in_step_loads: bool = True
    # Entries across tensor-parallel sizes (daemon/engines/reshards.py): an engine world reads another TP size's
    # entries of its model (attention, GDN states), re-sharded, locally and from peers; off: only its own world's.
    tp_reshard: bool = True
    mamba_checkpoint_interval: int = 1
    # Sampled hits recomputed and compared (daemon/integrity/compare.py, quarantine.py; docs/verification.md)
    verify_tolerance: float = 0.25  # full and swa entries: ||fresh - stored|| / ||stored|| (integrity/compare.py)
    verify_mamba_tolerance: float = 0.3  # Mamba/GDN states (recurrent states drift more under another chunking)
    quarantine_after: int = 3  # divergences of one (fingerprint, group) within quarantine_window_s
    quarantine_window_s: float = 600.0
    shutdown_timeout_s: float = 10.0
    io_timeout_s: float = 10.0
    superblock_bytes: int = 0  # 0: derived from the pool size (daemon/cache/pool.py); else a multiple of 2 MiB
    prefault_threads: int = 0  # 0: min(cores, 8) (daemon/cache/prefault.py)
    numa_node: int = -1  # -1: no binding; else mbind the pool to this node (daemon/cache/backing.py)
    metrics_port: int = 0  # 0 = no metrics endpoint
    metrics_host: str = "127.0.0.1"  # where the metrics port listens
    l2_path: str = ""  # empty: no disk tier
    l2_size_bytes: int = 0  # the disk tier's cap; required with l2_path
    # Cluster tier (daemon/tiers/cluster.py): entries shared by every node through Mooncake Store.
    cluster: str = ""  # mooncake://MASTER_HOST:PORT; empty: no cluster tier
    cluster_segment_bytes: int = GIB  # memory this node contributes to the cluster
    cluster_protocol: str = "tcp"  # tcp or rdma
    cluster_devices: str = ""  # RDMA device names (cluster_protocol rdma), e.g. "mlx5_0,mlx5_1"
    cluster_local_host: str = ""  # the address other nodes reach this one at; empty: the route to the master
    cluster_replicas: int = 1  # copies of each value on distinct nodes (2: survives one node leaving)
    cluster_lookup_timeout_ms: float = 200.0  # one lookup's wait on the cluster (existence check + reads)
    cluster_key_file: str = ""  # the fleet key (daemon/tiers/cluster_value.py); required with cluster unless insecure
    cluster_accept_key_file: str = ""  # a second key accepted on reads during a key change
    cluster_insecure: bool = False  # no fleet key: values sealed with a public key
    # Peer links (daemon/peers/links.py): serve leased entries to decode daemons, pull from prefill ones.
    peer_listen: str = ""  # HOST:PORT for peer daemons; empty: serve no peers
    peer_advertise: str = ""  # HOST:PORT engines hand to decode engines; default: peer_listen
    peer_token: str = field(default="", repr=False)  # prefer peer_token_file or $HKVD_PEER_TOKEN
    peer_token_file: str = ""
    peer_allow: tuple[str, ...] = ()  # addresses / CIDRs that may connect; empty: loopback only
    peer_timeout_s: float = 10.0  # connect, handshake, each control request
    peer_pull_timeout_s: float = 20.0  # a whole pull (also capped below the serving lease's TTL)
    # Open peer connections (daemon/peers/serving.py). A pulling daemon holds one link per layout, so 16
    # from one address covers a node of 8 engines with a link being replaced; the total is also held
    # to a quarter of the open-file limit, so idle peers never take the engines' descriptors.
    peer_max_connections: int = 128
    peer_max_connections_per_address: int = 16
    gc_freeze_every: int = DEFAULT_FREEZE_EVERY  # entries written between gc.freeze() calls (daemon/heap.py); 0 = off
    scrub_rate_mb: int = 256  # MB/s the scrubber re-hashes pool entries at (daemon/integrity/scrub.py); 0 = off
    # KV events (docs/routing.md): vLLM's ZMQ publisher protocol, node-wide; empty = not published.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_buffer: int = 10_000  # batches kept for replay and for engines' polls
    kv_events_topic: str = ""  # "{model}" becomes the engine's model name

    def __post_init__(self) -> None:
        self.validate()

    @property
    def copy_timeout_s(self) -> float:
        """How long one copy may take: io_timeout_s, but never under 30 s (a large batch is slow)."""
        return max(self.io_timeout_s, 30.0)

    def validate(self) -> None:
        if not self.socket_path:
            raise ConfigError("--socket must be a path, e.g. /run/hkvd/hkvd.sock")
        if self.chunk_size <= 0 or self.chunk_size % 16:
            raise ConfigError(f"--chunk-size {self.chunk_size}: must be a positive multiple of 16 tokens; "
                              "use the vLLM block size N the engine logs (or a multiple of it)")
        if self.superblock_bytes < 0 or self.superblock_bytes % MIN_SUPERBLOCK_BYTES:
            raise ConfigError(f"superblock_bytes {self.superblock_bytes}: must be 0 (derived from --l1-size-gb) "
                              "or a multiple of 2 MiB")
        smallest_pool = self.superblock_bytes or MIN_SUPERBLOCK_BYTES
        if self.l1_size_bytes < smallest_pool:
            raise ConfigError(f"--l1-size-gb {self.l1_size_bytes / GIB:g}: the pool must hold at least one "
                              f"{smallest_pool >> 20} MiB superblock; use --l1-size-gb {smallest_pool / GIB!r} "
                              "or more (an engine whose one chunk needs more is refused at registration, with "
                              "the size it needs)")
        if not 0 <= self.prefault_threads <= 256:
            raise ConfigError(f"--prefault-threads {self.prefault_threads}: must be 0 (min(cores, 8)) to 256")
        if self.numa_node < -1:
            raise ConfigError(f"--numa-node {self.numa_node}: a node number (0, 1, ...); leave it unset for no binding")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"--eviction-policy {self.eviction_policy!r}: choose one of "
                              f"{', '.join(EVICTION_POLICIES)} (lru: least recently used; hybrid: orphans first, "
                              "then lru; cost: orphans first, then the least recompute cost per byte and use; "
                              "docs/design.md \"What is kept\")")
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(f"--admission {self.admission!r}: choose one of {', '.join(ADMISSION_POLICIES)} (none: "
                              "every store may evict; tinylfu: a store may not evict an entry asked for more often; "
                              "docs/design.md \"What is kept\")")
        if self.hugepages not in HUGEPAGE_MODES:
            raise ConfigError(f"--hugepages {self.hugepages!r}: choose one of {HUGEPAGE_MODES}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose one of {LOG_LEVELS}")
        for name in ("lease_ttl_s", "shutdown_timeout_s", "io_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds")
        if self.copy_engine not in COPY_ENGINES:
            raise ConfigError(f"--copy-engine {self.copy_engine!r}: choose one of {COPY_ENGINES} (host for "
                              "engines whose KV cache is in CPU memory, cuda for GPU KV caches)")
        if self.cuda_copy_method not in CUDA_COPY_METHODS:
            raise ConfigError(f"--cuda-copy-method {self.cuda_copy_method!r}: choose one of {CUDA_COPY_METHODS} "
                              "(auto moves KV pages on the GPU's copy engines, docs/gpu.md)")
        if not 1 <= self.cuda_pin_chunk_gib <= 512:
            raise ConfigError(f"--cuda-pin-chunk-gib {self.cuda_pin_chunk_gib}: choose 1 to 512 (GiB in one "
                              "cudaHostRegister; R580+ drivers refuse more than 512)")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"--event-loop {self.event_loop!r}: choose one of {EVENT_LOOPS}")
        if not 1 <= self.copy_threads <= 64:
            raise ConfigError("--copy-threads must be between 1 and 64")
        if self.gc_freeze_every < 0:
            raise ConfigError(f"--gc-freeze-every {self.gc_freeze_every}: must be >= 0 (entries written between "
                              "freezes of the heap; 0 leaves Python's collector as it is)")
        if self.mamba_checkpoint_interval < 1:
            raise ConfigError("--mamba-checkpoint-interval must be >= 1 (1 keeps every boundary state)")
        if not 0 <= self.scrub_rate_mb <= 100_000:
            raise ConfigError(f"--scrub-rate-mb {self.scrub_rate_mb}: choose 0 (no scrubber) to 100000 MB/s")
        for name in ("verify_tolerance", "verify_mamba_tolerance", "quarantine_window_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: must be > 0")
        if not 0 < self.pin_max_fraction <= 1:
            raise ConfigError(f"--pin-max-fraction {self.pin_max_fraction!r}: the share of the pool session pins "
                              "may hold, more than 0 and at most 1 (e.g. 0.5)")
        if not 0 < self.tenant_quota <= 1:
            raise ConfigError(f"--tenant-quota {self.tenant_quota!r}: each tenant's share of the pool, more than 0 "
                              "and at most 1 (1.0: no quotas)")
        seen: set[str] = set()
        for label, fraction in self.tenant_quotas:
            try:
                check_tenant(label, "tenant label")
            except ProtocolViolation as e:
                raise ConfigError(f"tenant-quotas {label[:40]!r}: {e} (labels are \"\" for the unsalted share, "
                                  "salt:<hex> or lora:<adapter name>)") from None
            if label in seen:
                raise ConfigError(f"tenant-quotas: {label!r} is given twice; keep one")
            seen.add(label)
            if not 0 < fraction <= 1:
                raise ConfigError(f"tenant-quotas {label!r} = {fraction!r}: a share of the pool, more than 0 and at "
                                  "most 1 (e.g. 0.25)")
        if self.quarantine_after < 1:
            raise ConfigError(f"--quarantine-after {self.quarantine_after}: must be >= 1 (divergences within "
                              "--quarantine-window-s that quarantine a fingerprint and group)")
        if not 1 << 12 <= self.max_frame_bytes <= 1 << 30:
            raise ConfigError("max_frame_bytes must be between 4 KiB and 1 GiB")
        for name in ("peer_timeout_s", "peer_pull_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds")
        for name in ("peer_max_connections", "peer_max_connections_per_address"):
            if not 1 <= getattr(self, name) <= 1 << 16:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be between 1 and 65536")
        if self.peer_listen or self.peer_advertise or self.peer_allow:

            try:
                if self.peer_listen:
                    host, port = split_address(self.peer_listen, "--peer-listen")
                    if not self.peer_advertise and host in _UNSPECIFIED_HOSTS:
                        raise ConfigError(
                            f"--peer-listen {self.peer_listen} listens on every address, but decode engines "
                            f"cannot connect to {host}; also set --peer-advertise HOST:{port} with this node's "
                            "address on the decode nodes' network")
                if self.peer_advertise:
                    host, _ = split_address(self.peer_advertise, "--peer-advertise")
                    if host in _UNSPECIFIED_HOSTS:
                        raise ConfigError(f"--peer-advertise {self.peer_advertise}: decode engines cannot connect "
                                          f"to {host}; advertise this node's address on their network")
                parse_allow(self.peer_allow)
            except PeerConfigError as e:
                raise ConfigError(str(e)) from None
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError("--metrics-port must be 0 (off) or a TCP port")
        if not self.metrics_host or len(self.metrics_host) > 255 or any(c.isspace() for c in self.metrics_host):
            raise ConfigError(f"--metrics-host {self.metrics_host!r}: give one address (127.0.0.1, ::1, 0.0.0.0) or "
                              "host name")
        if self.l2_path and self.l2_size_bytes <= 0:
            raise ConfigError(f"--l2-path {self.l2_path}: also set --l2-size-gb, the most disk the tier may use "
                              "(e.g. --l2-size-gb 100)")
        if self.cluster and not self.cluster.startswith("mooncake://"):
            raise ConfigError(f"--cluster {self.cluster!r}: expected mooncake://MASTER_HOST:PORT (the "
                              "mooncake_master's port)")
        if self.cluster and not self.cluster_key_file and not self.cluster_insecure:
            raise ConfigError(f"--cluster {self.cluster}: also set --cluster-key-file PATH, the fleet key every node "
                              "shares (e.g. `openssl rand -hex 32 > /etc/hkvd/cluster.key && chmod 600 "
                              "/etc/hkvd/cluster.key`, copied to every node): without it any host that reaches "
                              "the Mooncake master can write values this node serves as KV. --cluster-insecure "
                              "runs without one, on a network only the fleet reaches (docs/cluster.md)")
        if not self.cluster and (self.cluster_key_file or self.cluster_accept_key_file or self.cluster_insecure):
            raise ConfigError("--cluster-key-file, --cluster-accept-key-file and --cluster-insecure need --cluster "
                              "mooncake://MASTER_HOST:PORT; set it, or drop them")
        if self.cluster_accept_key_file and not self.cluster_key_file:
            raise ConfigError("--cluster-accept-key-file needs --cluster-key-file (the key values are sealed with); "
                              "see docs/cluster.md, \"Changing the fleet key\"")
        if self.cluster_protocol not in CLUSTER_PROTOCOLS:
            raise ConfigError(f"--cluster-protocol {self.cluster_protocol!r}: choose one of {CLUSTER_PROTOCOLS}")
        if not 1 <= self.cluster_replicas <= 8:
            raise ConfigError(f"--cluster-replicas {self.cluster_replicas}: must be 1 to 8 (copies on distinct nodes)")
        if self.cluster_lookup_timeout_ms <= 0:
            raise ConfigError(f"--cluster-lookup-timeout-ms {self.cluster_lookup_timeout_ms:g}: must be > 0 (e.g. "
                              "200: how long a lookup waits on the cluster)")
        for flag, endpoint in (("--kv-events-endpoint", self.kv_events_endpoint),
                               ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint)):
            if endpoint and not endpoint.startswith(ZMQ_TRANSPORTS):
                raise ConfigError(f"{flag} {endpoint!r}: expected a ZMQ endpoint to bind, e.g. tcp://127.0.0.1:5557 "
                                  "(tcp://*:5557 for other hosts) or ipc:///run/hkvd/kv-events")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint (the events it replays); set "
                              "it, or drop the replay endpoint")
        if self.kv_events_replay_endpoint and self.kv_events_replay_endpoint == self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint must differ from --kv-events-endpoint")
        if not 1 <= self.kv_events_buffer <= 1 << 20:
            raise ConfigError(f"--kv-events-buffer {self.kv_events_buffer}: must be 1 to 1048576 batches")
        if len(self.kv_events_topic) > 256:
            raise ConfigError("--kv-events-topic: at most 256 characters")
        if self.l2_size_bytes and not self.l2_path:
            raise ConfigError("--l2-size-gb needs --l2-path DIR (the disk tier's directory); set it, or drop "
                              "--l2-size-gb")
        if self.socket_group:
            try:
                grp.getgrnam(self.socket_group)
            except KeyError:
                raise ConfigError(f"--socket-group {self.socket_group!r}: no such group; create it "
                                  "(groupadd) or leave it empty for the daemon's own group") from None

    def replace(self, **changes: Any) -> DaemonConfig:
        return dataclasses.replace(self, **changes)


class ConfigCell:
    """The running config, held in one place. Event loop only.

    The daemon builds one at start-up and hands it to the components that read reloadable values
    (``RELOADABLE`` in ``daemon/app.py``: the service reads ``lease_ttl_s`` per lookup); they read
    ``current`` at each use instead of keeping a copy. SIGHUP's reload ``swap``s in a whole new
    ``DaemonConfig`` (still frozen): one assignment on the loop, so a reader sees the old config or
    the new one, never a mix. Values read once at start-up (sockets, sizes) are not reloadable.
    """

    __slots__ = ("current",)

    def __init__(self, cfg: DaemonConfig) -> None:
        self.current = cfg

    def swap(self, new: DaemonConfig) -> DaemonConfig:
        """Make ``new`` the running config; return the one it replaced."""
        old, self.current = self.current, new
        return old
