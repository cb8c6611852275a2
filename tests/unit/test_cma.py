"""HostCopyEngine against a real child process: byte-exact round trips and refusals."""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.engines import host_engine
from hkvd.daemon.engines.host_engine import IOV_MAX, HostCopyEngine
from hkvd.shim.ptrace import allow_ptracer
from hkvd.transport.copy_engine import Direction, Region, Segment
from hkvd.transport.errors import CopyFailedError, RegistrationError

pytestmark = pytest.mark.out_of_process  # a real child process to copy to and from

MIB = 1 << 20
REGION_SIZES = (256 * 1024, 96 * 1024 + 13)  # an odd size checks the last-byte probe

# The engine stand-in: holds two buffers filled with a seeded pattern, prints their addresses,
# then serves `dump OFF LEN REGION` (hex back) and `fill REGION BYTE` on stdin.
CHILD = textwrap.dedent(
    """
    import ctypes, random, sys
    sizes = [int(x) for x in sys.argv[1:]]
    bufs = []
    for i, n in enumerate(sizes):
        b = ctypes.create_string_buffer(random.Random(i).randbytes(n), n)
        bufs.append(b)
    print(" ".join(str(ctypes.addressof(b)) for b in bufs), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "dump":
            r, off, n = map(int, args)
            print(ctypes.string_at(ctypes.addressof(bufs[r]) + off, n).hex(), flush=True)
        elif cmd == "fill":
            r, value = map(int, args)
            ctypes.memset(bufs[r], value, sizes[r])
            print("ok", flush=True)
    """
)


@dataclass
class Child:
    proc: subprocess.Popen[str]
    addrs: list[int]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def dump(self, region: int, off: int = 0, n: int | None = None) -> bytes:
        n = REGION_SIZES[region] - off if n is None else n
        return bytes.fromhex(self.ask(f"dump {region} {off} {n}"))

    def fill(self, region: int, value: int) -> None:
        assert self.ask(f"fill {region} {value}") == "ok"

    def regions(self) -> list[Region]:
        return [
            Region(i, "host", n, addr=a)
            for i, (n, a) in enumerate(zip(REGION_SIZES, self.addrs, strict=True))
        ]


