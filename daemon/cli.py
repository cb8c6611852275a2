"""``hkvd``: the command line. ``hkvd serve`` runs the daemon; ``hkvd status`` asks a running one."""

from __future__ import annotations

import argparse
import asyncio
import grp
import json
import logging
import os
import pwd
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from hkvd.cuda._cupy import unshadow_nvidia_cuda
from hkvd.daemon import fd_budget
from hkvd.daemon.app import Daemon
from hkvd.daemon.config import GIB, DaemonConfig
from hkvd.daemon.engines.engine_factory import check_copy_engine
from hkvd.daemon.http import require_prometheus
from hkvd.daemon.options import add_flags, load_toml, values_from
from hkvd.daemon.peers.links import check_peer_config, peers_wanted
from hkvd.daemon.startup_errors import StartupError
from hkvd.daemon.tiers.cluster_value import FleetKeys
from hkvd.transport.codec import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, decode_body, encode
from hkvd.transport.errors import DaemonUnavailable, KVError, KVTimeout, error_from_wire
from hkvd.transport.paths import default_socket_path
from hkvd.transport.wire import PROTOCOL_VERSION, Message, control, kv


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML file; keys as the flags (chunk-size = 256); flags win")
    add_flags(p)


def build_config(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(**values_from(load_toml(args.config) if args.config else {}, args))


def query_status(socket_path: str, timeout_s: float) -> dict[str, Any]:
    """Hello, then Status, on one blocking connection: what ``hkvd status`` shows. Raises ``KVError``."""
    return _ask(socket_path, timeout_s, control.Status(1), control.StatusReply, "hkvd-status").status


def lift_quarantine(socket_path: str, timeout_s: float, fingerprint: str) -> list[str]:
    """``hkvd quarantine --clear``: the (fingerprint/group) pairs the daemon serves again. Raises ``KVError``."""
    lifted = _ask(socket_path, timeout_s, control.LiftQuarantine(1, fingerprint), control.QuarantineLifted,
                  "hkvd-quarantine").lifted
    return lifted.split(",") if lifted else []


def unpin_session(socket_path: str, timeout_s: float, session: str) -> int:
    """``hkvd unpin SESSION``: the number of the session's pins the daemon ended. Raises ``KVError``."""
    return _ask(socket_path, timeout_s, control.Unpin(1, session), control.Unpinned, "hkvd-unpin").unpinned


R = TypeVar("R", bound=Message)


def _ask(socket_path: str, timeout_s: float, request: Message, reply: type[R], name: str) -> R:
    """Hello, then ``request`` (req_id 1), on one blocking connection; its ``reply``. Raises ``KVError``."""
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
            sock.sendall(encode(control.Hello(PROTOCOL_VERSION, name, "tool")) + encode(request))
        except OSError as e:
            raise DaemonUnavailable(f"cannot reach hkvd at {socket_path}: {e.strerror or e}; is `hkvd serve` "
                                    "running with the same --socket?") from None
        decoder = FrameDecoder(DEFAULT_MAX_FRAME_BYTES)
        while time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 20)
            except OSError as e:
                raise DaemonUnavailable(f"hkvd at {socket_path} did not answer: {e.strerror or e}") from None
            if not data:
                raise DaemonUnavailable(f"hkvd at {socket_path} closed the connection before answering")
            for body in decoder.feed(data):
                msg = decode_body(body)
                if isinstance(msg, reply):
                    return msg
                if isinstance(msg, kv.Error):
                    raise error_from_wire(msg.code, msg.message)
    raise KVTimeout(f"hkvd at {socket_path} did not answer within {timeout_s:g} s; raise --timeout-s")


