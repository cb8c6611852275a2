"""Cluster tier (``--cluster mooncake://MASTER:PORT``): entries shared by every node through Mooncake Store.

Role
    A fleet of hkvd nodes shares one Mooncake Store: a ``mooncake_master`` keeps the metadata, each
    daemon's client contributes ``--cluster-segment-gb`` of memory, and values move over TCP (or
    RDMA) between the nodes. Copies to and from engines only ever touch the pool; this module
    moves bytes between pool pages and the cluster, with no staging copy: the pool is registered
    with Mooncake once, and puts and gets name pool addresses.

    - write-behind: the service offers each entry when it becomes READY (Mamba states once their
      engine confirmed them). A bounded queue feeds one writer thread that puts in batches; the
      entry stays pinned until its put ends. A full queue, or a cluster that is down, skips the
      offer and counts it (``skips[reason]``): the cluster never fails or slows a store.
    - read-through: a short lookup asks ``holds`` (one batched existence check) for the entries
      the pool and the disk lack, then ``read_batch`` gets them straight into fresh pool entries
      (``daemon/tiers/promotion.py``), within ``--cluster-lookup-timeout-ms`` for the whole lookup.

Value format and trust (``daemon/tiers/cluster_value.py``)
    Key ``hkvd/2/<fingerprint hex>/<group>/<chunk key hex>``; value: a 92-byte header (kind,
    group, payload size, key, parent, the id of the fleet key that sealed it, and a MAC of all that
    and the payload under that key), then the payload in pool order. Every read checks the value's
    size, the header and the MAC after the bytes land in the pool; a value that fails (one written
    under a key this node does not hold included) is a miss (``corrupt[reason]``), removed from the
    cluster, never served. The keys are swapped whole on SIGHUP (``set_keys``).

Faults
    Calls to a master that is down take Mooncake's RPC timeout (about 4 s). A monitor thread asks
    ``health_check()`` (no RPC) every ``HEALTH_EVERY_S``; while the master is unreachable the tier
    is not ``usable()``: lookups skip it and offers are skipped, both counted. Mooncake reconnects
    to a restarted master on its own (its client re-mounts its segment); a client that cannot
    start (master down at start-up, ~90 s of Mooncake's own retries) is retried every
    ``RECONNECT_S``. Nothing the cluster does makes a request fail: errors are counted
    (``errors[op]``) and the lookup goes on with the pool and the disk.

    A master restart loses its metadata: what was stored before is gone, what is stored after hits
    again. Values live in the nodes' segments: a node that leaves takes its segment with it, so
    ``--cluster-replicas 2`` keeps a copy on a second node.

Threading
    ``hkvd-cluster-conn`` (set-up, health, reconnect), ``hkvd-cluster-put`` (write-behind), and
    ``read_threads`` readers (existence checks and gets). Counters are each written by one thread,
    or under ``_lock``. The Mooncake client object is shared by these threads (it is thread-safe).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar
from urllib.parse import urlsplit

from hkvd.daemon.cache import EntryKey, Extent
from hkvd.daemon.integrity.checksums import checksum
from hkvd.daemon.metrics import RateWindow
from hkvd.daemon.startup_errors import StartupError
from hkvd.daemon.tiers.cluster_value import FleetKeys, FleetKeyStats, value_key
from hkvd.daemon.tiers.contract import Source, Tier
from hkvd.daemon.tiers.disk_format import HEADER_BYTES, FormatError, Header
from hkvd.daemon.tiers.write_queue import WriteJob, WriteQueue
from hkvd.transport.stat_fields import metric, part, status_only

log = logging.getLogger("hkvd.cluster")

HEALTH_EVERY_S = 0.5
RECONNECT_S = 5.0
PUT_BATCH = 32  # entries per batch put (one master round trip for the batch)
SLOT_BYTES = 128  # one header's slot in a registered header slab (92 bytes, rounded up)
READ_SLOTS = 256  # headers one read_batch call can take at once; larger batches go in parts
ERROR_LOG_EVERY_S = 60.0
# Mooncake error codes (mooncake-store/include/types.h) that are a miss, not an error.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705  # a put of a key another node put first: the cluster keeps the first
NO_AVAILABLE_HANDLE = -200  # a put the cluster has no room for: skipped, not an error
SIZE_MISMATCH = (-600, -800)  # the buffer is too small / the transfer failed on a size mismatch


T = TypeVar("T")


class MooncakeStore(Protocol):
    """The part of Mooncake's ``MooncakeDistributedStore`` this tier calls (mooncake.store 0.3.13), so
    the tier is typed without the package (an optional extra). Return codes are Mooncake's: 0 ok,
    negative an error (the constants above); ``batch_*`` answer one code per key (``batch_is_exist``:
    1 held, 0 not, negative an error; the gets: the bytes read)."""

    def setup(self, local_hostname: str, metadata_server: str, global_segment_size: int,
              local_buffer_size: int, protocol: str, rdma_devices: str, master_server_addr: str) -> int: ...

    def register_buffer(self, addr: int, size: int) -> int: ...

    def health_check(self) -> int: ...

    def batch_put_from_multi_buffers(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                                     config: object) -> list[int]: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_get_into_multi_buffers(self, keys: list[str], ptrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[int]: ...

    def remove(self, key: str, force: bool) -> int: ...

    def close(self) -> None: ...


class ClusterHandle(NamedTuple):
    """The cluster tier's ``Source.handle``: what the value read back must be (checked in ``_check``)."""

    nbytes: int
    kind: str
    parent: bytes


