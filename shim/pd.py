# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode pairs in the shim: ``kv_transfer_params`` out of a producer, pulls into a consumer.

Flow (one request, two engines, each with its own ``hkvd serve``; see examples/pd_proxy.py)
    1. The proxy sends the prompt to the prefill engine with ``max_tokens=1`` (and
       ``kv_transfer_params={"do_remote_decode": true}``). Its shim stores the prompt's chunks as
       usual; ``request_finished_all_groups`` returns ``producer_params``: the address of its
       daemon's peer listener (``hkvd serve --peer-listen``), the number of chunks, the key of the
       last one (it names the whole prefix: keys are chained), and a lease that holds the entries
       on the prefill daemon until the decode side pulls them (or the lease expires); the
       scheduler side's ``ProducerSide`` asks its daemon for the address and the lease.
    2. The proxy sends the same prompt to the decode engine with those params. Its scheduler side
       (``consumer_plan``) checks them against its own chunk keys, claims the chunks as an
       asynchronous external hit (the request waits in WAITING_FOR_REMOTE_KVS) and hands the
       worker a ``LoadJob`` carrying a ``PullSpec``.
    3. The worker (``PullLoads``) asks its daemon to ``Pull`` the chunks from the prefill daemon
       (daemon to daemon, NIXL READ into the pool), then ``Retrieve``s them into the request's
       blocks like any load (``hkvd.shim.loads``), without blocking vLLM's steps; then it reports
       the request finished receiving. Any failure (peer down, layout mismatch, partial pull,
       timeout) reports it failed: vLLM recomputes the request, never with wrong bytes.

Threading
    Called from vLLM's threads through the scheduler and worker sides; no threads of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hkvd.shim.client import DaemonClient
from hkvd.shim.jobs import LoadJob, PullSpec
from hkvd.shim.link import DaemonLink
from hkvd.shim.loads import Loads
from hkvd.shim.results import Completion
from hkvd.transport.wire.kv import LookupReply
from hkvd.transport.wire.peer import PullResult

logger = logging.getLogger("hkvd.shim")

DO_REMOTE_DECODE = "do_remote_decode"  # the proxy asks the prefill engine for params
DO_REMOTE_PREFILL = "do_remote_prefill"  # vLLM's own key: the decode side loads remotely
PEER = "hkvd_peer"
CHUNKS = "hkvd_chunks"
CHUNK_SIZE = "hkvd_chunk_size"
LAST_KEY = "hkvd_last_key"
LEASE = "hkvd_lease"
PEER_ASK_INTERVAL_S = 30.0
# request_finished may wait this long for the hold lease of a producer's prefix (a UDS round trip
# is ~0.1 ms); past it the params carry no lease and the entries are held by recency only.
PD_HOLD_WAIT_S = 0.05


def producer_params(peer: str, keys: list[bytes], n: int, chunk_size: int, lease_id: int) -> dict[str, Any]:
    return {DO_REMOTE_PREFILL: True, PEER: peer, CHUNKS: n, CHUNK_SIZE: chunk_size, LAST_KEY: keys[n - 1].hex(),
            LEASE: int(lease_id)}