def _status(args: argparse.Namespace) -> int:
    try:
        status = query_status(args.socket or default_socket_path(), args.timeout_s)
    except KVError as e:
        print(f"hkvd status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        print(format_status(status))
    return 0


def _quarantine(args: argparse.Namespace) -> int:
    """``hkvd quarantine``: list the quarantined (fingerprint, group) pairs; ``--clear FP`` lifts them."""
    path = args.socket or default_socket_path()
    try:
        if args.clear:
            lifted = lift_quarantine(path, args.timeout_s, args.clear.lower())
            print(f"lifted: {', '.join(lifted)}" if lifted else f"no quarantine matched {args.clear}")
            return 0
        status = query_status(path, args.timeout_s)
    except KVError as e:
        print(f"hkvd quarantine: {e}", file=sys.stderr)
        return 1
    held = [g for g in (status.get("verify") or {}).get("groups", []) if g["quarantined"]]
    for g in held:
        print(f"{g['fingerprint']} group {g['group']} ({g['kind']}): {g['divergences']} divergences, largest error "
              f"{g['max_error']:.4g}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(g['since']))}")
    if not held:
        print("nothing quarantined")
    return 0


def _unpin(args: argparse.Namespace) -> int:
    """``hkvd unpin SESSION``: end a session's pins (docs/pins.md)."""
    try:
        control.check_session(args.session, "SESSION")
        n = unpin_session(args.socket or default_socket_path(), args.timeout_s, args.session)
    except KVError as e:
        print(f"hkvd unpin: {e}", file=sys.stderr)
        return 1
    print(f"unpinned {args.session}: {n} pins ended" if n else f"no pins held for session {args.session}")
    return 0


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_status(s: dict[str, Any]) -> str:
    """A terminal summary a person reads at a glance: state, pool, entries, traffic, hit rate, engines."""
    pool, idx, c = s["pool"], s["index"], s["counters"]
    used = pool["used_bytes"] / max(pool["total_bytes"], 1)
    hits, misses = int(c.get("lookup_hit_chunks", 0)), int(c.get("lookup_miss_chunks", 0))
    rate = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(idx.get("by_kind", {}).items())) or "none"
    errors = int(c.get("errors", 0)) + int(c.get("internal_errors", 0))
    lines = [
        f"state     {'SHUTTING DOWN' if s.get('shutting_down') else 'serving'}",
        f"pool      {_bytes(pool['used_bytes'])} / {_bytes(pool['total_bytes'])} used ({used:.0%}), "
        f"{_pages(pool)}",
        f"entries   {idx['ready']} ready ({kinds}), {idx['pending']} pending, {idx['writing']} writing",
        f"evicted   {idx['evictions']} entries, {idx['stores_dropped']} stores dropped (pool full)",
        *_status_admission(idx),
        f"hit rate  {rate} of chunks ({hits} hit, {misses} missed in {int(c.get('lookups', 0))} lookups)",
        f"traffic   {_bytes(c.get('stored_bytes', 0))} stored, {_bytes(c.get('retrieved_bytes', 0))} retrieved",
        f"leases    {idx['leases']} held, {idx['pinned_entries']} entries pinned",
        f"errors    {errors} sent to clients, {int(c.get('copy_timeouts', 0))} copy timeouts, "
        f"{int(c.get('step_event_gaps', 0))} step-event gaps",
        *_status_extra(s),
        *_status_cluster(s),
        *_status_peer(s),
        *_status_heap(s),
        *_status_descriptors(s),
        *_status_verify(s),
        *_status_integrity(s),
        *_status_pins(s),
        *_status_hints(s),
        *_status_keeping(s),
        f"engines   {len(s['engines'])} connected",
    ]
    for e in s["engines"]:
        groups = ", ".join(f"{g['kind']}#{g['group_id']}" for g in e["groups"])
        lines.append(f"  #{e['engine_id']:<3} {e['role']:9} pid {e['pid']:<7} {e['model']} rank {e['rank']}/"
                     f"{e['world_size']} chunk {e['chunk_size']} [{groups}]")
    return "\n".join(lines)


def _status_admission(idx: dict[str, Any]) -> list[str]:
    """What the eviction and the admission kept out (a daemon without these fields shows nothing)."""
    if "admission_entries" not in idx:
        return []
    n, b = idx["admission_entries"], idx["admission_bytes"]
    why = ", ".join(f"{k} {v}" for k, v in sorted(idx.get("evictions_by_reason", {}).items())) or "none"
    return [f"admitted  {n.get('admitted', 0)} entries ({_bytes(b.get('admitted', 0))}), {n.get('refused', 0)} "
            f"refused ({_bytes(b.get('refused', 0))}) by --admission {idx.get('admission', 'none')}; "
            f"evicted by {why}"]


