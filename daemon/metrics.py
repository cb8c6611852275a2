"""Counters and gauges the daemon keeps; exported by ``hkvd status`` and the metrics endpoint.

Plain dictionaries on the event loop (no locks needed): ``inc(name, **labels)``. The Prometheus
exporter (``hkvd.daemon.http``) reads ``snapshot()``; nothing here imports prometheus_client.
"""

from __future__ import annotations

from collections import defaultdict

LabelKey = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[LabelKey, float]] = defaultdict(lambda: defaultdict(float))

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += value

    def get(self, name: str, **labels: str) -> float:
        return self.counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def total(self, name: str) -> float:
        return sum(self.counters.get(name, {}).values())

    def snapshot(self) -> dict[str, dict[LabelKey, float]]:
        return {k: dict(v) for k, v in self.counters.items()}
