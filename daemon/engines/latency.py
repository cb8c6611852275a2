"""Request latency histograms: lookup, store and retrieve, each from the service taking the request to its reply.

Role
    ``Latencies.observe(op, seconds)`` counts one request of ``op`` (``OPS``) in its bucket.
    ``KVService.handle`` times each Lookup, Store and Retrieve from the moment it takes the decoded
    request to the moment its reply (or the error that ends it) is handed to the connection: a lookup
    that waits on the disk or cluster tier and a copy on the thread pool are inside, the time the frame
    spent in the socket or behind earlier frames of its connection is not. ``statistics()`` is a
    ``LatencyStats``: /metrics exports it as one Prometheus histogram family,
    ``hkvd_request_duration_seconds{op}`` (``_bucket{le}``, ``_sum``, ``_count``), buckets ``BOUNDS``
    (50 us to 10 s); ``hkvd status --json`` shows it as ``latency``.

Threading
    Event loop only (the service's), like ``hkvd.daemon.metrics``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hkvd.transport.stat_fields import Sample, Sampler, histogram_samples, metric, status_only

# Upper bounds in seconds: a small lookup answered from the pool takes tens of microseconds, a retrieve
# of a long prefix or a lookup that reads the disk tier up to seconds.
BOUNDS = (5e-05, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
          5.0, 10.0)
OPS = ("lookup", "store", "retrieve")
FAMILY = "hkvd_request_duration_seconds"
HELP = ("Seconds from the daemon taking a request to its reply (or error), by op (lookup, store, retrieve); "
        "disk and cluster reads and copies included")


@dataclass(frozen=True, slots=True)
class HistogramStats:
    """One histogram: cumulative counts per upper bound, and the count and sum of every observation."""

    bounds: tuple[float, ...] = status_only()  # seconds, ascending
    counts: tuple[int, ...] = status_only()  # observations <= each bound (cumulative)
    count: int = status_only()  # every observation (the +Inf bucket)
    sum_seconds: float = status_only()


def _op(op: str) -> Sampler:
    def samples(h: HistogramStats, _owner: object) -> list[Sample]:
        return histogram_samples({"op": op}, h.bounds, h.counts, h.sum_seconds, h.count)
    return samples


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Request latencies (``hkvd status``: ``latency``), one histogram per op."""

    lookup: HistogramStats = metric(FAMILY, HELP, "histogram", samples=_op("lookup"))
    store: HistogramStats = metric(FAMILY, HELP, "histogram", samples=_op("store"))
    retrieve: HistogramStats = metric(FAMILY, HELP, "histogram", samples=_op("retrieve"))


class Histogram:
    """Counts per bucket of ``bounds`` (an observation counts in the first bucket whose bound it does not
    exceed, or only in +Inf), their count and their sum."""

    def __init__(self, bounds: tuple[float, ...] = BOUNDS) -> None:
        self.bounds = bounds
        self._buckets = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self._buckets):
            self._buckets[i] += 1
        self.count += 1
        self.sum += value

    def statistics(self) -> HistogramStats:
        cumulative, n = [], 0
        for b in self._buckets:
            n += b
            cumulative.append(n)
        return HistogramStats(self.bounds, tuple(cumulative), self.count, self.sum)


class Latencies:
    """One ``Histogram`` per op of ``OPS``."""

    def __init__(self) -> None:
        self.histograms = {op: Histogram() for op in OPS}

    def observe(self, op: str, seconds: float) -> None:
        self.histograms[op].observe(seconds)

    def statistics(self) -> LatencyStats:
        return LatencyStats(**{op: h.statistics() for op, h in self.histograms.items()})