def _status_keeping(s: dict[str, Any]) -> list[str]:
    """Engines' store entries by outcome, writes left out by store tiers, hits per pool byte (absent in older
    daemons and before the first store)."""
    k = s.get("keeping")
    if not k or not k.get("stores"):
        return []
    n, b = k["stores"], k.get("store_bytes", {})
    rows = ", ".join(f"{o} {int(n[o])} ({_bytes(b.get(o, 0))})" for o in sorted(n, key=lambda o: (o != "stored", o)))
    left = k.get("tiers_left_out") or {}
    lines = [f"stores    {rows}"]
    if left:
        lines.append("left out  " + ", ".join(f"{int(v)} entries not written to {t} (store tiers)"
                                            for t, v in sorted(left.items())))
    lines.append(f"hits/byte {k.get('hits_per_pool_byte', 0.0):.2f} ({_bytes(k.get('hit_bytes', 0))} served from "
                 f"the pool, {_bytes(k.get('pool_bytes', 0))} held)")
    return lines


def _status_hints(s: dict[str, Any]) -> list[str]:
    """KV hints by action and outcome (docs/hints.md; absent before the first and in older daemons)."""
    h = s.get("hints")
    if not h:
        return []
    rows = [f"{action} " + ", ".join(f"{int(n)} {o}" for o, n in sorted(outcomes.items()))
            for action, outcomes in sorted(h.items())]
    return [f"hints     {'; '.join(rows)}"]


def _status_pins(s: dict[str, Any]) -> list[str]:
    """Session pins and their sessions' TTLs; bytes and quotas per tenant (absent in older daemons)."""
    p, t = s.get("pins"), s.get("tenants")
    lines = []
    if p is not None:
        lapsed = ", ".join(f"{n} {r}" for r, n in p["lapsed"].items() if n) or "none"
        lines.append(f"pins      {_bytes(p['pinned_bytes'])} pinned of {_bytes(p['budget_bytes'])} allowed, "
                     f"{p['sessions']} sessions ({p['pins']} pins); lapsed: {lapsed}")
        for r in p["longest"]:
            tenant = f" tenant {r['tenant']}" if r["tenant"] else ""
            lines.append(f"  {r['session']}{tenant}: {r['pins']} pins, {r['ttl_left_s']:.0f} s left")
        if p["sessions"] > len(p["longest"]):
            lines.append(f"  ... and {p['sessions'] - len(p['longest'])} more sessions (the {len(p['longest'])} "
                         "longest-lasting are listed)")
    if t is not None and (t["bytes"] or t["quotas"]):
        rows = sorted(t["bytes"], key=lambda x: -t["bytes"][x])
        lines.append(f"tenants   {len(rows)}, quotas {'on' if t['quotas'] else 'off (--tenant-quota 1.0)'}")
        for label in rows[:20]:
            lines.append(f"  {label or '(unsalted)'}: {_bytes(t['bytes'][label])} of {_bytes(t['quota_bytes'][label])}"
                         f", {t['evictions'].get(label, 0)} evicted")
    return lines


def _status_verify(s: dict[str, Any]) -> list[str]:
    """Sampled hits compared, and each quarantined (fingerprint, group) (absent in older daemons)."""
    v = s.get("verify")
    if v is None:
        return []
    rows = v["groups"]
    total = {k: sum(int(r[k]) for r in rows) for k in ("checks", "divergences", "missing")}
    lines = [f"verify    {total['checks']} entries compared, {total['divergences']} diverged, {total['missing']} "
             f"missing; {sum(1 for r in rows if r['quarantined'])} quarantined"]
    lines += [f"  QUARANTINED {r['fingerprint']} group {r['group']} ({r['kind']}): {r['divergences']} divergences, "
              f"largest error {r['max_error']:.4g}; lift: hkvd quarantine --clear {r['fingerprint']}"
              for r in rows if r["quarantined"]]
    return lines


def _pages(pool: dict[str, Any]) -> str:
    """'thp pages (2.0 MiB), 40% faulted (pre-faulting on 8 threads)': the kernel's backing, the faulted share."""
    text = f"{pool['kind']} pages"
    if "page_size" in pool:  # older daemons report the kind only
        text += f" ({_bytes(pool['page_size'])})"
    pf = pool.get("prefault")
    if pf:
        share = pool["faulted_bytes"] / max(pool["total_bytes"], 1)
        state = f"failed: {pf['error']}" if pf["error"] else (
            "pre-faulted" if pf["done"] else f"pre-faulting on {pf['threads']} threads")
        text += f", {share:.0%} faulted ({state})"
    return text


