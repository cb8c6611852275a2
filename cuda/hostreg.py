"""Pin the daemon's pool for CUDA: ``cudaHostRegister`` over ``pool.base_addr`` / ``pool.size``.

Role
    Registered memory is what makes the pool a DMA target: ``cudaMemcpyAsync`` to pageable
    memory is staged through a driver bounce buffer (and is synchronous), and the
    gather/scatter kernel can only write host memory that is mapped into the device's address
    space. Flags: ``Portable`` (pinned for every CUDA context of the process, so one
    registration serves every GPU of the node) and ``Mapped`` (device-visible; with unified
    addressing the host pointer itself is the device pointer where the device reports
    ``cudaDevAttrCanUseHostPointerForRegisteredMem``, checked by the copy engine).

Cost
    Registration pins every page: roughly 1-3 s per 100 GiB with 2 MiB huge pages (much more
    with 4 KiB pages), so it is done once, when the CUDA copy engine is built at daemon start,
    never on the event loop per request.

Threading / lifecycle
    ``PinnedRegistration`` is created once and closed once (``close`` is idempotent and must
    run before the pool is unmapped: unregistering after munmap is undefined).
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


class PinnedRegistration:
    """``cudaHostRegister(base, size, Portable|Mapped)`` for the lifetime of this object."""

    def __init__(self, base_addr: int, size: int, *, device: int = 0) -> None:
        check_registrable(base_addr, size)
        self.base_addr = base_addr
        self.size = size
        self.device = device
        rt = runtime()
        try:
            with cupy().cuda.Device(device):
                rt.hostRegister(base_addr, size, POOL_REGISTER_FLAGS)
        except Exception as e:
            raise RuntimeError(
                f"cudaHostRegister of the pool ({size} bytes at {base_addr:#x}) failed: {e}. The pool "
                "must be an ordinary private or shared mapping (not already registered, not device memory)"
            ) from e
        self._registered = True

    @classmethod
    def for_pool(cls, pool: PoolLike, *, device: int = 0) -> PinnedRegistration:
        return cls(pool.base_addr, pool.size, device=device)

    @property
    def registered(self) -> bool:
        return self._registered

    def close(self) -> None:
        if not self._registered:
            return
        self._registered = False
        try:
            with cupy().cuda.Device(self.device):
                runtime().hostUnregister(self.base_addr)
        except Exception:
            logger.warning("cudaHostUnregister(%#x) failed", self.base_addr, exc_info=True)