def spawn_child() -> Child:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *map(str, REGION_SIZES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    addrs = [int(x) for x in proc.stdout.readline().split()]
    assert len(addrs) == len(REGION_SIZES), "child did not start"
    return Child(proc, addrs)


@pytest.fixture
def child() -> Iterator[Child]:
    c = spawn_child()
    yield c
    assert c.proc.stdin is not None
    c.proc.stdin.close()
    c.proc.wait(timeout=30)


@pytest.fixture
def pool() -> Iterator[HugePagePool]:
    with HugePagePool(4 * MIB, hugepages="off", superblock_bytes=2 * MIB) as p:
        yield p


def random_segments(rng: random.Random, count: int, max_len: int, pool_size: int) -> list[Segment]:
    """Disjoint segments on both sides, scattered over both regions and the pool."""
    segs = []
    pool_pos = rng.randrange(0, 64)
    cursors = [0, 0]
    for _ in range(count):
        r = rng.randrange(2)
        n = rng.randint(1, max_len)
        start = cursors[r] + rng.randrange(0, 8)
        if start + n > REGION_SIZES[r]:
            continue
        cursors[r] = start + n
        segs.append(Segment(r, start, pool_pos, n))
        pool_pos += n + rng.randrange(0, 8)
        assert pool_pos < pool_size
    rng.shuffle(segs)  # order must not matter
    return segs


def test_store_then_retrieve_round_trip_is_byte_exact(child: Child, pool: HugePagePool) -> None:
    engine = HostCopyEngine(pool)
    att = engine.attach(child.pid, child.regions())
    original = [child.dump(0), child.dump(1)]
    # 3000 segments: three process_vm_* calls of at most IOV_MAX iovecs each.
    segs = random_segments(random.Random(7), 3000, 150, pool.size)
    assert len(segs) > 2 * IOV_MAX
    moved = engine.copy(att, segs, Direction.TO_POOL)
    assert moved == sum(s.nbytes for s in segs)
    for s in segs:
        assert (
            bytes(pool.buffer[s.pool_offset : s.pool_offset + s.nbytes])
            == original[s.region_id][s.region_offset : s.region_offset + s.nbytes]
        )
    child.fill(0, 0)
    child.fill(1, 0xFF)
    assert engine.copy(att, segs, Direction.FROM_POOL) == moved
    after = [bytearray(child.dump(0)), bytearray(child.dump(1))]
    expected = [bytearray(b"\x00" * REGION_SIZES[0]), bytearray(b"\xff" * REGION_SIZES[1])]
    for s in segs:
        expected[s.region_id][s.region_offset : s.region_offset + s.nbytes] = original[s.region_id][
            s.region_offset : s.region_offset + s.nbytes
        ]
    assert after == expected
    engine.detach(att)
    engine.detach(att)


def test_whole_region_single_segment(child: Child, pool: HugePagePool) -> None:
    engine = HostCopyEngine(pool)
    att = engine.attach(child.pid, child.regions())
    n = REGION_SIZES[1]
    engine.copy(att, [Segment(1, 0, MIB, n)], Direction.TO_POOL)
    assert bytes(pool.buffer[MIB : MIB + n]) == child.dump(1)


def test_short_transfers_resume_mid_iovec(
    child: Child, pool: HugePagePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A syscall that moves at most 1000 bytes per call forces resumes inside iovecs."""
    real_read = host_engine._libc.process_vm_readv
    calls = []

    def stingy(pid: int, local: ctypes.Array, lcnt: int, remote: ctypes.Array, rcnt: int, flags: int) -> int:
        budget = 1000
        for arr in (local, remote):
            left = budget
            for i in range(lcnt):
                take = min(arr[i].iov_len, left)
                arr[i].iov_len = take
                left -= take
        calls.append(lcnt)
        return real_read(pid, local, lcnt, remote, rcnt, flags)

    class StingyLibc:
        process_vm_readv = staticmethod(stingy)

    monkeypatch.setattr(host_engine, "_libc", StingyLibc())
    engine = HostCopyEngine(pool)
    regions = child.regions()
    att = host_engine.Attachment(pid=child.pid, regions={r.region_id: r for r in regions})
    segs = [Segment(0, 0, 0, 3333), Segment(1, 100, 5000, 777), Segment(0, 50_000, 9000, 2500)]
    assert engine.copy(att, segs, Direction.TO_POOL) == 3333 + 777 + 2500
    assert len(calls) == 7  # ceil(6610 / 1000)
    for s in segs:
        assert bytes(pool.buffer[s.pool_offset : s.pool_offset + s.nbytes]) == child.dump(
            s.region_id, s.region_offset, s.nbytes
        )


@pytest.mark.parametrize("parts", [2, 3])
def test_split_copy_round_trip_is_byte_exact(child: Child, pool: HugePagePool, parts: int) -> None:
    """Copies past the split threshold move in parallel parts (cut inside iovecs too), byte-exact."""
    engine = HostCopyEngine(pool, split_parts=parts, split_min_bytes=4096)
    try:
        att = engine.attach(child.pid, child.regions())
        original = [child.dump(0), child.dump(1)]
        # Many small segments, and one long one at the end of region 0 where a cut lands inside it.
        tail = REGION_SIZES[0] - 40_000
        segs = [s for s in random_segments(random.Random(11), 1500, 300, pool.size)
                if s.region_id == 1 or s.region_offset + s.nbytes <= tail]
        segs.append(Segment(0, tail, 3 * MIB, 40_000))
        total = sum(s.nbytes for s in segs)
        assert engine.copy(att, segs, Direction.TO_POOL) == total
        for s in segs:
            assert bytes(pool.buffer[s.pool_offset : s.pool_offset + s.nbytes]) == original[s.region_id][
                s.region_offset : s.region_offset + s.nbytes
            ]
        child.fill(0, 0)
        child.fill(1, 0)
        assert engine.copy(att, segs, Direction.FROM_POOL) == total
        after = [bytearray(child.dump(0)), bytearray(child.dump(1))]
        expected = [bytearray(REGION_SIZES[0]), bytearray(REGION_SIZES[1])]
        for s in segs:
            expected[s.region_id][s.region_offset : s.region_offset + s.nbytes] = original[s.region_id][
                s.region_offset : s.region_offset + s.nbytes
            ]
        assert after == expected
        assert engine._splitter is not None, "the copy was not split"
    finally:
        engine.close()
    assert engine._splitter is None


def test_split_rows_covers_every_byte_once() -> None:
    rng = random.Random(3)
    for _ in range(500):
        lens = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        local = [x for i, n in enumerate(lens) for x in (1000 * i, n)]
        remote = [x for i, n in enumerate(lens) for x in (10**6 + 777 * i, n)]
        parts = rng.randint(1, 5)
        pieces = host_engine.split_rows(local, remote, parts)

        def expand(flat: list[int]) -> list[int]:
            return [b + i for b, n in zip(flat[::2], flat[1::2], strict=True) for i in range(n)]

        assert [x for lo, _ in pieces for x in expand(lo)] == expand(local)
        assert [x for _, re in pieces for x in expand(re)] == expand(remote)
        sizes = [sum(lo[1::2]) for lo, _ in pieces]
        assert len(pieces) == min(parts, sum(lens))
        assert max(sizes) - min(sizes) <= 1
        assert all(n > 0 for lo, _ in pieces for n in lo[1::2])
        assert local == [x for i, n in enumerate(lens) for x in (1000 * i, n)], "the input was modified"


def test_split_copy_to_exited_process_fails_after_every_part(pool: HugePagePool) -> None:
    c = spawn_child()
    engine = HostCopyEngine(pool, split_parts=2, split_min_bytes=4096)
    try:
        # Unpinned, so the split parts themselves meet the exited process (a pinned one is refused first).
        att = host_engine.Attachment(pid=c.pid, regions={r.region_id: r for r in c.regions()})
        assert c.proc.stdin is not None
        c.proc.stdin.close()
        c.proc.wait(timeout=30)
        with pytest.raises(CopyFailedError, match="failed"):
            engine.copy(att, [Segment(0, 0, 0, 64 * 1024), Segment(1, 0, MIB, 64 * 1024)], Direction.TO_POOL)
    finally:
        engine.close()


def test_out_of_region_segment_is_refused_before_any_byte_moves(child: Child, pool: HugePagePool) -> None:
    engine = HostCopyEngine(pool)
    att = engine.attach(child.pid, child.regions())
    child.fill(0, 0x11)
    good = Segment(0, 0, 0, 100)
    for bad in (
        Segment(0, REGION_SIZES[0] - 10, 200, 11),  # one byte past the region
        Segment(1, -1, 200, 4),
        Segment(5, 0, 200, 4),  # unregistered region
        Segment(0, 0, pool.size - 3, 4),  # past the pool
    ):
        with pytest.raises(CopyFailedError):
            engine.copy(att, [good, bad], Direction.FROM_POOL)
        with pytest.raises(CopyFailedError):
            engine.copy(att, [good, bad], Direction.TO_POOL)
    assert child.dump(0) == b"\x11" * REGION_SIZES[0]
    assert bytes(pool.buffer[:100]) == b"\x00" * 100


def test_copy_to_exited_process_fails(pool: HugePagePool) -> None:
    c = spawn_child()
    engine = HostCopyEngine(pool)
    att = engine.attach(c.pid, c.regions())
    assert c.proc.stdin is not None
    c.proc.stdin.close()
    c.proc.wait(timeout=30)
    with pytest.raises(CopyFailedError, match="has exited"):
        engine.copy(att, [Segment(0, 0, 0, 64)], Direction.TO_POOL)
    with pytest.raises(RegistrationError, match="does not exist"):
        engine.attach(c.pid, c.regions())


def test_attach_refusals(child: Child, pool: HugePagePool) -> None:
    engine = HostCopyEngine(pool)
    with pytest.raises(RegistrationError, match="host"):
        engine.attach(child.pid, [Region(0, "cuda", 100, handle=b"x" * 64)])
    r0 = child.regions()[0]
    with pytest.raises(RegistrationError, match="twice"):
        engine.attach(child.pid, [r0, r0])
    # A size far past the buffer: its last byte is not mapped in the child.
    with pytest.raises(RegistrationError, match="not readable memory of the registering process"):
        engine.attach(child.pid, [Region(0, "host", 1 << 40, addr=r0.addr)])
    with pytest.raises(RegistrationError):
        engine.attach(child.pid, [Region(0, "host", 0, addr=r0.addr)])


UNPRIVILEGED = textwrap.dedent(
    """
    import os, sys
    from hkvd.daemon.engines.host_engine import HostCopyEngine
    from hkvd.transport.copy_engine import Region
    from hkvd.transport.errors import RegistrationError
    class P:
        base_addr, size = 0, 0
    pid, addr = int(sys.argv[1]), int(sys.argv[2])
    os.setgid(65534); os.setuid(65534)  # nobody: may not read a root process
    try:
        HostCopyEngine(P()).attach(pid, [Region(0, "host", 64, addr=addr)])
    except RegistrationError as e:
        print(str(e))
    else:
        print("ATTACHED")
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_eperm_names_the_fix(child: Child) -> None:
    out = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED, str(child.pid), str(child.addrs[0])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "CMA refused" in out
    assert "PR_SET_PTRACER" in out and "ptrace_scope" in out


def test_allow_ptracer_does_not_raise() -> None:
    # True under Yama, False (EINVAL) on kernels without it; either way no error.
    assert allow_ptracer(os.getpid()) in (True, False)
