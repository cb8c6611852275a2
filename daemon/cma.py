"""Host copy engine: cross-memory attach (process_vm_readv / process_vm_writev).

Role
    Moves bytes between a CPU engine's registered host regions (virtual addresses in the engine
    process) and the daemon's pool, with one syscall per up to 1024 segments and no copy
    through a socket or a staging buffer: the kernel copies page to page, ~7-14 GB/s per thread
    into a prefaulted pool. ``allow_ptracer`` is the engine-side half: the shim calls it so a
    Yama-restricted kernel lets the daemon attach.

Threading
    ``attach``/``detach`` are quick (two 1-byte reads per region) and run on the loop. ``copy``
    blocks and runs on the copy thread pool; ctypes drops the GIL for the syscall, so several
    copies proceed in parallel. The engine keeps no mutable state between calls.
    This module never imports asyncio (the shim imports ``allow_ptracer``).

Contracts
    - Only regions of kind "host" are accepted; attach proves access by reading the first and
      last byte of each region, and fails with ``RegistrationError`` carrying the fix.
    - ``copy`` checks every segment against its region and the pool before moving any byte
      (defence in depth: the caller has already checked), loops on short transfers, and raises
      ``CopyFailedError`` if any byte could not be moved. It returns the bytes moved.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable
from typing import Protocol

from hkvd.daemon.copy_engine import Attachment, CopyEngine, Direction, Region, Segment
from hkvd.daemon.errors import CopyFailedError, RegistrationError

IOV_MAX = 1024  # Linux UIO_MAXIOV: more iovecs per call is EINVAL
PR_SET_PTRACER = 0x59616D61  # "Yama"
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name in ("process_vm_readv", "process_vm_writev"):
        fn = getattr(libc, name)
        fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        fn.restype = ctypes.c_ssize_t
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    return libc


_libc = _load_libc()


def allow_ptracer(daemon_pid: int) -> bool:
    """Let ``daemon_pid`` attach to this process (Yama ``PR_SET_PTRACER``).

    Called by the engine (shim) before registering host regions. Returns False where the kernel
    has no Yama (EINVAL): then ordinary same-user rules apply and nothing needs allowing.
    """
    if _libc.prctl(PR_SET_PTRACER, daemon_pid, 0, 0, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"prctl(PR_SET_PTRACER, {daemon_pid}): {os.strerror(err)}")


def _refused_message(pid: int, err: int) -> str:
    if err == errno.ESRCH:
        return f"CMA refused: engine process {pid} does not exist (it exited before registration finished)"
    return (
        f"CMA refused: the daemon (pid {os.getpid()}) may not read engine process {pid} "
        f"({os.strerror(err)}). Fix: the engine must call "
        f"hkvd.daemon.cma.allow_ptracer({os.getpid()}) (prctl PR_SET_PTRACER) before registering, "
        "or run the daemon as the same user with kernel.yama.ptrace_scope <= 1 "
        "(sysctl -w kernel.yama.ptrace_scope=1), or give the daemon CAP_SYS_PTRACE"
    )


_Syscall = Callable[..., int]  # process_vm_readv / process_vm_writev


class _PoolLike(Protocol):
    @property
    def base_addr(self) -> int: ...

    @property
    def size(self) -> int: ...


class HostCopyEngine(CopyEngine):
    """CMA copy engine over a pool's local mapping. See the module docstring.

    ``pool`` needs ``base_addr`` and ``size`` (a ``HugePagePool``).
    """

    name = "host"

    def __init__(self, pool: _PoolLike) -> None:
        self._base = pool.base_addr
        self._pool_size = pool.size

    def attach(self, pid: int, regions: list[Region]) -> Attachment:
        by_id: dict[int, Region] = {}
        for r in regions:
            if r.kind != "host":
                raise RegistrationError(
                    f"region {r.region_id} is of kind {r.kind!r}; the host copy engine only copies "
                    "'host' regions (register CUDA memory with the cuda engine)"
                )
            if r.region_id in by_id:
                raise RegistrationError(f"region id {r.region_id} is registered twice")
            if r.size <= 0 or r.addr <= 0:
                raise RegistrationError(f"region {r.region_id}: bad addr {r.addr:#x} or size {r.size}")
            by_id[r.region_id] = r
        probe = ctypes.create_string_buffer(1)
        local = (_Iovec * 1)(_Iovec(ctypes.addressof(probe), 1))
        for r in by_id.values():
            for addr in (r.addr, r.addr + r.size - 1):
                remote = (_Iovec * 1)(_Iovec(addr, 1))
                if _libc.process_vm_readv(pid, local, 1, remote, 1, 0) == 1:
                    continue
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.ESRCH):
                    raise RegistrationError(_refused_message(pid, err))
                raise RegistrationError(
                    f"region {r.region_id}: cannot read byte {addr:#x} of process {pid} "
                    f"({os.strerror(err)}): the region [{r.addr:#x}, +{r.size}) is not mapped there"
                )
        return Attachment(pid=pid, regions=by_id)

    def detach(self, attachment: Attachment) -> None:
        # CMA opens nothing per engine; kept for the interface (idempotent by construction).
        return None

    def _check(self, attachment: Attachment, segments: list[Segment]) -> None:
        for s in segments:
            region = attachment.regions.get(s.region_id)
            if region is None:
                raise CopyFailedError(f"segment names region {s.region_id}, which is not registered")
            if s.nbytes < 0 or s.region_offset < 0 or s.region_offset + s.nbytes > region.size:
                raise CopyFailedError(
                    f"segment [{s.region_offset}, +{s.nbytes}) leaves region {s.region_id} "
                    f"({region.size} bytes)"
                )
            if s.pool_offset < 0 or s.pool_offset + s.nbytes > self._pool_size:
                raise CopyFailedError(
                    f"segment [{s.pool_offset}, +{s.nbytes}) leaves the pool ({self._pool_size} bytes)"
                )

    def copy(self, attachment: Attachment, segments: list[Segment], direction: Direction) -> int:
        self._check(attachment, segments)
        # TO_POOL reads the engine (remote) into the pool (local); FROM_POOL writes it back.
        syscall: _Syscall = (
            _libc.process_vm_readv if direction is Direction.TO_POOL else _libc.process_vm_writev
        )
        regions = attachment.regions
        # (local, remote, length) triples; zero-length segments are no-ops and would only cost iovecs.
        pending = [
            (self._base + s.pool_offset, regions[s.region_id].addr + s.region_offset, s.nbytes)
            for s in segments
            if s.nbytes
        ]
        moved = 0
        i = 0
        while i < len(pending):
            batch = pending[i : i + IOV_MAX]
            moved += self._transfer(syscall, attachment.pid, batch)
            i += len(batch)
        return moved

    def _transfer(self, syscall: _Syscall, pid: int, batch: list[tuple[int, int, int]]) -> int:
        """Move one batch of at most IOV_MAX pairs, resuming after short transfers."""
        total = sum(n for _, _, n in batch)
        done = 0
        start = 0  # first pair not fully moved
        skip = 0  # bytes of batch[start] already moved
        while done < total:
            count = len(batch) - start
            local = (_Iovec * count)()
            remote = (_Iovec * count)()
            for j, (lo, ro, n) in enumerate(batch[start:]):
                off = skip if j == 0 else 0
                local[j].iov_base, local[j].iov_len = lo + off, n - off
                remote[j].iov_base, remote[j].iov_len = ro + off, n - off
            got = syscall(pid, local, count, remote, count, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else 0
                what = os.strerror(err) if err else "no progress"
                raise CopyFailedError(
                    f"CMA copy with process {pid} failed after {done} of {total} bytes of a batch: {what}"
                )
            done += got
            # A short transfer stops at an iovec boundary or inside one (unmapped remote page):
            # advance past what was moved and retry; the retry reports the real error if any.
            got += skip
            while start < len(batch) and got >= batch[start][2]:
                got -= batch[start][2]
                start += 1
            skip = got
        return total
