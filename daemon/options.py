"""Every ``hkvd serve`` option, declared once: flag, TOML key, parser, default as shown, and help.

Role
    ``DaemonConfig`` holds the values and validates them together; this table says how a user
    writes each one. The flags of ``hkvd serve``, the keys ``--config`` accepts, the flag tables
    in README.md and docs/configuration.md and the example ``packaging/hkvd.toml`` are all
    generated from it (``python -m hkvd.daemon.options --write`` rewrites the files;
    tests/unit/test_options.py fails when any of them drifts).

Contracts
    - ``Option.key`` is the flag without its dashes: the TOML key (dashes or underscores).
    - ``Option.parse`` turns a flag string or a TOML value into the field's value, raising
      ``ConfigError`` (or ``ValueError``/``TypeError``, reported with the flag) on bad input.
    - ``Option.default`` is the default as a user reads it; where it is a value, ``parse`` of it
      equals ``DaemonConfig``'s default (checked by the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hkvd.daemon.config import GIB, ConfigError, DaemonConfig


def _gib(flag: str, example: str) -> Callable[[Any], int]:
    """A size given in GiB (``flag`` and ``example`` name it in errors)."""

    def convert(v: Any) -> int:
        try:
            gb = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} {v!r}: expected a number of GiB, e.g. {example} or 0.5") from None
        if gb <= 0:
            raise ConfigError(f"{flag} {v!r}: must be > 0")
        return int(gb * GIB)

    return convert


def _lower(v: object) -> str:
    return str(v).lower()


def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise ConfigError(f"{v!r}: expected true or false")


def _on_off(flag: str) -> Callable[[Any], bool]:
    """A switch written on or off (a TOML boolean also reads)."""

    def convert(v: Any) -> bool:
        if isinstance(v, bool):
            return v
        text = str(v).strip().lower()
        if text not in ("on", "off"):
            raise ConfigError(f"{flag} {v!r}: expected on or off")
        return text == "on"

    return convert


def _octal(v: object) -> int:
    return int(str(v), 8)


def _uids(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in (v.split(",") if isinstance(v, str) else v))


def _quotas(v: object) -> tuple[tuple[str, float], ...]:
    """Per-tenant quotas: a TOML table (``"salt:ab12" = 0.25``) or a flag's ``LABEL=FRACTION,...``."""
    if isinstance(v, str):
        pairs = []
        for part in (p.strip() for p in v.split(",")):
            if not part:
                continue
            label, eq, fraction = part.rpartition("=")
            if not eq:
                raise ValueError(f"{part!r} is not LABEL=FRACTION (e.g. salt:ab12=0.25, or =0.5 for the unsalted "
                                 "share)")
            pairs.append((label.strip(), float(fraction)))
        return tuple(pairs)
    if isinstance(v, dict):
        if not all(isinstance(f, int | float) and not isinstance(f, bool) for f in v.values()):
            raise ValueError("each tenant's quota is a fraction of the pool, e.g. \"salt:ab12\" = 0.25")
        return tuple((str(label), float(f)) for label, f in v.items())
    raise ValueError("expected a table of tenant labels to fractions, e.g. tenant-quotas = { \"lora:sql\" = 0.25 }")


def _addresses(v: Any) -> tuple[str, ...]:
    return tuple(str(x).strip() for x in (v.split(",") if isinstance(v, str) else v) if str(x).strip())


@dataclass(frozen=True, slots=True)
class Option:
    flag: str  # "--chunk-size"
    field: str  # the DaemonConfig field it sets
    parse: Callable[[Any], object]
    default: str  # as a user reads it; a parseable value, or words ("off", "see --socket")
    help: str
    metavar: str = ""  # how the value reads in the tables ("N", "PATH"); "" for words like auto/off
    example: str = ""  # TOML value for packaging/hkvd.toml (a TOML literal); "" = the default, commented out
    essential: bool = False  # listed in README's short table (every option is in docs/configuration.md)
    in_toml: bool = True  # False: a flag only (secrets belong in a file, not in the config)
    active: bool = False  # set (not commented out) in packaging/hkvd.toml
    switch: bool = False  # a flag without a value (it sets "true"); a TOML boolean

    @property
    def key(self) -> str:
        return self.flag[2:]


