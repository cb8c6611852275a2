"""A pool too small for one chunk of an engine is refused at registration, naming the smallest
``--l1-size-gb`` that works; a daemon started with exactly that size serves the engine."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import RegistrationError
from hkvd.transport.keys import chunk_keys

KIB = 1024
BLOCK = 16
CHUNK = 4 * BLOCK
# Four entry sizes, one hybrid chunk of 5.2 MiB: full attention 2 MiB, sliding window 1.5 MiB,
# Mamba states of 1.25 MiB and 400 KiB. In 2 MiB superblocks each size takes its own: 8 MiB.
SHAPES = [GroupShape("full", 2, 256 * KIB), GroupShape("swa", 2, 192 * KIB, window_tokens=2 * BLOCK),
          GroupShape("mamba", 2, 640 * KIB), GroupShape("mamba", 2, 200 * KIB)]
KW = {"num_blocks": 6, "tokens_per_block": BLOCK, "chunk_size": CHUNK}
TOO_SMALL_GB = "0.00390625"  # 4 MiB


def test_too_small_pool_names_the_smallest_size_that_works(daemon_factory) -> None:
    small = daemon_factory("--l1-size-gb", TOO_SMALL_GB, "--chunk-size", str(CHUNK), name="small")
    with pytest.raises(RegistrationError, match=r"--l1-size-gb \S+ or more") as refused:
        SyntheticEngine(small.socket_path, SHAPES, **KW)
    match = re.search(r"--l1-size-gb (\S+) or more", str(refused.value))
    assert match is not None
    smallest = match.group(1)
    assert float(smallest) * (1 << 30) == 8 << 20, str(refused.value)
    assert small.status()["engines"] == []  # nothing stayed registered

    fits = daemon_factory("--l1-size-gb", smallest, "--chunk-size", str(CHUNK), name="fits")
    eng = SyntheticEngine(fits.socket_path, SHAPES, **KW)
    try:
        key = chunk_keys(prompt_tokens(CHUNK, seed=5), CHUNK)
        items = [eng.items(gid, key, first_block=1)[0] for gid in range(len(SHAPES))]
        for it in items:
            eng.fill_random(it.group_id, it.block_ids, seed=10 + it.group_id)
        stored = {it.group_id: b"".join(eng.block_bytes(it.group_id, b) for b in it.block_ids) for it in items}
        assert eng.store(items).result.stored == len(SHAPES)
        for it in items:
            eng.zero(it.group_id, it.block_ids)
        eng.retrieve(items)
        for it in items:
            got = b"".join(eng.block_bytes(it.group_id, b) for b in it.block_ids)
            assert got == stored[it.group_id], f"group {it.group_id} came back different"
            assert np.frombuffer(got, dtype=np.int8).any()
    finally:
        eng.close()
