"""Huge pages for real: hugetlb pages reserved by the test, THP for shmem switched to ``advise``.

Each kind runs the whole data path on a real daemon whose pool the kernel backs with 2 MiB pages:
store, retrieve, eviction, the disk tier and a peer pull, byte-exact; ``hkvd status`` and
``/metrics`` report the backing read from the kernel (/proc/PID/smaps), not the kind asked for.
``--hugepages require`` fails with the number of pages to reserve and the command, also when the
pages vanish between the daemon's check and its mapping.

Needs root (CI runs as root); otherwise every test here skips with the reason. Every sysctl changed
is restored in a ``finally``, also when the test fails.
"""

from __future__ import annotations

import http.client
import importlib.util
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hkvd.daemon.cache import pool as pool_mod
from hkvd.daemon.cache.pool import HUGE_PAGE, HugePagePool
from hkvd.daemon.cli import format_status
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import PoolError
from hkvd.transport.keys import chunk_keys

MIB = 1 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
POOL_MIB = 64
# 256 KiB pages x 2 layers x 2 blocks per 32-token chunk: 1 MiB a chunk, so 60 chunks overflow the pool.
SHAPES = [GroupShape("full", 2, 256 * 1024)]
ENGINE_KW: dict[str, Any] = {"num_blocks": 128}
HERE = Path(__file__).resolve().parent


def _peerlib() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hkvd_test_peerlib_hp", HERE.parent / "peer" / "peerlib.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peerlib = _peerlib()


def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to reserve huge pages (/proc/sys/vm/nr_hugepages) and set THP for shmem")


def _free_huge_pages() -> int:
    return pool_mod._meminfo().get("HugePages_Free", 0)