def _status_extra(s: dict[str, Any]) -> list[str]:
    """Lines for hits by group kind, copy throughput and the disk tier (absent in older daemons)."""
    lines = []
    by_kind = s.get("by_kind") or {}
    hit, miss = by_kind.get("lookup_hit_entries", {}), by_kind.get("lookup_miss_entries", {})
    kinds = ", ".join(f"{k} {int(hit.get(k, 0))}/{int(miss.get(k, 0))}" for k in sorted(set(hit) | set(miss)))
    if "by_kind" in s:
        lines.append(f"kinds     entries hit/missed by group kind: {kinds or 'n/a'}")
    rates = (s.get("rates") or {}).get("copy_gbps")
    if rates is not None:
        lines.append("copy      " + ", ".join(f"{d} {v:.2f} GB/s" for d, v in sorted(rates.items()))
                     + " (last 64 copies)")
    if "l2" not in s:
        return lines
    l2 = s["l2"]
    if l2 is None:
        lines.append("disk      off (--l2-path DIR enables the cold-restart tier)")
        return lines
    corrupt = sum(l2["corrupt"].values())
    lines.append(f"disk      {_bytes(l2['bytes'])} / {_bytes(l2['cap_bytes'])} in {l2['entries']} entries, "
                 f"{sum(int(v) for v in by_kind.get('l2_hits', {}).values())} read back ({l2['path']})")
    lines.append(f"disk-io   {l2['writes']} written, {l2['queued']} queued, {l2['queue_drops']} dropped (queue full), "
                 f"{l2['write_errors']} write errors, {corrupt} corrupt skipped, {l2['evictions']} evicted")
    return lines


def _status_cluster(s: dict[str, Any]) -> list[str]:
    """The cluster tier: where, whether connected, and its hit, miss, put, skip and error counts."""
    c = s.get("cluster")
    if not c:
        return []
    hits = sum(int(v) for v in (s.get("by_kind") or {}).get("cluster_hits", {}).values())
    state = "connected" if c["connected"] else "NOT connected (serving from this node's tiers)"
    lines = [f"cluster   {c['master']} {state}; {hits} entries read ({_bytes(c['get_bytes'])}), {c['misses']} missed, "
             f"{c['puts']} put ({_bytes(c['put_bytes'])})",
             f"clust-io  {c['queued']} queued, {sum(c['skips'].values())} skipped {c['skips'] or ''}, "
             f"{sum(c['errors'].values())} errors {c['errors'] or ''}, {sum(c['corrupt'].values())} corrupt "
             f"{c['corrupt'] or ''}, {c['reconnects']} reconnects"]
    if "insecure" in c:  # older daemons do not say
        accepted = "".join(f", accepting {k} too" for k in c["accepted_key_ids"])
        lines.append("clust-key INSECURE: no fleet key (--cluster-insecure); any host on its network can write values"
                     if c["insecure"] else f"clust-key values sealed with fleet key {c['key_id']}{accepted}")
    return lines


def _status_integrity(s: dict[str, Any]) -> list[str]:
    """Entry checksums and the scrubber (docs/checksums.md; absent in older daemons)."""
    i = s.get("integrity")
    if i is None:
        return []
    corrupt = s["index"].get("corrupt", {}).get("checksum", 0)
    where = ", ".join(f"{n} {w}" for w, n in sorted(i["mismatches"].items())) or "none"
    scrub = (f"scrubbed {i['scrub_entries']} entries ({_bytes(i['scrub_bytes'])}) in {i['scrub_passes']} passes at "
             f"<= {i['scrub_rate_mb']} MB/s, {i['scrub_cpu_s']:.1f} s CPU" if i["scrub_rate_mb"]
             else "scrubber off (--scrub-rate-mb 0)")
    return [f"checksums {s['index'].get('checksummed', 0)} entries checksummed, {i['checksums_queued']} queued; "
            f"{corrupt} dropped as damaged (mismatches: {where})",
            f"scrub     {scrub}"]


def _status_heap(s: dict[str, Any]) -> list[str]:
    """The garbage collector: the longest pause it caused, and what the heap policy froze."""
    h = s.get("heap")
    if not h:
        return []
    c = s["counters"]
    froze = (f"{h['frozen_objects']} objects frozen in {h['freezes']} freezes (every {h['freeze_every']} entries)"
             if h["freeze_every"] else "freezing off (--gc-freeze-every 0)")
    return [f"gc        longest pause {h['max_pause_ms']:.1f} ms in {int(c.get('gc_collections', 0))} collections; "
            f"{froze}"]


