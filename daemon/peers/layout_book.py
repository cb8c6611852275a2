"""The layouts of engines seen by this daemon, kept after they leave, for peer links.

Role
    A serving daemon answers a peer's lookup with the hybrid hit rule and entry sizes of the
    layout (fingerprint) asked for. ``LayoutBook`` keeps them by fingerprint, up to
    ``MAX_LAYOUTS``, after the engine that registered them leaves, so a finished prefill engine's
    entries can still be served.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hkvd.daemon.cache import GroupRule
from hkvd.daemon.engines.registry import EngineState, Registry

MAX_LAYOUTS = 64


@dataclass(frozen=True, slots=True)
class Layout:
    """What a peer needs to serve or verify one layout (an engine format, by fingerprint)."""

    fingerprint: bytes
    chunk_size: int
    rules: tuple[GroupRule, ...]
    kinds: dict[int, str]
    entry_bytes: dict[int, int]

    @classmethod
    def of(cls, engine: EngineState) -> Layout:
        return cls(engine.fingerprint, engine.chunk_size, tuple(engine.rules),
                   dict(engine.kinds), dict(engine.entry_bytes))


class LayoutBook:
    """Layouts of engines registered here, kept (up to ``MAX_LAYOUTS``) after they leave."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._known: OrderedDict[bytes, Layout] = OrderedDict()

    def add(self, engine: EngineState) -> None:
        """Called at every registration (``KVService``), so a layout outlives its engine."""
        if engine.fingerprint not in self._known:
            self._known[engine.fingerprint] = Layout.of(engine)
        self._known.move_to_end(engine.fingerprint)
        while len(self._known) > MAX_LAYOUTS:
            self._known.popitem(last=False)

    def refresh(self) -> None:
        for e in self.registry.engines():
            self.add(e)

    def get(self, fingerprint: bytes) -> Layout | None:
        self.refresh()
        return self._known.get(fingerprint)

    def fingerprints(self) -> list[bytes]:
        self.refresh()
        return list(self._known)