def _hand_back_huge_pages() -> int:
    """Set ``nr_hugepages`` to 0: free pages go at once, pages still mapped (an exiting daemon's) become
    surplus and go once released (waited for, up to 30 s). Returns the pages another process keeps."""
    NR_HUGEPAGES.write_text("0")
    deadline = time.monotonic() + 30
    while pool_mod._meminfo().get("HugePages_Total", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pool_mod._meminfo().get("HugePages_Total", 0)


@pytest.fixture
def reserve_huge_pages() -> Iterator[Callable[[int], int]]:
    """``reserve(n)``: exactly n 2 MiB pages free, whatever was reserved before (pages another process
    keeps stay); returns the new total. The old total comes back after."""
    _root()
    if pool_mod._meminfo().get("Hugepagesize") != HUGE_PAGE:
        pytest.skip("the default huge page size here is not 2 MiB")
    old = NR_HUGEPAGES.read_text().strip()

    def reserve(n: int) -> int:
        want = _hand_back_huge_pages() + n
        deadline = time.monotonic() + 30
        while True:
            NR_HUGEPAGES.write_text(str(want))
            got = int(NR_HUGEPAGES.read_text())
            if got < want:
                pytest.skip(f"the kernel reserved only {got} of {want} huge pages (memory too fragmented)")
            free = _free_huge_pages()
            if free == n:
                return got
            # A process that held pages (an exiting daemon) let them go meanwhile, or one took some.
            assert time.monotonic() < deadline, pool_mod._meminfo()
            want -= free - n

    try:
        yield reserve
    finally:
        # Pages still held by a process that is exiting stay in the pool: retry until they are freed.
        deadline = time.monotonic() + 30
        while True:
            NR_HUGEPAGES.write_text(old)
            if NR_HUGEPAGES.read_text().strip() == old or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert NR_HUGEPAGES.read_text().strip() == old


@pytest.fixture
def thp_advise() -> Iterator[None]:
    """THP for shmem set to ``advise`` (hkvd madvises its pool), restored after."""
    _root()
    if not SHMEM_ENABLED.exists():
        pytest.skip("this kernel has no transparent huge pages")
    text = SHMEM_ENABLED.read_text()
    old = text[text.index("[") + 1 : text.index("]")]
    total = NR_HUGEPAGES.read_text().strip()
    try:
        SHMEM_ENABLED.write_text("advise")
        # Free hugetlb pages would back the pool under --hugepages auto: none while the test runs.
        _hand_back_huge_pages()
        if _free_huge_pages() * HUGE_PAGE >= POOL_MIB * MIB:
            pytest.skip("hugetlb pages are free here and the kernel keeps them: --hugepages auto would take them")
        yield
    finally:
        SHMEM_ENABLED.write_text(old)
        NR_HUGEPAGES.write_text(total)
        assert f"[{old}]" in SHMEM_ENABLED.read_text()


@pytest.fixture(params=["hugetlb", "thp"])
def huge_kind(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(kind the kernel must back the pool with, --hugepages value), with the machine set up for it."""
    if request.param == "hugetlb":
        reserve = request.getfixturevalue("reserve_huge_pages")
        reserve(2 * POOL_MIB // 2 + 8)  # two daemons' pools and a margin
        return "hugetlb", "require"
    request.getfixturevalue("thp_advise")
    return "thp", "auto"


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _store(eng: SyntheticEngine, keys: list[bytes], seed: int, batch: int = 1 << 30,
           after_batch: Callable[[int], object] = lambda n: None) -> list[bytes]:
    items = eng.items(0, keys, first_block=1)
    blocks = [b for it in items for b in it.block_ids]
    eng.fill_random(0, blocks, seed)
    for i in range(0, len(items), batch):
        assert eng.store(items[i : i + batch]).result.stored == len(items[i : i + batch])
        after_batch(min(i + batch, len(items)))
    return [b"".join(eng.block_bytes(0, b) for b in it.block_ids) for it in items]


def _retrieve(eng: SyntheticEngine, keys: list[bytes], lease: int) -> list[bytes]:
    items = eng.items(0, keys, first_block=64)
    blocks = [b for it in items for b in it.block_ids]
    eng.zero(0, blocks)
    eng.retrieve(items, lease)
    eng.client.release(lease)  # the entries may be evicted again
    return [b"".join(eng.block_bytes(0, b) for b in it.block_ids) for it in items]


def _check_backing(daemon: Any, kind: str) -> dict[str, Any]:
    status = daemon.wait_status(lambda s: s["pool"]["prefault"]["done"], 60)
    pool = status["pool"]
    assert pool["prefault"]["error"] == "" and pool["faulted_bytes"] == pool["total_bytes"] == POOL_MIB * MIB
    assert (pool["kind"], pool["page_size"]) == (kind, HUGE_PAGE), pool
    # Every byte of the pool sits on a 2 MiB page, as smaps says (THP: PMD-mapped shmem).
    assert pool["huge_bytes"] == POOL_MIB * MIB, pool
    assert f"{kind} pages (2.0 MiB), 100% faulted (pre-faulted)" in format_status(status)
    return status


def test_store_retrieve_eviction_and_disk_tier_on_huge_pages(huge_kind: tuple[str, str], tmp_path: Path) -> None:
    kind, mode = huge_kind
    port = peerlib.free_port()
    d = peerlib.PeerDaemon(tmp_path, "hp", ["--l1-size-gb", str(POOL_MIB / 1024), "--chunk-size", "32",
                                            "--hugepages", mode, "--metrics-port", str(port),
                                            "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.5"])
    try:
        d.spawn().wait_ready(60)
        _check_backing(d, kind)
        m = _metrics(port)
        assert m[("hkvd_pool_page_size_bytes", (("kind", kind),))] == HUGE_PAGE
        assert m[("hkvd_pool_huge_bytes", ())] == POOL_MIB * MIB
        assert m[("hkvd_pool_bytes", (("state", "faulted"),))] == POOL_MIB * MIB
        cli = subprocess.run([sys.executable, "-m", "hkvd.daemon", "status", "--socket", d.socket_path],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        assert f"{kind} pages (2.0 MiB)" in cli

        eng = SyntheticEngine(d.socket_path, SHAPES, **ENGINE_KW)
        prompts = {seed: chunk_keys(prompt_tokens(32 * 30, seed=seed), 32) for seed in (1, 2, 3)}
        # Written behind to the disk tier in batches its queue (pool / 8 = 8 MiB) takes whole.
        first = _store(eng, prompts[1], seed=11, batch=6,
                       after_batch=lambda n: d.wait_status(lambda s: s["l2"]["writes"] == n, 30))
        hit, lease = eng.lookup(prompts[1])
        assert hit == 30 and _retrieve(eng, prompts[1], lease) == first  # straight from the pool
        later = {seed: _store(eng, prompts[seed], seed=10 + seed) for seed in (2, 3)}  # 90 MiB > the pool
        status = d.status()
        assert status["index"]["evictions"] == 90 - status["index"]["entries"] > 0, status["index"]
        hit, lease = eng.lookup(prompts[3])
        assert hit == 30 and _retrieve(eng, prompts[3], lease) == later[3]
        # Prompt 1 was evicted (least recently used): the lookup reads it back from the disk tier into
        # the huge-page pool.
        # (Only the evicted prefix: reading it evicts the least recently used entries, prompt 1's tail.)
        evicted = status["index"]["evictions"]
        hit, lease = eng.lookup(prompts[1][:evicted])
        assert hit == evicted and _retrieve(eng, prompts[1][:evicted], lease) == first[:evicted]
        status = d.status()
        assert status["by_kind"]["l2_hits"]["full"] == evicted and status["l2"]["read_errors"] == 0
        assert status["pool"]["kind"] == kind
        eng.close()
        assert d.stop() == 0
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.kill()


def test_peer_pull_between_huge_page_pools(huge_kind: tuple[str, str], tmp_path: Path) -> None:
    why = peerlib.nixl_missing()
    if why:
        pytest.skip(why)
    kind, mode = huge_kind
    prefill, decode = peerlib.start_pair(tmp_path, pool_gb=str(POOL_MIB / 1024), serve_args=("--hugepages", mode),
                                         pull_args=("--hugepages", mode))
    try:
        for d in (prefill, decode):
            _check_backing(d, kind)
        producer = SyntheticEngine(prefill.socket_path, SHAPES, **ENGINE_KW)
        keys = chunk_keys(prompt_tokens(32 * 20, seed=5), 32)
        stored = _store(producer, keys, seed=55)
        producer.close()
        consumer = SyntheticEngine(decode.socket_path, SHAPES, **ENGINE_KW)
        rid = consumer.client.submit_pull(prefill.peer_address, keys)
        done = consumer.client.wait([rid], 60)[rid]
        assert done.error is None, done.error
        assert (done.result.hit_chunks, done.result.pulled) == (20, 20)
        assert _retrieve(consumer, keys, done.result.lease_id) == stored
        consumer.close()
        assert decode.status()["pool"]["kind"] == kind
    finally:
        for d in (prefill, decode):
            if d.proc is not None and d.proc.poll() is None:
                d.kill()


# -- --hugepages require: clear failures, never a SIGBUS ------------------------------------


def test_require_with_too_few_pages_names_the_number_and_the_command(reserve_huge_pages: Callable[[int], int],
                                                                       tmp_path: Path) -> None:
    total = reserve_huge_pages(4)  # 8 MiB free, the pool wants 32 MiB
    with pytest.raises(PoolError) as e:
        HugePagePool(32 * MIB, "require", faulted_only=True)
    need = total + (32 * MIB - _free_huge_pages() * HUGE_PAGE) // HUGE_PAGE
    assert f"`echo {need} > /proc/sys/vm/nr_hugepages`" in str(e.value)
    # The daemon exits with the same message, not a traceback.
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--l1-size-gb", "0.03125", "--hugepages", "require"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "nr_hugepages" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_require_when_the_pages_vanish_after_the_check_is_an_error_not_sigbus(
        reserve_huge_pages: Callable[[int], int], monkeypatch: pytest.MonkeyPatch) -> None:
    reserve_huge_pages(16)  # exactly the pool's 32 MiB
    real = pool_mod._meminfo
    stolen: list[mmap.mmap] = []

    def check_then_steal() -> dict[str, int]:
        info = real()  # the daemon's check sees 16 free pages...
        fd = os.memfd_create("thief", os.MFD_CLOEXEC | os.MFD_HUGETLB)  # ...then another mapping reserves 4
        os.ftruncate(fd, 8 * MIB)
        stolen.append(mmap.mmap(fd, 8 * MIB, flags=mmap.MAP_SHARED))
        os.close(fd)
        return info

    monkeypatch.setattr(pool_mod, "_meminfo", check_then_steal)
    try:
        with pytest.raises(PoolError, match=r"were taken before it could reserve them.*nr_hugepages"):
            HugePagePool(32 * MIB, "require", faulted_only=True)
    finally:
        for m in stolen:
            m.close()
    # With the pages back, the same pool maps, faults in and holds bytes: the reservation is real.
    monkeypatch.setattr(pool_mod, "_meminfo", real)
    with HugePagePool(32 * MIB, "require", faulted_only=True) as p:
        assert p.prefault(threads=2) > 0
        assert p.backing(refresh=True).kind == "hugetlb" and p.backing().huge_bytes == 32 * MIB
        p.buffer[-3:] = b"end"
        assert bytes(p.buffer[-3:]) == b"end"
