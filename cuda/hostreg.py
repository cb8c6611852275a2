"""Pin the daemon's pool for CUDA: ``cudaHostRegister`` over ``pool.base_addr`` / ``pool.size``, in chunks.

Role
    Registered memory is what makes the pool a DMA target: ``cudaMemcpyAsync`` to pageable
    memory is staged through a driver bounce buffer (and is synchronous), and the
    gather/scatter kernel can only write host memory that is mapped into the device's address
    space. Flags: ``Portable`` (pinned for every CUDA context of the process, so one
    registration serves every GPU of the node) and ``Mapped`` (device-visible; with unified
    addressing the host pointer itself is the device pointer where the device reports
    ``cudaDevAttrCanUseHostPointerForRegisteredMem``, checked by the copy engine).

Chunks
    One ``cudaHostRegister`` call pins at most ``MAX_REGISTER_BYTES`` (512 GiB: the cap of R580+
    drivers), so a larger pool is registered as consecutive chunks, each registered and
    unregistered on its own. A failure midway unregisters the chunks already registered and raises
    with the fix. A DMA copy (``cudaMemcpyAsync``) must not span two registrations: the copy engine
    splits descriptor rows at ``PinnedRegistration.boundaries`` (``hkvd.cuda.descriptors.split_at``).

Cost
    Registration pins every page: roughly 1-3 s per 100 GiB with 2 MiB huge pages (much more
    with 4 KiB pages), so it is done once, when the CUDA copy engine is built at daemon start,
    never on the event loop per request.

Threading / lifecycle
    ``PinnedRegistration`` is created once and closed once (``close`` is idempotent, unregisters
    every chunk, and must run before the pool is unmapped: unregistering after munmap is undefined).
"""

from __future__ import annotations

import logging
from typing import Protocol

from hkvd.cuda._cupy import cupy, runtime

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 0x1  # driver_types.h cudaHostRegisterPortable
CUDA_HOST_REGISTER_MAPPED = 0x2  # cudaHostRegisterMapped
POOL_REGISTER_FLAGS = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
_PAGE = 4096
# The most one cudaHostRegister call pins: R580 and later drivers refuse a single registration over
# 512 GiB, so a larger pool is registered in chunks of at most this size (2 MiB-aligned).
MAX_REGISTER_BYTES = 1 << 39


class PoolLike(Protocol):
    @property
    def base_addr(self) -> int: ...

    @property
    def size(self) -> int: ...


def check_registrable(base_addr: int, size: int) -> None:
    """Pure checks before pinning: page-aligned base, positive size (the pool maps whole pages)."""
    if base_addr <= 0 or base_addr % _PAGE:
        raise ValueError(f"pool base {base_addr:#x} is not page-aligned (need a multiple of {_PAGE})")
    if size <= 0:
        raise ValueError(f"pool size must be positive, got {size}")


def chunk_spans(base_addr: int, size: int, max_bytes: int = MAX_REGISTER_BYTES) -> list[tuple[int, int]]:
    """``(addr, nbytes)`` of each registration covering ``[base_addr, base_addr + size)``: every one
    ``max_bytes`` long but the last."""
    if max_bytes <= 0 or max_bytes % _PAGE:
        raise ValueError(f"the registration cap must be a positive multiple of {_PAGE} bytes, got {max_bytes}")
    return [(base_addr + off, min(max_bytes, size - off)) for off in range(0, size, max_bytes)]


class PinnedRegistration:
    """``cudaHostRegister(Portable|Mapped)`` over the pool, in chunks of at most ``max_chunk_bytes``, for the
    lifetime of this object. ``boundaries``: the pool offsets where a chunk ends and the next begins (a DMA
    copy must not span two registrations: ``hkvd.cuda.descriptors.split_at``)."""

    def __init__(self, base_addr: int, size: int, *, device: int = 0,
                 max_chunk_bytes: int = MAX_REGISTER_BYTES) -> None:
        check_registrable(base_addr, size)
        self.base_addr = base_addr
        self.size = size
        self.device = device
        spans = chunk_spans(base_addr, size, max_chunk_bytes)
        self.boundaries: tuple[int, ...] = tuple(addr - base_addr for addr, _ in spans[1:])
        self._registered: list[int] = []  # chunk addresses, in registration order
        rt = runtime()
        with cupy().cuda.Device(device):
            for i, (addr, nbytes) in enumerate(spans):
                try:
                    rt.hostRegister(addr, nbytes, POOL_REGISTER_FLAGS)
                except Exception as e:
                    self._unregister()  # what was registered before this chunk
                    raise RuntimeError(
                        f"cudaHostRegister of the pool's chunk {i + 1} of {len(spans)} ({nbytes} bytes at {addr:#x}; "
                        f"the pool is {size} bytes at {base_addr:#x}) failed: {e}. The pool must be an ordinary "
                        "private or shared mapping (not already registered, not device memory); if the driver "
                        "caps one registration below this chunk, pass a smaller hkvd serve --cuda-pin-chunk-gib"
                    ) from e
                self._registered.append(addr)

    @classmethod
    def for_pool(cls, pool: PoolLike, *, device: int = 0, max_chunk_bytes: int | None = None) -> PinnedRegistration:
        cap = MAX_REGISTER_BYTES if max_chunk_bytes is None else max_chunk_bytes  # read now: tests lower it
        return cls(pool.base_addr, pool.size, device=device, max_chunk_bytes=cap)

    @property
    def registered(self) -> bool:
        return bool(self._registered)

    @property
    def chunks(self) -> int:
        """Registrations held now (``cudaHostRegister`` calls not yet undone)."""
        return len(self._registered)

    def close(self) -> None:
        """Unregister every chunk (idempotent); a failure is logged, and the other chunks are still undone."""
        if not self._registered:
            return
        with cupy().cuda.Device(self.device):
            self._unregister()

    def _unregister(self) -> None:
        rt = runtime()
        while self._registered:
            addr = self._registered.pop()
            try:
                rt.hostUnregister(addr)
            except Exception:
                logger.warning("cudaHostUnregister(%#x) failed", addr, exc_info=True)
