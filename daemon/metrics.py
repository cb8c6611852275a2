"""Counters and gauges the daemon keeps; exported by ``hkvd status`` and the metrics endpoint.

Plain dictionaries on the event loop (no locks needed): ``inc(name, **labels)``. Throughput is a
``RateWindow`` per name and labels: the bytes and seconds of the last ``RATE_WINDOW`` transfers,
read as GB/s (``observe_rate``, ``rate``). The Prometheus exporter (``hkvd.daemon.http``) reads
``snapshot()`` and ``rates()``; nothing here imports prometheus_client.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

LabelKey = tuple[tuple[str, str], ...]
RATE_WINDOW = 64


class RateWindow:
    """Bytes and seconds of the last ``size`` transfers; ``gbps()`` is their total bytes over their
    total seconds (1e9 bytes per second), 0.0 before the first. Thread-safe (disk threads add)."""

    def __init__(self, size: int = RATE_WINDOW) -> None:
        self._items: deque[tuple[int, float]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._items.append((nbytes, seconds))

    def gbps(self) -> float:
        with self._lock:
            nbytes = sum(b for b, _ in self._items)
            seconds = sum(s for _, s in self._items)
        return nbytes / seconds / 1e9 if seconds > 0 else 0.0


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[LabelKey, float]] = defaultdict(lambda: defaultdict(float))
        self._rates: dict[str, dict[LabelKey, RateWindow]] = defaultdict(dict)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += value

    def get(self, name: str, **labels: str) -> float:
        return self.counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def total(self, name: str) -> float:
        return sum(self.counters.get(name, {}).values())

    def snapshot(self) -> dict[str, dict[LabelKey, float]]:
        return {k: dict(v) for k, v in self.counters.items()}

    def observe_rate(self, name: str, nbytes: int, seconds: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        window = self._rates[name].get(key)
        if window is None:
            window = self._rates[name][key] = RateWindow()
        window.add(nbytes, seconds)

    def rate(self, name: str, **labels: str) -> float:
        window = self._rates.get(name, {}).get(tuple(sorted(labels.items())))
        return window.gbps() if window is not None else 0.0

    def rates(self) -> dict[str, dict[LabelKey, float]]:
        return {name: {k: w.gbps() for k, w in series.items()} for name, series in self._rates.items()}
