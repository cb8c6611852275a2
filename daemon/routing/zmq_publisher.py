"""The node-level KV event publisher: a ZMQ PUB socket and a ROUTER replay socket, on one thread.

Protocol (what vLLM's ``ZmqEventPublisher`` speaks, so its subscribers work unchanged)
    - PUB: each batch is a three-part message ``(topic, seq, payload)``: ``seq`` is the batch's
      sequence number as 8 bytes big-endian, ``payload`` the msgpack ``KVEventBatch``
      (``hkvd.daemon.routing.kv_events``). A subscriber that sees a gap in ``seq`` missed batches.
    - ROUTER (replay): a subscriber (a DEALER, or a REQ for the first batch only) sends
      ``(b"", start_seq)`` with ``start_seq`` 8 bytes big-endian; it gets
      ``(b"", topic, seq, payload)`` for each kept batch numbered ``start_seq`` or later, oldest
      first, then ``(b"", b"", END, b"")`` with ``END`` = -1 as 8 bytes big-endian (signed).
      The last ``buffer_batches`` batches are kept.

Threading
    ``submit`` runs on the event loop and never blocks: it puts the batch in a bounded queue, or
    counts it dropped when the queue is full (the thread is stuck). One thread owns both sockets:
    it sends queued batches, keeps the replay ring and answers replay requests, waking every
    ``POLL_S`` at most. The sockets are bound in ``start`` on the caller's thread, so a bad or
    busy endpoint fails the daemon's start-up, and handed to the thread, which alone uses them
    from then on.

Lifecycle
    ``start()`` binds and starts the thread; ``close(timeout_s)`` sends what is queued (within the
    timeout), stops the thread and closes the sockets. Idempotent.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from hkvd.daemon.routing.kv_events import Batch
from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.stat_fields import status_only

log = logging.getLogger("hkvd.routing")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.02  # the longest a replay request waits for the thread (it also sends within this)
DEFAULT_QUEUE_BATCHES = 100_000
DEFAULT_HWM = 100_000  # messages a slow subscriber may fall behind before ZMQ drops for it


class PublisherError(StartupError):
    """An endpoint cannot be bound; the message names the option and the fix."""

    exit_code = 2


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """The node-wide KV-event publisher (``hkvd status``: ``kv_events.publisher``)."""

    endpoint: str = status_only()  # as bound (tcp port 0 resolved)
    replay_endpoint: str = status_only()
    sent: int = status_only()
    dropped: int = status_only()  # batches not queued (queue full, closing)
    send_errors: int = status_only()
    queued: int = status_only()
    replays: int = status_only()
    replayed_batches: int = status_only()
    kept: int = status_only()  # batches kept for replay


class ZmqPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str = "", *, buffer_batches: int = 10_000,
                 queue_batches: int = DEFAULT_QUEUE_BATCHES, hwm: int = DEFAULT_HWM) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.buffer_batches = max(buffer_batches, 1)
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=max(queue_batches, 1))
        self._ring: collections.deque[Batch] = collections.deque(maxlen=self.buffer_batches)
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._hwm = hwm
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # counters: dropped on the loop; the rest on the thread
        self.dropped = 0
        self.sent = 0
        self.send_errors = 0
        self.replays = 0
        self.replayed = 0
        self.bound = ""  # the PUB endpoint as bound (tcp port 0 resolved)
        self.replay_bound = ""

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self._hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.bound = _bind(self._pub, self.endpoint, "--kv-events-endpoint")
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_bound = _bind(self._replay, self.replay_endpoint, "--kv-events-replay-endpoint")
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="hkvd-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s", self.bound,
                 f", replay on {self.replay_bound}" if self.replay_bound else "")

    def close(self, timeout_s: float = 1.0) -> None:
        """Blocking (run it on a thread): send what is queued within ``timeout_s``, then stop."""
        if self._thread is not None:
            self._stopping.set()
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("KV events: the publisher thread did not stop within %.1f s", timeout_s)
                return  # it still owns the sockets; they go with the process
            self._thread = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---- event loop side -----------------------------------------------------------------------
    def submit(self, batch: Batch) -> bool:
        """Queue ``batch`` for sending (before ``start`` too); never blocks. False: dropped and counted (the
        queue is full, or the publisher is closing)."""
        if self._stopping.is_set():
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def statistics(self) -> PublisherStats:
        return PublisherStats(endpoint=self.bound, replay_endpoint=self.replay_bound, sent=self.sent,
                              dropped=self.dropped, send_errors=self.send_errors, queued=self._queue.qsize(),
                              replays=self.replays, replayed_batches=self.replayed, kept=len(self._ring))

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._send_queued(wait_s=POLL_S):
                return
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as e:
                    log.warning("KV events: replay request failed: %s", e)

    def _send_queued(self, wait_s: float) -> bool:
        """Send every queued batch, waiting up to ``wait_s`` for the first; True once the stop sentinel came."""
        try:
            batch = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return False
        while True:
            if batch is None:
                return True
            try:
                self._pub.send_multipart((batch.topic, batch.seq.to_bytes(8, "big"), batch.payload), copy=False)
                self.sent += 1
            except zmq.ZMQError as e:  # PUB never blocks (it drops at the high-water mark): a real fault
                self.send_errors += 1
                log.warning("KV events: sending batch %d failed: %s", batch.seq, e)
            self._ring.append(batch)
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return False

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.debug("KV events: ignoring a replay request of %d parts", len(frames))
            return
        # What was queued before the request arrived is part of the answer.
        if self._send_queued(wait_s=0):
            self._queue.put(None)  # the stop sentinel: seen again by the loop after this answer
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        self.replays += 1
        for batch in list(self._ring):
            if batch.seq >= start_seq:
                self._replay.send_multipart((client, b"", batch.topic, batch.seq.to_bytes(8, "big"), batch.payload))
                self.replayed += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], endpoint: str, flag: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise PublisherError(f"{flag} {endpoint}: cannot bind ({e}); use tcp://127.0.0.1:PORT with a free port, "
                             "tcp://*:PORT to publish to other hosts, or ipc:///run/hkvd/kv-events") from None
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
