"""Entry checksums and the scrubber in a real ``hkvd serve``: bytes flipped in its pool (through the pool's
memfd, as a bit flip in RAM would leave them) are found, the entries dropped, and lookups miss them."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from hkvd.daemon.cli import format_status
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import NotFound
from hkvd.transport.keys import chunk_keys

CHUNKS = 6


def _pool_fd(pid: int) -> str:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:hkvd-pool"):
                return f"/proc/{pid}/fd/{fd}"
        except OSError:
            continue
    raise AssertionError(f"no hkvd-pool memfd among the descriptors of process {pid}")


def flip_pool(pid: int) -> None:
    """Invert one bit in every 8 bytes of the daemon's whole pool."""
    path = _pool_fd(pid)
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, mmap.MAP_SHARED) as mm:
            words = np.frombuffer(mm, dtype=np.uint64)
            words ^= np.uint64(1)
            del words


def _stored(daemon) -> tuple[SyntheticEngine, list[bytes], list]:
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, 4096)], num_blocks=64)
    keys = chunk_keys(prompt_tokens(32 * CHUNKS, seed=11), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    eng.fill_random(0, [b for it in items for b in it.block_ids], seed=5)
    assert eng.store(items).result.stored == CHUNKS
    return eng, keys, items


def test_the_scrubber_finds_flipped_pool_bytes_and_the_hit_is_gone(daemon_factory):
    daemon = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "32", "--scrub-rate-mb", "1000")
    eng, keys, _ = _stored(daemon)
    try:
        st = daemon.wait_status(lambda s: s["integrity"]["checksums_taken"] >= CHUNKS, 20)
        assert st["index"]["checksummed"] == CHUNKS and st["index"]["corrupt"] == {}
        hit, lease = eng.lookup(keys)
        assert hit == CHUNKS  # served while intact
        flip_pool(daemon.proc.pid)
        st = daemon.wait_status(lambda s: s["index"]["corrupt"].get("checksum", 0) == CHUNKS, 30)
        assert st["integrity"]["mismatches"] == {"scrub": CHUNKS}
        assert st["integrity"]["scrub_entries"] >= CHUNKS and st["integrity"]["scrub_rate_mb"] == 1000
        assert eng.lookup(keys)[0] == 0  # a miss: the engine recomputes
        with pytest.raises(NotFound):  # a lease taken before the damage serves nothing either
            eng.retrieve(eng.items(0, keys, first_block=30), lease)
        assert "checksum mismatch (scrub)" in Path(daemon.log_path).read_text()
        text = format_status(daemon.status())  # hkvd status
        assert f"{CHUNKS} dropped as damaged (mismatches: {CHUNKS} scrub)" in text
        assert "at <= 1000 MB/s" in text
    finally:
        eng.close()


def test_without_the_scrubber_checksums_are_still_taken_and_nothing_is_scrubbed(daemon_factory):
    daemon = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "32", "--scrub-rate-mb", "0")
    eng, _, _ = _stored(daemon)
    try:
        st = daemon.wait_status(lambda s: s["integrity"]["checksums_taken"] >= CHUNKS, 20)
        assert st["integrity"]["scrub_rate_mb"] == 0 and st["integrity"]["scrub_entries"] == 0
        assert "scrubber off (--scrub-rate-mb 0)" in format_status(st)
    finally:
        eng.close()
