"""The layouts of engines seen by this daemon, kept after they leave, for peer links.

Role
    A serving daemon answers a peer's lookup with the hybrid hit rule and entry sizes of the
    layout (fingerprint) asked for. ``LayoutBook`` is the peer view of the cache's record of engine
    formats (``hkvd.daemon.cache.Formats``, fed by the registry): the layouts of the ranks that
    registered here, kept after their engines leave (within the record's bound), so a finished
    prefill engine's entries can still be served; and, for a pulling engine of another TP size of the same
    model, the worlds it may read re-sharded (``other_worlds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hkvd.daemon.cache import Formats, GroupRule, WorldFormat
from hkvd.daemon.engines.registry import Registry
from hkvd.transport.wire.peer import MAX_WORLDS_OFFERED


@dataclass(frozen=True, slots=True)
class Layout:
    """What a peer needs to serve or verify one layout (an engine format, by fingerprint)."""

    fingerprint: bytes
    chunk_size: int
    rules: tuple[GroupRule, ...]
    kinds: dict[int, str]
    entry_bytes: dict[int, int]

    @classmethod
    def of(cls, world: WorldFormat, fingerprint: bytes) -> Layout:
        return cls(fingerprint, world.chunk_size, world.rules, dict(world.kinds), dict(world.entry_bytes))


class LayoutBook:
    """The layouts of the ranks registered here (the registry's ``formats``)."""

    def __init__(self, registry: Registry) -> None:
        self.formats: Formats = registry.formats

    def get(self, fingerprint: bytes) -> Layout | None:
        """The layout of ``fingerprint`` when that rank registered here; None otherwise."""
        w = self.formats.world(fingerprint)
        if w is None or w.rank_of(fingerprint) not in w.ranks:
            return None
        return Layout.of(w, fingerprint)

    def other_worlds(self, model_keys: list[bytes], besides: list[bytes]) -> list[WorldFormat]:
        """This daemon's worlds of the models ``model_keys`` that hold none of the layouts ``besides`` (other TP
        sizes of the pulling engines' models), with a registered rank and a spec to hand over, the most recently
        registered first (``MAX_WORLDS_OFFERED`` at most)."""
        keys, skip = set(model_keys), set(besides)
        out = [w for w in reversed(self.formats.worlds())
               if w.model_key in keys and w.spec is not None and w.ranks and not skip.intersection(w.fingerprints)]
        return out[:MAX_WORLDS_OFFERED]

    def fingerprints(self) -> list[bytes]:
        """Every rank that registered, the least recently registered world first."""
        return [w.fingerprints[r] for w in self.formats.worlds() for r in sorted(w.ranks)]