OPTIONS: tuple[Option, ...] = (
    Option("--socket", "socket_path", str, "see meaning",
           "control socket path, created 0660 ($XDG_RUNTIME_DIR/hkvd/hkvd.sock, or /run/hkvd/hkvd.sock as root)",
           "PATH", '"/run/hkvd/hkvd.sock"', essential=True, active=True),
    Option("--chunk-size", "chunk_size", int, "256",
           "tokens per chunk of engines that register none; the vLLM shim registers vLLM's block size N "
           "(or its chunk_size setting)", "N", "256",
           essential=True),
    Option("--l1-size-gb", "l1_size_bytes", _gib("--l1-size-gb", "4"), "1",
           "pool size in GiB; any mix of entry sizes of 32 KiB or more fills at least 7/8 of it, less one "
           "superblock (1/64 of the pool, 2-32 MiB) per size; an engine whose one chunk does not fit is "
           "refused at registration with the smallest size that does", "X", "1", essential=True),
    Option("--eviction-policy", "eviction_policy", _lower, "lru",
           "lru; hybrid: orphan-aware LRU (docs/hybrid.md); or cost: orphans first, then the entry of least "
           "recompute cost per byte and use (docs/design.md, What is kept)", example='"lru"'),
    Option("--admission", "admission", _lower, "none",
           "none (every store may evict), or tinylfu: a store that must evict is refused where the entry it would "
           "evict was asked for more often (counted, never an error to the engine; docs/design.md, What is kept)",
           example='"none"'),
    Option("--pin-max-fraction", "pin_max_fraction", float, "0.5",
           "the share of the pool session pins may hold (docs/pins.md); past it the oldest pins lapse first", "X"),
    Option("--tenant-quota", "tenant_quota", float, "1.0",
           "each tenant's share of the pool (a cache_salt, or a LoRA adapter; docs/pins.md): a tenant over it "
           "evicts its own entries first, and none takes another's within its quota; 1.0 = no quotas", "X"),
    Option("--tenant-quotas", "tenant_quotas", _quotas, "",
           "per-tenant quotas over --tenant-quota: LABEL=FRACTION,... (a TOML table in the config)", "LIST",
           '{ "salt:ab12" = 0.25 }'),
    Option("--hugepages", "hugepages", _lower, "auto",
           "auto (hugetlb if reserved, else THP), require (fail without reserved pages), or off",
           example='"auto"', essential=True),
    Option("--prefault-threads", "prefault_threads", int, "0",
           "threads faulting the pool in behind serving; 0 = min(cores, 8). hkvd serves once the first 1/8 "
           "(at most 256 MiB) is in, and hands out only faulted memory", "N"),
    Option("--numa-node", "numa_node", int, "-1",
           "bind the pool to this NUMA node, the GPUs' (nvidia-smi topo -m); -1 = unbound", "N"),
    Option("--log-level", "log_level", _lower, "info", "debug, info, warning or error (reloadable)",
           example='"info"'),
    Option("--lease-ttl-s", "lease_ttl_s", float, "30",
           "how long a lookup's lease protects its entries from eviction, in seconds (reloadable)", "S", "30"),
    Option("--socket-group", "socket_group", str, "",
           "group that owns the socket; empty = the daemon's own", "NAME", '"hkvd"'),
    Option("--socket-mode", "socket_mode", _octal, "660", "the socket's permissions, in octal", "MODE"),
    Option("--allowed-uids", "allowed_uids", _uids, "",
           "uids that may connect, comma-separated; empty = the daemon's own uid and root", "LIST", "[1000]"),
    Option("--copy-threads", "copy_threads", int, "2",
           "threads running copies too large to run on the loop (stores, loads); step events' Mamba-state "
           "copies, due within two engine steps, have one thread of their own and never wait behind these",
           "N", "2"),
    Option("--copy-engine", "copy_engine", _lower, "host",
           "host (KV caches in CPU memory: process_vm_readv/writev) or cuda (GPU KV caches over CUDA IPC; "
           "needs hkvd[gpu-cu12], or hkvd[gpu-cu13] where only CUDA 13 libraries are installed; docs/gpu.md)",
           example='"host"', essential=True),
    Option("--cuda-copy-method", "cuda_copy_method", _lower, "auto",
           "with --copy-engine cuda: memcpy (the GPU's DMA copy engines, which leave the engine's SMs alone), "
           "kernel (a gather/scatter kernel on the SMs), or auto (the kernel only for requests of thousands "
           "of rows under 16 KiB; docs/gpu.md)", example='"auto"'),
    Option("--cuda-pin-chunk-gib", "cuda_pin_chunk_gib", int, "512",
           "with --copy-engine cuda: the pool is pinned (cudaHostRegister) in registrations of at most this many "
           "GiB, and no copy spans two; R580+ drivers refuse one registration above 512", "GIB"),
    Option("--in-step-loads", "in_step_loads", _on_off("--in-step-loads"), "on",
           "on: engines running as the daemon's user (or root) may map the pool read-only and copy leased hits "
           "themselves in the step that plans them (docs/security.md, In-step loads); off: every hit is a "
           "Retrieve", example='"on"'),
    Option("--tp-reshard", "tp_reshard", _on_off("--tp-reshard"), "on",
           "on: engines of one model at different tensor-parallel sizes read each other's entries (attention "
           "and GDN states), re-sharded on read, on this node and from peers (docs/peers.md, Tensor "
           "parallelism); off: each TP size reads only its own entries (another TP size's prefix is a miss)",
           example='"on"'),
    Option("--event-loop", "event_loop", _lower, "uvloop", "uvloop, or asyncio (the standard library's loop)",
           example='"uvloop"'),
    Option("--mamba-checkpoint-interval", "mamba_checkpoint_interval", int, "1",
           "keep a Mamba state only every K chunks (1 keeps every boundary)", "K"),
    Option("--verify-tolerance", "verify_tolerance", float, "0.25",
           "a sampled hit's recomputed attention entry (full, swa) diverges when the norm of its difference exceeds "
           "this share of the stored entry's norm (docs/verification.md); reloadable", "X"),
    Option("--verify-mamba-tolerance", "verify_mamba_tolerance", float, "0.3",
           "the same bound for Mamba/GDN states, which drift more under another prefill chunking; reloadable", "X"),
    Option("--quarantine-after", "quarantine_after", int, "3",
           "divergences of one engine fingerprint and group within --quarantine-window-s that stop its entries "
           "being served until `hkvd quarantine --clear` or SIGHUP; reloadable", "N"),
    Option("--quarantine-window-s", "quarantine_window_s", float, "600",
           "the window --quarantine-after counts divergences in; reloadable", "S"),
    Option("--shutdown-timeout-s", "shutdown_timeout_s", float, "10",
           "on SIGTERM, how long in-flight copies and the disk queue may take to drain", "S", "10"),
    Option("--io-timeout-s", "io_timeout_s", float, "10",
           "how long a client may take to send Hello, or leave its replies unread, before it is disconnected",
           "S"),
    Option("--metrics-port", "metrics_port", int, "0",
           "port for Prometheus /metrics, /healthz and routers' usable-prefix lookups (docs/routing.md); 0 = off "
           "(needs hkvd[metrics])", "PORT", "9464", active=True),
    Option("--metrics-host", "metrics_host", str, "127.0.0.1",
           "address the metrics port listens on; another than loopback lets other hosts read the metrics and "
           "the prefix lengths this node holds (never keys or bytes)", "HOST", '"127.0.0.1"'),
    Option("--l2-path", "l2_path", str, "",
           "disk tier directory: entries are written behind and served after a restart; empty = off "
           "(docs/operating.md)", "DIR", '"/var/cache/hkvd"', essential=True),
    Option("--l2-size-gb", "l2_size_bytes", _gib("--l2-size-gb", "100"), "",
           "the most disk the tier uses, in GiB (required with --l2-path); least recently used files go first",
           "X", "100"),
    Option("--cluster", "cluster", str, "",
           "mooncake://MASTER_HOST:PORT: share entries with every node of a Mooncake Store cluster; empty = off "
           "(needs hkvd[cluster]; docs/cluster.md)", "URL", '"mooncake://10.0.0.1:50051"', essential=True),
    Option("--cluster-segment-gb", "cluster_segment_bytes", _gib("--cluster-segment-gb", "4"), "1",
           "memory this node contributes to the cluster, in GiB", "X"),
    Option("--cluster-protocol", "cluster_protocol", _lower, "tcp", "tcp, or rdma", example='"tcp"'),
    Option("--cluster-devices", "cluster_devices", str, "", "RDMA device names for --cluster-protocol rdma",
           "LIST", '"mlx5_0"'),
    Option("--cluster-local-host", "cluster_local_host", str, "",
           "the address other nodes reach this one at; empty = the one this host reaches the master from",
           "HOST", '"10.0.0.2"'),
    Option("--cluster-replicas", "cluster_replicas", int, "1",
           "copies of each value on distinct nodes (2 survives a node leaving)", "N"),
    Option("--cluster-lookup-timeout-ms", "cluster_lookup_timeout_ms", float, "200",
           "how long one lookup waits on the cluster", "MS"),
    Option("--cluster-key-file", "cluster_key_file", str, "",
           "the fleet key: a file of 16 or more random bytes, the same on every node, the daemon user's, mode "
           "600; values are sealed with it and served only when sealed with a key this node holds (required "
           "with --cluster; reloadable; docs/cluster.md)", "PATH", '"/etc/hkvd/cluster.key"', essential=True),
    Option("--cluster-accept-key-file", "cluster_accept_key_file", str, "",
           "a second fleet key, also accepted on reads while the fleet changes keys (reloadable)", "PATH",
           '"/etc/hkvd/cluster-next.key"'),
    Option("--cluster-insecure", "cluster_insecure", _bool, "false",
           "run the cluster tier without a fleet key: any host that reaches the master can write values this "
           "node serves as KV", example="false", switch=True),
    Option("--peer-listen", "peer_listen", str, "",
           "HOST:PORT where decode nodes' daemons pull leased entries; empty = serve no peers (needs a peer "
           "token and NIXL; docs/peers.md)", "HOST:PORT", '"10.0.0.1:7470"', essential=True),
    Option("--peer-advertise", "peer_advertise", str, "",
           "HOST:PORT engines hand to decode engines; empty = --peer-listen", "HOST:PORT", '"10.0.0.1:7470"'),
    Option("--peer-token-file", "peer_token_file", str, "",
           "file holding the shared peer token (the daemon user's, chmod 600, the same on both daemons); also "
           "$HKVD_PEER_TOKEN",
           "PATH", '"/etc/hkvd/peer-token"'),
    Option("--peer-token", "peer_token", str, "",
           "the shared peer token itself (visible in ps: prefer --peer-token-file)", "TOKEN", in_toml=False),
    Option("--peer-allow", "peer_allow", _addresses, "",
           "addresses/CIDRs that may connect to --peer-listen, comma-separated; empty = loopback only", "LIST",
           '["10.0.0.0/24"]'),
    Option("--peer-timeout-s", "peer_timeout_s", float, "10", "connect, handshake and each peer request", "S"),
    Option("--peer-pull-timeout-s", "peer_pull_timeout_s", float, "20", "a whole pull from a peer", "S"),
    Option("--peer-max-connections", "peer_max_connections", int, "128",
           "open peer connections in all, also held to a quarter of the open-file limit (extra ones are refused "
           "at accept)", "N"),
    Option("--peer-max-connections-per-address", "peer_max_connections_per_address", int, "16",
           "open peer connections from one address (a pulling daemon holds one per layout)", "N"),
    Option("--kv-events-endpoint", "kv_events_endpoint", str, "",
           "publish KV events (vLLM's ZMQ format: what this node's pool, disk and cluster tiers hold, under vLLM's "
           "block hashes) on this ZMQ endpoint; empty = off (docs/routing.md)", "ENDPOINT",
           '"tcp://127.0.0.1:5557"', essential=True),
    Option("--kv-events-replay-endpoint", "kv_events_replay_endpoint", str, "",
           "ZMQ endpoint where a subscriber that joined late or missed batches asks for them again by sequence "
           "number; empty = no replay", "ENDPOINT", '"tcp://127.0.0.1:5558"'),
    Option("--kv-events-buffer", "kv_events_buffer", int, "10000",
           "event batches kept for replay and for engines that poll them", "N"),
    Option("--kv-events-topic", "kv_events_topic", str, "",
           "ZMQ topic of the events; {model} becomes the engine's model name (e.g. kv@NODE@{model})", "TOPIC",
           '"kv@10.0.0.2@{model}"'),
    Option("--gc-freeze-every", "gc_freeze_every", int, "10000",
           "entries written between moves of the heap out of Python's cyclic collector (docs/operating.md); "
           "0 = off", "N"),
    Option("--scrub-rate-mb", "scrub_rate_mb", int, "256",
           "MB/s at most that the scrubber re-hashes pool entries at, to catch damaged bytes before they are served "
           "(docs/checksums.md); 0 = no scrubber", "N"),
)
# DaemonConfig fields no user sets: tests and benchmarks pass them directly.
INTERNAL_FIELDS = ("max_frame_bytes", "superblock_bytes")
BY_KEY: dict[str, Option] = {o.key.replace("-", "_"): o for o in OPTIONS}


