"""``hkvd``: the command line. ``hkvd serve`` runs the daemon; ``hkvd status`` asks a running one."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from hkvd.daemon.config import GIB, TOML_KEYS, ConfigError, DaemonConfig, default_socket_path, load_toml


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML file; keys as the flags (chunk-size = 256); flags win")
    p.add_argument("--socket", help=f"control socket path (default {default_socket_path()})")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk (default 256); a multiple of vLLM's block size")
    p.add_argument("--l1-size-gb", help="pool size in GiB (default 1)")
    p.add_argument("--eviction-policy", help="lru (default) or hybrid (orphan-aware LRU)")
    p.add_argument("--hugepages", help="auto (default), require or off")
    p.add_argument("--log-level", help="debug, info (default), warning or error")
    p.add_argument("--lease-ttl-s", type=float, help="lookup lease lifetime in seconds (default 30)")
    p.add_argument("--socket-group", help="group owning the 0660 socket (default: the daemon's)")
    p.add_argument("--copy-threads", type=int, help="copy threads (default 2)")
    p.add_argument("--mamba-checkpoint-interval", type=int,
                   help="keep a Mamba state only every K chunks (default 1: every boundary)")
    p.add_argument("--shutdown-timeout-s", type=float, help="drain deadline on SIGTERM (default 10)")
    p.add_argument("--metrics-port", type=int, help="loopback port for /metrics and /healthz (default off)")


def build_config(args: argparse.Namespace) -> DaemonConfig:
    values: dict[str, Any] = load_toml(args.config) if args.config else {}
    for key, (fname, conv) in TOML_KEYS.items():
        v = getattr(args, key, None)
        if v is None:
            continue
        try:
            values[fname] = conv(v)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--{key.replace('_', '-')} {v!r}: {e}") from None
    return DaemonConfig(**values)


def _status(args: argparse.Namespace) -> int:
    from hkvd.shim.client import DaemonClient
    from hkvd.transport.wire.errors import KVError

    client = DaemonClient(args.socket or default_socket_path(), client_name="hkvd-status", role="tool",
                          timeout_s=args.timeout_s)
    try:
        client.connect()
        status = client.status()
    except KVError as e:
        print(f"hkvd status: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        print(format_status(status))
    return 0


def format_status(s: dict[str, Any]) -> str:
    pool, idx, c = s["pool"], s["index"], s["counters"]
    used = pool["used_bytes"] / max(pool["total_bytes"], 1)
    hits, misses = c.get("lookup_hit_chunks", 0), c.get("lookup_miss_chunks", 0)
    rate = hits / (hits + misses) if hits + misses else 0.0
    lines = [
        f"pool      {pool['used_bytes'] / GIB:.2f} / {pool['total_bytes'] / GIB:.2f} GiB used ({used:.0%}), "
        f"{pool['kind']} pages",
        f"entries   {idx['ready']} ready, {idx['pending']} pending, {idx['writing']} writing; "
        f"{idx['evictions']} evicted, {idx['stores_dropped']} stores dropped",
        f"leases    {idx['leases']} held, {idx['pinned_entries']} entries pinned or leased",
        f"lookups   {int(c.get('lookups', 0))}, chunk hit rate {rate:.1%}",
        f"engines   {len(s['engines'])}",
    ]
    for e in s["engines"]:
        kinds = ", ".join(f"{g['kind']}#{g['group_id']}" for g in e["groups"])
        lines.append(f"  #{e['engine_id']} {e['role']:9} pid {e['pid']} {e['model']} rank {e['rank']}/"
                     f"{e['world_size']} chunk {e['chunk_size']} [{kinds}]")
    if s.get("shutting_down"):
        lines.append("SHUTTING DOWN")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hkvd", description="hybrid KV-cache daemon for LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    st = sub.add_parser("status", help="show a running daemon's state")
    st.add_argument("--socket", help=f"control socket path (default {default_socket_path()})")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.cmd == "status":
        return _status(args)
    try:
        cfg = build_config(args)
    except ConfigError as e:
        print(f"hkvd serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hkvd.daemon.app import Daemon
    from hkvd.daemon.errors import PoolError

    try:
        return asyncio.run(_run(cfg))
    except (PoolError, OSError) as e:
        logging.getLogger("hkvd").error("cannot start: %s", e)
        return 1


async def _run(cfg: DaemonConfig) -> int:
    from hkvd.daemon.app import Daemon

    return await Daemon(cfg).serve()


if __name__ == "__main__":
    sys.exit(main())