class ClusterTierError(StartupError, OSError):
    """The cluster tier cannot start (Mooncake missing, bad --cluster); the message names the fix."""


class ClusterMiss(Exception):
    """The cluster did not give the entry (gone since the existence check, or a failed call)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_address(url: str) -> tuple[str, int]:
    """``mooncake://HOST:PORT`` -> (host, port); raises ``ClusterTierError`` naming the fix."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "mooncake" or not parts.hostname or not port or parts.path not in ("", "/"):
        raise ClusterTierError(f"--cluster {url!r}: expected mooncake://MASTER_HOST:PORT (the mooncake_master's "
                               "--rpc_port, e.g. mooncake://10.0.0.5:50051)")
    return parts.hostname, port


def local_address(master: tuple[str, int]) -> str:
    """The address other nodes reach this one at: the one this host uses to reach the master."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(master)  # UDP: sends nothing, only picks the route
        return str(s.getsockname()[0])


def load_mooncake() -> Callable[[], MooncakeStore]:
    """The Mooncake store class; raises ``ClusterTierError`` naming the install step."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        if "libibverbs" in str(e):
            raise ClusterTierError(f"--cluster: Mooncake needs the OS package libibverbs1, even over TCP ({e}); "
                                   "install it (`apt-get install -y libibverbs1`)") from None
        raise ClusterTierError(f"--cluster needs Mooncake ({e}): pip install 'hkvd[cluster]' (on a CPU machine it "
                               "installs mooncake-transfer-engine-non-cuda), or leave --cluster unset") from None
    store_class: Callable[[], MooncakeStore] = MooncakeDistributedStore
    return store_class


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    master: str  # mooncake://HOST:PORT
    segment_bytes: int  # memory this node contributes to the cluster
    protocol: str = "tcp"
    devices: str = ""  # RDMA device names (protocol rdma)
    local_host: str = ""  # empty: the address this host reaches the master from
    replicas: int = 1
    lookup_timeout_s: float = 0.2
    queue_bytes: int = 64 << 20
    queue_entries: int = 4096
    read_threads: int = 2


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """The cluster tier (``hkvd status``: ``cluster``, the fleet key's fields among the rest; /metrics:
    ``hkvd_cluster_*``)."""

    master: str = status_only()
    connected: bool = metric("hkvd_cluster_connected", "1 while the cluster's master answers")
    protocol: str = status_only()
    keys: FleetKeyStats = part(flatten=True)
    segment_bytes: int = status_only()
    replicas: int = status_only()
    queued: int = metric("hkvd_cluster_queued_entries", "Entries waiting in the cluster write-behind queue")
    queued_bytes: int = status_only()
    puts: int = metric("hkvd_cluster_puts", "Entries put in the cluster (write-behind)", "counter")
    put_bytes: int = metric("hkvd_cluster_put_bytes", "Bytes put in the cluster (headers included)", "counter")
    gets: int = metric("hkvd_cluster_gets", "Entries read from the cluster and verified", "counter")
    get_bytes: int = metric("hkvd_cluster_get_bytes", "Payload bytes read from the cluster", "counter")
    probes: int = status_only()
    probe_keys: int = status_only()
    probe_hits: int = status_only()
    misses: int = metric("hkvd_cluster_misses", "Entries a lookup asked the cluster for that it did not hold",
                         "counter")
    reconnects: int = metric("hkvd_cluster_reconnects", "Times the master became reachable again after an outage",
                             "counter")
    skips: dict[str, int] = metric("hkvd_cluster_skips", "Offers not put in the cluster (queue_full, unavailable, "
                                   "cluster_full, busy), by reason", "counter", key="reason")
    errors: dict[str, int] = metric("hkvd_cluster_errors", "Cluster calls that failed (connect, exist, put, get), by "
                                    "operation", "counter", key="reason")
    corrupt: dict[str, int] = metric("hkvd_cluster_corrupt", "Cluster values found unusable (mac: not sealed with a "
                                     "fleet key this node holds, or damaged; size, header) and removed, by reason",
                                     "counter", key="reason")
    put_gbps: float = metric("hkvd_cluster_put_gbps", "Cluster put throughput, last 64 batches")
    get_gbps: float = metric("hkvd_cluster_get_gbps", "Cluster get throughput, last 64 batches")