def parse_value(option: Option, value: object) -> Any:
    try:
        return option.parse(value)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{option.flag} {value!r}: {e}") from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag of ``hkvd serve``; its value is parsed later, with the TOML file's."""
    for o in OPTIONS:
        if o.switch:
            parser.add_argument(o.flag, dest=o.field, action="store_const", const="true", help=o.help)
            continue
        default = f" (default {o.default})" if o.default else ""
        parser.add_argument(o.flag, dest=o.field, metavar=o.metavar or None, help=o.help + default)


def values_from(toml: dict[str, object], args: argparse.Namespace) -> dict[str, Any]:
    """DaemonConfig values: the TOML file's (already parsed), then the flags given, which win."""
    values = dict(toml)
    for o in OPTIONS:
        v = getattr(args, o.field, None)
        if v is not None:
            values[o.field] = parse_value(o, v)
    return values


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config (keys as the flags: ``chunk-size = 256``) into DaemonConfig field values."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    return from_toml(raw, f"--config {path}")


def from_toml(raw: dict[str, object], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        o = BY_KEY.get(key.replace("-", "_"))
        if o is None or not o.in_toml:
            known = ", ".join(x.key for x in OPTIONS if x.in_toml)
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {known}")
        try:
            out[o.field] = parse_value(o, value)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return out


def _row(o: Option) -> str:
    flag = f"`{o.flag} {o.metavar}`" if o.metavar else f"`{o.flag}`"
    return f"| {flag} | {o.default or 'empty'} | {o.help} |"


def flag_table(essential_only: bool) -> str:
    rows = [_row(o) for o in OPTIONS if o.essential or not essential_only]
    return "\n".join(["| flag | default | meaning |", "|---|---|---|", *rows])


def example_toml() -> str:
    lines = ["# /etc/hkvd/hkvd.toml: keys as the `hkvd serve` flags (dashes or underscores); flags win over this file.",
             "# `systemctl reload hkvd` (SIGHUP) re-reads it: log-level, lease-ttl-s, verify-tolerance,",
             "# verify-mamba-tolerance, quarantine-after and quarantine-window-s apply at once, and with",
             "# --cluster the fleet key files (cluster-key-file, cluster-accept-key-file) are read again (the running",
             "# keys stay if the new files fail their checks); every other key is logged as \"needs a restart\" and",
             "# takes effect on `systemctl restart hkvd`.",
             "# Generated from hkvd.daemon.options: `python -m hkvd.daemon.options --write`."]
    for o in OPTIONS:
        if not o.in_toml:
            continue
        lines.append("")
        lines.append(f"# {o.help}")
        value = o.example or _toml_literal(o.default)
        lines.append(f"{o.key} = {value}" if o.active else f"# {o.key} = {value}")
    return "\n".join(lines) + "\n"


def _toml_literal(text: str) -> str:
    try:
        float(text)
    except ValueError:
        return f'"{text}"'
    return text


README_MARK = ("<!-- flags: generated by python -m hkvd.daemon.options --write -->", "<!-- /flags -->")


def with_table(doc: str, table: str, path: str) -> str:
    start, end = README_MARK
    if start not in doc or end not in doc:
        raise ConfigError(f"{path} has no {start} ... {end} block for the flag table")
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def generated_files(root: Path) -> dict[Path, str]:
    """Every file generated from the table, as it should read."""
    readme, reference = root / "README.md", root / "docs" / "configuration.md"
    return {
        readme: with_table(readme.read_text(), flag_table(essential_only=True), "README.md"),
        reference: with_table(reference.read_text(), flag_table(essential_only=False), "docs/configuration.md"),
        root / "packaging" / "hkvd.toml": example_toml(),
    }


def check_defaults() -> list[str]:
    """Options whose shown default is a value that disagrees with DaemonConfig's default."""
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[operator]
                for f in dataclasses.fields(DaemonConfig)}
    wrong = []
    for o in OPTIONS:
        if o.default in ("", "see meaning"):
            continue
        if parse_value(o, o.default) != defaults[o.field]:
            wrong.append(f"{o.flag}: shows {o.default}, DaemonConfig has {defaults[o.field]!r}")
    return wrong


def main(argv: list[str]) -> int:
    root = Path(argv[argv.index("--root") + 1]) if "--root" in argv else Path.cwd()
    files = generated_files(root)
    if "--write" in argv:
        for path, text in files.items():
            path.write_text(text)
            print(f"wrote {path}")
        return 0
    stale = [str(p) for p, text in files.items() if p.read_text() != text]
    for p in stale:
        print(f"{p} is out of date: python -m hkvd.daemon.options --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


