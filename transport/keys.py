"""Chunk keys: a rolling hash over token ids in ``chunk_size`` steps.

key(i) = blake2b-128(key(i-1) || tokens of chunk i as little-endian uint32), key(-1) = 16 zero bytes.
Only full chunks get a key. The same prefix gives the same keys in every process and on every
node, which is what lets a fresh engine (or a peer daemon) hit what another one stored. The layout
fingerprint is *not* mixed in here: the daemon prefixes every index key with the engine's
fingerprint, so keys stay comparable across layouts only where that is safe (never).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)


def chunk_keys(token_ids: Sequence[int], chunk_size: int, *, parent: bytes = ROOT_KEY) -> list[bytes]:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    n_full = len(token_ids) // chunk_size
    if n_full == 0:
        return []
    tokens = np.asarray(token_ids[: n_full * chunk_size], dtype="<u4")
    keys = []
    prev = parent
    for i in range(n_full):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(tokens[i * chunk_size:(i + 1) * chunk_size].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