class ProducerSide:
    """The scheduler side of a producer: the params a finished request hands the decode engine."""

    def __init__(self, link: DaemonLink, kv_role: str, peer_address: str,
                 connect: Callable[[], DaemonClient | None]) -> None:
        self._link, self._kv_role, self._connect = link, kv_role, connect
        self._peer_address = peer_address  # this engine's daemon's peer listener
        self._peer_asked_at = -1e9

    def params(self, keys: list[bytes], n: int, chunk_size: int) -> dict[str, Any] | None:
        """``producer_params`` for the first ``n`` chunks, with a hold lease on them; None without a peer address."""
        peer = self._peer() if n > 0 else ""
        if not peer:
            return None
        return producer_params(peer, keys, n, chunk_size, self._hold(keys[:n]))

    def _peer(self) -> str:
        """``peer_address``, else the daemon's advertised peer address (asked at most every 30 s)."""
        if self._peer_address or time.monotonic() - self._peer_asked_at < PEER_ASK_INTERVAL_S:
            return self._peer_address
        self._peer_asked_at = time.monotonic()
        client = self._connect()
        try:
            peer = (client.status().get("peer") or {}) if client is not None else {}
        except Exception as e:
            self._link.lost(e)
            return ""
        self._peer_address = str(peer.get("advertise") or "")
        if not self._peer_address:
            logger.error("hkvd: kv_role %s hands decode engines its daemon's peer address, but the daemon at %s "
                         "serves no peers; start it with --peer-listen HOST:PORT (and --peer-token-file), or set "
                         "kv_connector_extra_config peer_address", self._kv_role, self._link.cfg.socket_path)
        return self._peer_address

    def _hold(self, keys: list[bytes]) -> int:
        """A lease on the prefix until the decode side pulls it (0 if none in ``PD_HOLD_WAIT_S``)."""
        client = self._link.client
        if client is None:
            return 0
        try:
            rid = client.submit_lookup(keys, lease=True)
            c = client.wait([rid], PD_HOLD_WAIT_S)[rid]
        except Exception as e:  # a late reply is an unknown lookup to the scheduler's poll: its lease is released
            logger.debug("hkvd: no hold lease for the decode side: %s", e)
            return 0
        return c.get(LookupReply).lease_id if c.ok else 0


def wants_params(kv_role: str, request_params: Mapping[str, object] | None) -> bool:
    """A producer always hands out params; a kv_both engine only when the proxy asks."""
    if kv_role == "kv_producer":
        return True
    return kv_role == "kv_both" and bool(request_params and request_params.get(DO_REMOTE_DECODE))


def consumer_plan(params: dict[str, Any] | None, keys: list[bytes], max_chunks: int,
                  chunk_size: int) -> tuple[int, PullSpec] | None:
    """(chunks to claim, what to pull) for a request carrying a producer's params, else None.

    Params from another chunk size or for another prompt (the last key differs) are ignored with a
    warning: the request is served by a local lookup (or recomputed), never loaded from wrong keys.
    """
    if not params or not params.get(PEER) or not params.get(DO_REMOTE_PREFILL):
        return None
    try:
        peer, n, size = str(params[PEER]), int(params[CHUNKS]), int(params[CHUNK_SIZE])
        last = bytes.fromhex(str(params[LAST_KEY]))
        lease = int(params.get(LEASE, 0))
    except (KeyError, TypeError, ValueError) as e:
        logger.warning("hkvd: ignoring malformed kv_transfer_params (%s: %s)", type(e).__name__, e)
        return None
    if size != chunk_size:
        logger.warning("hkvd: the prefill engine used %d-token chunks, this one %d; recomputing instead of "
                       "pulling (give both daemons the same --chunk-size)", size, chunk_size)
        return None
    if n <= 0 or n > len(keys) or keys[n - 1] != last:
        logger.warning("hkvd: kv_transfer_params name another prompt than this request's (chunk %d's key "
                       "differs); recomputing instead of pulling", n)
        return None
    n = min(n, max_chunks)
    if n <= 0:
        return None
    return n, PullSpec(peer, keys[:n], lease)


@dataclass(slots=True)
class _Pending:
    job: LoadJob
    spec: PullSpec  # job.pull
    deadline: float


