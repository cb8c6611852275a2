"""What recomputing an entry would cost the engine: the value per byte the ``cost`` eviction policy weighs.

The model (docs/design.md, "What is kept"): a formula, not a measurement. Units are attention
token-pairs (one query token against one key token, in every attention layer); the per-token linear work
(projections, MLP, the Mamba/GDN scan) is ``LINEAR_TOKENS`` such pairs per token.

- An attention chunk at chunk index i, of C tokens: each of its tokens attends to the i*C tokens before the
  chunk and, on average, C/2 inside it: ``C * (i*C + C/2 + k)``.
- A sliding-window chunk: the same, with the attention span capped at the window W:
  ``C * (min(i*C + C/2, W) + k)``. (One that a new prompt's hit ends more than W tokens past is never loaded;
  that shows up as fewer hits on it, which the policy's frequency counts, not here.)
- A Mamba/GDN state at the end of chunk i: a hit that ends there saves the whole prefix, chunks 0..i, which
  nothing else can resume: ``sum_{j<=i} C * (j*C + C/2 + k) = C * (i+1) * ((i+1)*C/2 + k)``.

``LINEAR_TOKENS`` (k) is about 6 x the hidden size for a dense transformer (24 d^2 multiply-adds per token
and layer in the projections and MLP, against 4 d per token pair in attention); registration carries KV
layouts, not the model's width, so k is one constant, 8192 (a hidden size near 1,400). With it, a chunk
8K tokens deep costs about twice one at the start, and the state at that depth about 47 times a first chunk.

An entry whose chunk index is not known (written by a path that does not carry it and whose parent is not
in the pool) is costed as chunk 0: the cheapest, so it is evicted before better-known entries.
"""

from __future__ import annotations

from hkvd.daemon.cache.entry import Entry
from hkvd.daemon.cache.formats import Formats

LINEAR_TOKENS = 8192
DEFAULT_CHUNK = 256  # an engine world no longer in the format record: hkvd serve's default chunk size


def attention_cost(chunk: int, chunk_size: int, window: int = 0, linear: int = LINEAR_TOKENS) -> float:
    """Recomputing an attention chunk at index ``chunk`` (a sliding window of ``window`` tokens where > 0)."""
    span = chunk * chunk_size + chunk_size / 2
    if window > 0:
        span = min(span, window)
    return chunk_size * (span + linear)


def state_cost(chunk: int, chunk_size: int, linear: int = LINEAR_TOKENS) -> float:
    """Recomputing the prefix a Mamba/GDN state at the end of chunk ``chunk`` resumes: chunks 0..chunk."""
    n = chunk + 1
    return chunk_size * n * (n * chunk_size / 2 + linear)


def entry_cost(kind: str, chunk: int, chunk_size: int, window: int = 0, linear: int = LINEAR_TOKENS) -> float:
    """The model's cost of an entry of group ``kind`` at chunk index ``chunk`` (unknown, < 0: as chunk 0)."""
    chunk = max(chunk, 0)
    if kind == "mamba":
        return state_cost(chunk, chunk_size, linear)
    return attention_cost(chunk, chunk_size, window if kind == "swa" else 0, linear)


class RecomputeCost:
    """Entries' costs, with the chunk size and windows of their engine world from ``formats``."""

    def __init__(self, formats: Formats, linear: int = LINEAR_TOKENS) -> None:
        self.formats = formats
        self.linear = linear
        self._shapes: dict[bytes, tuple[int, dict[int, int]]] = {}  # fingerprint -> (chunk size, swa windows)
        self._version = -1

    def _shape(self, fp: bytes) -> tuple[int, dict[int, int]]:
        if self._version != self.formats.version:
            self._shapes.clear()
            self._version = self.formats.version
        shape = self._shapes.get(fp)
        if shape is None:
            world = self.formats.world(fp)
            if world is None:
                return DEFAULT_CHUNK, {}
            shape = self._shapes[fp] = (world.chunk_size,
                                        {r.group_id: r.window_tokens for r in world.rules if r.kind == "swa"})
        return shape

    def __call__(self, e: Entry) -> float:
        chunk_size, windows = self._shape(e.key[0])
        return entry_cost(e.kind, e.chunk, chunk_size, windows.get(e.key[1], 0), self.linear)