def _status_descriptors(s: dict[str, Any]) -> list[str]:
    """Open-file descriptors: used, the limit, the room left for engines, and engines refused for want of them."""
    d = s.get("descriptors")
    if not d:
        return []
    refused = int(s["counters"].get("connections_refused", 0))
    room = "no limit on engines" if d["engines_room"] < 0 else f"room for ~{d['engines_room']} engines"
    return [f"files     {d['used']} of {d['limit']} open (hard {d['hard_limit']}, {d['reserve']} reserved): {room}; "
            f"{refused} refused" + (": raise LimitNOFILE" if refused else "")]


def _status_peer(s: dict[str, Any]) -> list[str]:
    """Peer links (prefill/decode pairs): what this daemon serves and pulls."""
    if "peer" not in s:
        return []
    p = s["peer"]
    if p is None:
        return ["peers     off (--peer-listen / --peer-token-file enable prefill/decode pulls)"]
    t, c = p.get("transport") or {}, s["counters"]
    serving = p.get("serving")
    served = (f"serving {p['listen']} to {len(serving['sessions'])} peers, {int(c.get('peer_lookups', 0))} lookups, "
              f"{_bytes(c.get('peer_served_bytes', 0))} leased" if serving else "not serving")
    return [
        f"peers     {served}; {len(p.get('links', []))} links out",
        f"pulls     {int(c.get('peer_pulls', 0))} pulls, {_bytes(c.get('peer_pulled_bytes', 0))} read in "
        f"{int(t.get('reads', 0))} READs ({int(t.get('reads_failed', 0))} failed, {int(t.get('in_flight', 0))} "
        f"in flight), {p.get('read_gbps', 0.0):.2f} GB/s, {int(p.get('quarantined_entries', 0))} entries quarantined",
    ]


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=hkvd.service pid=123 engine=4 peer_pid=567 msg="..."``.

    Per-engine fields come from ``extra={"engine": ..., "peer_pid": ..., "conn": ..., "req_id": ...}`` when
    a log call passes them, else from the message's own "engine N (pid P)" / "connection N (pid P)" wording,
    so grep and log shippers can filter one engine without parsing prose.
    """

    _ENGINE = re.compile(r"\bengine (\d+) \(pid (\d+)")
    _CONN = re.compile(r"\bconnection (\d+) \(pid (\d+)")
    FIELDS = ("engine", "conn", "peer_pid", "req_id")

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        fields = {k: getattr(record, k) for k in self.FIELDS if getattr(record, k, None) is not None}
        for pattern, key in ((self._ENGINE, "engine"), (self._CONN, "conn")):
            m = pattern.search(msg)
            if m:
                fields.setdefault(key, m.group(1))
                fields.setdefault("peer_pid", m.group(2))
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        line = (f"ts={self.formatTime(record)} level={record.levelname.lower()} logger={record.name} "
                f"pid={record.process}{extra} msg={json.dumps(msg)}")
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


PACKAGING = Path(__file__).resolve().parent.parent / "packaging"


def _hkvd_command() -> str:
    exe = Path(sys.executable).with_name("hkvd")
    if exe.exists():
        return str(exe)
    found = shutil.which("hkvd")
    return found or f"{sys.executable} -m hkvd.daemon"


def _service_user(name: str | None) -> tuple[str, str] | str:
    """(user, group) the unit runs as, or the reason it cannot: the engines' user, never root."""
    name = name or os.environ.get("SUDO_USER")
    if not name:
        return "name the user your vLLM engines run as: hkvd install-service --user NAME"
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return f"no user {name!r} on this machine; create it (useradd --system {name}) or name another"
    if pw.pw_uid == 0:
        return ("hkvd does not run as root: as root it could copy any process's memory. Run the engines "
                "as an unprivileged user and pass it: hkvd install-service --user NAME")
    return name, grp.getgrgid(pw.pw_gid).gr_name