class PullLoads:
    """Worker side: loads that start with a pull, driven by completions, never blocking a step.

    ``start`` submits the Pull; ``absorb`` takes the client's completions: a finished Pull starts the
    Retrieve into the request's blocks with the pull's lease, in ``loads`` (``hkvd.shim.loads``), which
    ends the load and reports it. ``expire`` fails a pull past ``timeout_s`` at once (daemon to
    daemon, no engine memory involved) and releases its late reply's lease; the load after a pull
    keeps the pull's deadline and follows the rules of ``Loads``.
    """

    def __init__(self, timeout_s: float, loads: Loads) -> None:
        self.timeout_s = timeout_s
        self.loads = loads
        self._pulls: dict[int, _Pending] = {}
        self._late: set[int] = set()
        self.stats = {"pulls_ok": 0, "pulls_failed": 0, "pulled_chunks": 0, "pull_seconds": 0.0}

    @property
    def in_flight(self) -> int:
        return len(self._pulls)

    def start(self, client: DaemonClient, job: LoadJob) -> None:
        """Pull ``job.pull`` first, then load ``job``."""
        spec = job.pull
        if spec is None:  # the worker starts here only the loads that pull
            raise ValueError(f"hkvd: load {job.req_id} has no pull to start")
        try:
            rid = client.submit_pull(spec.peer, spec.keys, len(spec.keys), spec.release_lease)
        except Exception as e:
            self._fail(job, f"could not ask the daemon to pull: {e}")
            raise
        self._pulls[rid] = _Pending(job, spec, time.monotonic() + self.timeout_s)

    def absorb(self, c: Completion, client: DaemonClient | None) -> bool:
        """Handle one completion if it is one of our pulls'; True when it was."""
        if c.req_id in self._late:
            self._late.discard(c.req_id)
            if c.ok and c.get(PullResult).lease_id:
                _release(client, c.get(PullResult).lease_id)
            return True
        p = self._pulls.pop(c.req_id, None)
        if p is None:
            return False
        self._pulled(p, c, client)
        return True

    def _pulled(self, p: _Pending, c: Completion, client: DaemonClient | None) -> None:
        job, want = p.job, len(p.spec.keys)
        if not c.ok:
            self._fail(job, f"pull from {p.spec.peer} failed: {c.error}")
            return
        pulled = c.get(PullResult)
        hit, lease = pulled.hit_chunks, pulled.lease_id
        if hit < want:
            _release(client, lease)
            self._fail(job, f"the prefill daemon at {p.spec.peer} had {hit} of {want} chunks")
            return
        self.stats["pulls_ok"] += 1
        self.stats["pulled_chunks"] += want
        self.stats["pull_seconds"] += pulled.seconds
        if not job.items:
            _release(client, lease)
            self._fail(job, "the load plan was refused (null block in it)")
            return
        if client is None:
            self._fail(job, "could not submit the load: the daemon connection is gone")
            return
        try:
            self.loads.start(client, job, lease, deadline=p.deadline, budget="pull_timeout_s")
        except Exception as e:
            self._fail(job, f"could not submit the load: {e}")

    def expire(self, client: DaemonClient | None) -> None:
        now = time.monotonic()
        for rid, p in list(self._pulls.items()):
            if p.deadline <= now:
                del self._pulls[rid]
                self._late.add(rid)
                self._fail(p.job, f"no pull within {self.timeout_s:.1f} s (pull_timeout_s)")
                _abort(client, rid)

    def forget(self, why: str) -> None:
        """The daemon connection is gone: every pull in flight failed (``Loads.forget`` fails the loads)."""
        for p in self._pulls.values():
            self._fail(p.job, why)
        self._pulls.clear()
        self._late.clear()

    def _fail(self, job: LoadJob, why: str) -> None:
        self.stats["pulls_failed"] += 1
        logger.warning("hkvd: remote prefill for %s not loaded (%s); vLLM recomputes it", job.req_id, why)
        self.loads.fail(job, why)


def _abort(client: DaemonClient | None, rid: int) -> None:
    if client is not None:
        try:
            client.abort(rid)
        except Exception:
            logger.debug("hkvd: abort of %d failed", rid, exc_info=True)


def _release(client: DaemonClient | None, lease_id: int) -> None:
    if lease_id and client is not None:
        try:
            client.release(lease_id)
        except Exception:
            logger.debug("hkvd: lease release failed", exc_info=True)