class ClusterTier(Tier[ClusterStats]):
    """See the module docstring. ``buffer`` is the pool's memoryview and ``base_addr`` its address
    (entries' extents index both)."""

    name = "cluster"
    label = "cluster tier"

    def __init__(self, settings: ClusterSettings, keys: FleetKeys, buffer: memoryview, base_addr: int) -> None:
        self.settings = settings
        self.keys = keys  # replaced whole by set_keys (SIGHUP); each put or check reads it once
        self.master = parse_address(settings.master)
        self.store_class = load_mooncake()
        self.buffer = buffer
        self.base_addr = base_addr
        self.size = len(buffer)
        self.budget_s = settings.lookup_timeout_s
        self.read_threads = settings.read_threads
        self.executor = ThreadPoolExecutor(max_workers=settings.read_threads, thread_name_prefix="hkvd-cluster-read")
        self._store: MooncakeStore | None = None  # set up by the connect thread; None while down
        self.connected = False  # set up and the master answering (health_check)
        self._joined = False  # connected once: later connections count as reconnects
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue = WriteQueue(settings.queue_entries, settings.queue_bytes)
        self._putting = 0
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._calls_running = 0
        # Header slabs: registered memory the headers go out of and come back into. One for the writer,
        # one per reader thread (handed out through _free_slabs).
        self._put_slab = ctypes.create_string_buffer(PUT_BATCH * SLOT_BYTES)
        self._read_slabs = [ctypes.create_string_buffer(READ_SLOTS * SLOT_BYTES) for _ in range(settings.read_threads)]
        self._free_slabs: collections.deque[ctypes.Array[ctypes.c_char]] = collections.deque(self._read_slabs)
        self.put_rate = RateWindow()
        self.get_rate = RateWindow()
        # counters (under _lock, or one thread's own)
        self.puts = self.put_bytes = 0
        self.gets = self.get_bytes = 0
        self.probes = self.probe_keys = self.probe_hits = 0
        self.misses = 0
        self.reconnects = 0
        self.skips: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self._last_error_log = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for target, name in ((self._connect_loop, "hkvd-cluster-conn"), (self._write_loop, "hkvd-cluster-put")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _connect(self) -> MooncakeStore | None:
        """A set-up Mooncake client with the pool and the header slabs registered, or None."""
        s = self.settings
        host = s.local_host or local_address(self.master)
        store = self.store_class()
        rc = store.setup(host, "P2PHANDSHAKE", s.segment_bytes, 0, s.protocol, s.devices,
                         f"{self.master[0]}:{self.master[1]}")
        if rc != 0:
            with contextlib.suppress(Exception):
                store.close()
            return None
        for addr, size in ((self.base_addr, self.size), *((ctypes.addressof(b), len(b)) for b in
                                                         (self._put_slab, *self._read_slabs))):
            if (rc := store.register_buffer(addr, size)) != 0:
                log.warning("cluster tier: registering %d bytes with Mooncake failed (%d)", size, rc)
                with contextlib.suppress(Exception):
                    store.close()
                return None
        log.info("cluster tier: joined %s as %s (%s, %d MiB segment, %d replicas)", s.master, host, s.protocol,
                 s.segment_bytes >> 20, s.replicas)
        return store

    def _connect_loop(self) -> None:
        while not self._stopping.is_set():
            if self._store is None:
                try:
                    self._store = self._connect()
                except Exception as e:  # a Mooncake failure must not end the thread
                    log.warning("cluster tier: cannot join %s: %s", self.settings.master, e)
                if self._store is None:
                    self._count(self.errors, "connect")
                    log.warning("cluster tier: cannot join %s; serving from this node's tiers, retrying in %.0f s",
                                self.settings.master, RECONNECT_S)
                    self._stopping.wait(RECONNECT_S)
                    continue
            store = self._store
            if store is None:  # close() took it meanwhile
                continue
            health = store.health_check()  # 0 healthy, 1 closed, 2 master unreachable; no RPC
            if (health == 0) != self.connected:
                self.connected = health == 0
                if self.connected and self._joined:
                    self.reconnects += 1
                self._joined = True
                log.warning("cluster tier: %s", "master reachable again; using the cluster" if self.connected else
                            "master unreachable; serving from this node's tiers until it is back")
            if health == 1:  # the client closed itself: start a new one
                self._store = None
                continue
            self._stopping.wait(HEALTH_EVERY_S)

    def usable(self) -> bool:
        return self.connected and not self._stopping.is_set()

    def close(self, timeout_s: float) -> int:
        """Stop the writer after its batch; return how many queued entries were not put (their
        ``done`` still runs). Closes the Mooncake client unless a call still runs. Blocking."""
        with self._cond:
            dropped = self._queue.drain()
            self._stopping.set()
            self._cond.notify_all()
        for job in dropped:
            self._notify(job.done)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        self.executor.shutdown(wait=False)
        self.connected = False
        if self._store is not None and not self.busy():
            with contextlib.suppress(Exception):
                self._store.close()
            self._store = None
        return len(dropped)

    def busy(self) -> bool:
        """A Mooncake call may still move bytes into or out of the pool."""
        return self._calls_running > 0 or any(t.is_alive() for t in self._threads if t.name == "hkvd-cluster-put")

    # ---- write-behind ------------------------------------------------------------------------
    def offer(self, key: EntryKey, kind: str, nbytes: int, parent: bytes, extents: Sequence[Extent],
              done: Callable[[], None]) -> bool:
        with self._lock:
            if self._stopping.is_set() or key in self._queue:
                return False
            if not self.connected:
                self.skips["unavailable"] = self.skips.get("unavailable", 0) + 1
                return False
            if not self._queue.has_room(nbytes):
                self.skips["queue_full"] = self.skips.get("queue_full", 0) + 1
                return False
            self._queue.push(WriteJob(key, kind, nbytes, parent, tuple(extents), done))
            self._cond.notify()
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + self._putting

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping.is_set():
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.take(PUT_BATCH)
                self._putting = len(batch)
            try:
                self._put(batch)
            except Exception as e:  # a failing cluster must not stop the writer
                self._count(self.errors, "put", len(batch))
                self._log_error("put", e)
            finally:
                with self._lock:
                    for job in batch:
                        self._queue.finished(job)
                    self._putting = 0
                for job in batch:
                    self._notify(job.done)

    def _put(self, batch: list[WriteJob]) -> None:
        store = self._store
        if store is None or not self.connected:
            self._count(self.skips, "unavailable", len(batch))
            return
        from mooncake.store import ReplicateConfig

        t0 = time.perf_counter()
        slab = ctypes.addressof(self._put_slab)
        names, ptrs, sizes = [], [], []
        keys = self.keys
        batch = self._intact(batch)
        if not batch:
            return
        for i, job in enumerate(batch):
            fp, gid, ck = job.key
            header = keys.seal(Header(fp, gid, ck, job.kind, job.nbytes, 0, job.parent), self._views(job.extents))
            ctypes.memmove(slab + i * SLOT_BYTES, header, HEADER_BYTES)
            names.append(value_key(job.key))
            ptrs.append([slab + i * SLOT_BYTES, *(self.base_addr + off for off, _ in job.extents)])
            sizes.append([HEADER_BYTES, *(length for _, length in job.extents)])
        cfg = ReplicateConfig()
        cfg.replica_num = self.settings.replicas
        results = self._call(store.batch_put_from_multi_buffers, names, ptrs, sizes, cfg)
        nbytes = 0
        put: list[EntryKey] = []
        for job, rc in zip(batch, results, strict=True):
            if rc in (0, OBJECT_ALREADY_EXISTS):
                self.puts += 1
                nbytes += HEADER_BYTES + job.nbytes
                put.append(job.key)
            elif rc == NO_AVAILABLE_HANDLE:
                self._count(self.skips, "cluster_full")
            else:
                self._count(self.errors, "put")
                self._log_error("put", OSError(errno.EIO, f"Mooncake error {rc} for {value_key(job.key)}"))
        self.put_bytes += nbytes
        if nbytes:
            self.put_rate.add(nbytes, time.perf_counter() - t0)
        if put:
            self._changed(put, True)

    def _intact(self, batch: list[WriteJob]) -> list[WriteJob]:
        """The jobs whose pool bytes still match their entry's checksum (or have none yet); the others
        are reported (their entries leave the pool) and not put."""
        checks = self.checks
        if checks is None:
            return batch
        out = []
        for job in batch:
            if (want := checks.expected(job.key)) and (found := checksum(self.buffer, job.extents)) != want:
                checks.report(job.key, "cluster_put", found)
            else:
                out.append(job)
        return out

    # ---- read-through (daemon/tiers/promotion.py) --------------------------------------------
    async def holds(self, keys: Sequence[EntryKey]) -> set[EntryKey]:
        if self._calls_running >= self.read_threads:  # earlier lookups' calls still hang: do not queue behind
            self._count(self.skips, "busy")
            return set()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._exist, list(keys))

    def _exist(self, keys: list[EntryKey]) -> set[EntryKey]:
        store = self._store
        if store is None or not self.connected:
            return set()
        try:
            results = self._call(store.batch_is_exist, [value_key(k) for k in keys])
        except Exception as e:
            self._count(self.errors, "exist")
            self._log_error("existence check", e)
            return set()
        held = {k for k, rc in zip(keys, results, strict=True) if rc == 1}
        if any(rc < 0 for rc in results):
            self._count(self.errors, "exist")
        gone = [k for k, rc in zip(keys, results, strict=True) if rc == 0]
        if gone:  # some may be values this node put that the cluster evicted since
            self._changed(gone, False)
        with self._lock:
            self.probes += 1
            self.probe_keys += len(keys)
            self.probe_hits += len(held)
            self.misses += len(keys) - len(held)
        return held

    def source(self, key: EntryKey, nbytes: int, kind: str, parent: bytes) -> Source | str:
        return Source(ClusterHandle(nbytes, kind, parent), parent)

    def read_batch(self, jobs: Sequence[tuple[EntryKey, object, Sequence[Extent]]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for i in range(0, len(jobs), READ_SLOTS):
            out.extend(self._read_part(jobs[i:i + READ_SLOTS]))
        return out

    def _read_part(self, jobs: Sequence[tuple[EntryKey, object, Sequence[Extent]]]) -> list[BaseException | None]:
        store = self._store
        if store is None:
            return [ClusterMiss("unavailable", "the cluster tier is not connected")] * len(jobs)
        with self._lock:
            slab_buf = self._free_slabs.popleft()  # one per reader thread: never empty here
        try:
            t0 = time.perf_counter()
            slab = ctypes.addressof(slab_buf)
            keys = [value_key(k) for k, _h, _e in jobs]
            ptrs = [[slab + i * SLOT_BYTES, *(self.base_addr + off for off, _ in ext)]
                    for i, (_k, _h, ext) in enumerate(jobs)]
            sizes = [[HEADER_BYTES, *(length for _, length in ext)] for _k, _h, ext in jobs]
            try:
                results = self._call(store.batch_get_into_multi_buffers, keys, ptrs, sizes)
            except Exception as e:
                self._count(self.errors, "get", len(jobs))
                self._log_error("get", e)
                return [ClusterMiss("io", f"Mooncake get failed: {e}")] * len(jobs)
            out: list[BaseException | None] = []
            nbytes = 0
            for i, ((key, handle, ext), rc) in enumerate(zip(jobs, results, strict=True)):
                err = self._check(key, handle, ext, rc, slab + i * SLOT_BYTES)
                out.append(err)
                if err is None:  # the value's payload filled the extents exactly (_check)
                    nbytes += sum(length for _, length in ext)
            with self._lock:
                self.gets += sum(e is None for e in out)
                self.get_bytes += nbytes
            if nbytes:
                self.get_rate.add(nbytes, time.perf_counter() - t0)
            return out
        finally:
            with self._lock:
                self._free_slabs.append(slab_buf)

    def _check(self, key: EntryKey, handle: object, extents: Sequence[Extent], rc: int,
               slot: int) -> BaseException | None:
        """None if value ``rc`` bytes long, now in ``slot`` + ``extents``, is the entry ``key``; else why not."""
        if not isinstance(handle, ClusterHandle):  # the handle source() gave is a ClusterHandle
            return TypeError(f"cluster tier: a {type(handle).__name__} is no cluster-tier handle")
        nbytes, kind, parent = handle
        if rc == OBJECT_NOT_FOUND:
            self._count_miss()
            self._changed([key], False)
            return ClusterMiss("gone", f"{value_key(key)} left the cluster since the existence check")
        try:
            if rc in SIZE_MISMATCH or (rc >= 0 and rc != HEADER_BYTES + nbytes):
                raise FormatError("size", f"the value is not {HEADER_BYTES + nbytes} bytes (Mooncake: {rc})")
            if rc < 0:
                self._count(self.errors, "get")
                return ClusterMiss("io", f"Mooncake error {rc} reading {value_key(key)}")
            header = self.keys.open(ctypes.string_at(slot, HEADER_BYTES), lambda: self._views(extents))
            if header.key != key or header.nbytes != nbytes or header.kind != kind:
                raise FormatError("header", "the value's header names another entry or layout")
            if header.parent not in (b"", parent):
                raise FormatError("header", "the value's header names another parent chunk")
        except FormatError as e:
            self._count(self.corrupt, e.reason)
            log.warning("cluster tier: %s is unusable (%s): removed, never served", value_key(key), e)
            store = self._store
            if store is not None:  # force: the get just took a lease on it, which a plain remove waits out
                with contextlib.suppress(Exception):
                    store.remove(value_key(key), True)
            self._changed([key], False)
            return e
        return None

    # ---- helpers -----------------------------------------------------------------------------
    def set_keys(self, keys: FleetKeys) -> None:
        """Seal later puts with ``keys.current`` and accept values under ``keys`` from now on (SIGHUP)."""
        self.keys = keys

    def _views(self, extents: Sequence[Extent]) -> Iterator[memoryview]:
        """The pool bytes of ``extents``, in order (each view released once the next is asked for)."""
        for off, length in extents:
            with self.buffer[off:off + length] as mv:
                yield mv

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            self._calls_running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._calls_running -= 1

    def _count(self, counts: dict[str, int], reason: str, n: int = 1) -> None:
        with self._lock:
            counts[reason] = counts.get(reason, 0) + n

    def _count_miss(self) -> None:
        with self._lock:
            self.misses += 1

    def _log_error(self, what: str, e: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.warning("cluster tier: %s failed (%s); the node serves from its own tiers (further errors are only "
                        "counted for %.0f s)", what, e, ERROR_LOG_EVERY_S)

    def _notify(self, done: Callable[[], None]) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to unpin
            self._loop.call_soon_threadsafe(done)

    def _changed(self, keys: list[EntryKey], present: bool) -> None:
        """Tell ``listener`` (on the loop) that this node put ``keys`` or saw them gone or removed."""
        listener = self.listener
        if listener is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(listener, keys, present)

    def statistics(self) -> ClusterStats:
        with self._lock:
            return ClusterStats(
                master=self.settings.master, connected=self.connected, protocol=self.settings.protocol,
                keys=self.keys.statistics(), segment_bytes=self.settings.segment_bytes,
                replicas=self.settings.replicas, queued=len(self._queue) + self._putting,
                queued_bytes=self._queue.bytes, puts=self.puts, put_bytes=self.put_bytes, gets=self.gets,
                get_bytes=self.get_bytes, probes=self.probes, probe_keys=self.probe_keys, probe_hits=self.probe_hits,
                misses=self.misses, reconnects=self.reconnects, skips=dict(self.skips), errors=dict(self.errors),
                corrupt=dict(self.corrupt), put_gbps=self.put_rate.gbps(), get_gbps=self.get_rate.gbps(),
            )