def install_service(prefix: str, *, user: str | None = None, force: bool = False, out: TextIO = sys.stdout) -> int:
    """Put the unit in <prefix>/etc/systemd/system, example config in <prefix>/etc/hkvd (kept if present)."""
    unit_src, conf_src = PACKAGING / "hkvd.service", PACKAGING / "hkvd.toml"
    if not unit_src.exists() or not conf_src.exists():
        print(f"hkvd install-service: {PACKAGING} is missing; install from a source checkout",
              file=sys.stderr)
        return 1
    who = _service_user(user)
    if isinstance(who, str):
        print(f"hkvd install-service: {who}", file=sys.stderr)
        return 2
    root = Path(prefix)
    unit_dst = root / "etc/systemd/system/hkvd.service"
    conf_dst = root / "etc/hkvd/hkvd.toml"
    unit = (unit_src.read_text().replace("/usr/local/bin/hkvd", _hkvd_command())
            .replace("@USER@", who[0]).replace("@GROUP@", who[1]))
    unit_dst.parent.mkdir(parents=True, exist_ok=True)
    unit_dst.write_text(unit)
    unit_dst.chmod(0o644)
    print(f"installed {unit_dst}", file=out)
    if conf_dst.exists() and not force:
        print(f"kept {conf_dst} (exists; --force overwrites it)", file=out)
    else:
        conf_dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(conf_src, conf_dst)
        conf_dst.chmod(0o644)
        print(f"installed {conf_dst}", file=out)
    print("next: systemctl daemon-reload && systemctl enable --now hkvd", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    unshadow_nvidia_cuda()  # `python -m hkvd.daemon` from a checkout's root must still find CuPy's `cuda`
    parser = argparse.ArgumentParser(prog="hkvd", description="hybrid KV-cache daemon for LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    st = sub.add_parser("status", help="show a running daemon's state")
    st.add_argument("--socket", help=f"control socket path (default {default_socket_path()})")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--timeout-s", type=float, default=5.0)
    qu = sub.add_parser("quarantine", help="list quarantined layouts and groups; --clear lifts them")
    qu.add_argument("--clear", metavar="FINGERPRINT", help="serve again the groups of this layout fingerprint "
                    "(8 to 32 hex digits, as hkvd status shows it), or all")
    qu.add_argument("--socket", help=f"control socket path (default {default_socket_path()})")
    qu.add_argument("--timeout-s", type=float, default=5.0)
    up = sub.add_parser("unpin", help="end a session's pins (docs/pins.md)")
    up.add_argument("session", metavar="SESSION", help="the session id its requests' kv_transfer_params named")
    up.add_argument("--socket", help=f"control socket path (default {default_socket_path()})")
    up.add_argument("--timeout-s", type=float, default=5.0)
    ins = sub.add_parser("install-service", help="install the systemd unit and /etc/hkvd/hkvd.toml")
    ins.add_argument("--prefix", default="/", help="root to install under (default /)")
    ins.add_argument("--user", help="the user the engines run as; hkvd runs as it (default: $SUDO_USER; "
                     "never root)")
    ins.add_argument("--force", action="store_true", help="overwrite an existing hkvd.toml")
    args = parser.parse_args(argv)
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "quarantine":
        return _quarantine(args)
    if args.cmd == "unpin":
        return _unpin(args)
    if args.cmd == "install-service":
        return install_service(args.prefix, user=args.user, force=args.force)
    try:
        cfg = build_config(args)
        _preflight(cfg)
        setup_logging(cfg.log_level)
        fd_budget.raise_and_log(logging.getLogger("hkvd"))
        if os.geteuid() == 0:
            logging.getLogger("hkvd").warning(
                "running as root: hkvd may then copy the memory of any process that connects as an allowed uid; "
                "run it as the user the engines run as (hkvd install-service --user NAME)")
        with asyncio.Runner(loop_factory=loop_factory(cfg.event_loop)) as runner:
            return runner.run(_run(cfg, (lambda: build_config(args)) if args.config else None))
    except StartupError as e:
        print(f"hkvd serve: cannot start: {e}", file=sys.stderr)
        return e.exit_code


def _preflight(cfg: DaemonConfig) -> None:
    """What can fail before the pool is pre-faulted, checked first. Raises ``StartupError``."""
    if cfg.metrics_port:
        require_prometheus()
    if peers_wanted(cfg):
        check_peer_config(cfg)
        if cfg.peer_token:
            print("hkvd serve: warning: --peer-token is visible to every user in ps; prefer --peer-token-file",
                  file=sys.stderr)
    check_copy_engine(cfg.copy_engine)
    if cfg.cluster:
        FleetKeys.load(cfg.cluster_key_file, cfg.cluster_accept_key_file)  # unsafe or short: refused now


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop ``--event-loop`` names; uvloop missing is an error with the fix, never a fallback."""
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        raise StartupError("--event-loop uvloop: uvloop is not installed; `pip install uvloop` (hkvd depends on "
                      "it), or run with --event-loop asyncio") from None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


async def _run(cfg: DaemonConfig, reload_config: Callable[[], DaemonConfig] | None = None) -> int:
    return await Daemon(cfg, reload_config=reload_config).serve()


if __name__ == "__main__":
    sys.exit(main())
