"""Shim side of CUDA IPC memory: turn the engine's KV-cache storage into ``Region(kind="cuda")``.

Role
    Runs once per backing storage at registration, inside vLLM's worker. It finds the CUDA
    allocation that holds the storage, takes its ``cudaIpcGetMemHandle`` (the handle always
    names a whole allocation, opened at its base) and reports ``offset = data_ptr - base``,
    the storage size and the device UUID. The daemon opens the handle (``hkvd.cuda.ipc``).

Supported allocators (legacy CUDA IPC needs memory from ``cudaMalloc``)
    - PyTorch's default CUDA caching allocator (native backend, ``expandable_segments`` off:
      the default). Each segment is one ``cudaMalloc``.
    - CuPy's default memory pool, and plain ``cudaMalloc``.
    Refused with a clear ``RegistrationError``:
    - ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (segments are cuMemCreate/cuMemMap
      VMM mappings) and any other cuMem VMM memory, e.g. vLLM's sleep-mode ``CuMemAllocator``:
      these need POSIX-fd/fabric handles, which hkvd does not implement yet.
    - ``backend:cudaMallocAsync`` pools (need ``cudaMemPoolExportPointer``) and managed memory.
    The authoritative test is the driver's ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``;
    the environment variable only sharpens the message.

How the allocation base is found
    ``cuPointerGetAttribute(RANGE_START_ADDR / RANGE_SIZE / IS_LEGACY_CUDA_IPC_CAPABLE)``. CuPy
    (14.x) wraps neither ``cuPointerGetAttribute`` nor ``cuMemGetAddressRange``, and
    ``cudaPointerGetAttributes`` has no base, so these three attributes are read through
    ctypes from ``libcuda.so.1``, the driver library CuPy itself has already loaded. No Python
    package of NVIDIA's is imported. The arithmetic and the refusals are pure
    (``plan_export``) and tested on CPU.

Threading
    Call from the thread that owns the tensor's device (the worker's); takes no locks.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hkvd.cuda._cupy import cupy, runtime
from hkvd.cuda.ipc import IPC_HANDLE_BYTES, device_uuid
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import RegistrationError

if TYPE_CHECKING:  # torch is the engine's, for annotations only
    import torch

# cuda.h CUpointer_attribute values.
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

VMM_FIX = (
    "export PYTORCH_CUDA_ALLOC_CONF without expandable_segments (or with expandable_segments:False), "
    "do not use the cudaMallocAsync backend, and do not enable vLLM sleep mode (its CuMemAllocator "
    "uses cuMem VMM); hkvd shares KV caches with legacy CUDA IPC, which needs cudaMalloc memory"
)


@dataclass(frozen=True, slots=True)
class PointerInfo:
    """What the driver says about one device pointer."""

    range_start: int  # base of the allocation holding the pointer
    range_size: int
    legacy_ipc_capable: bool
    device: int  # ordinal in the exporting process


def expandable_segments_enabled(alloc_conf: str | None) -> bool:
    """Does a ``PYTORCH_CUDA_ALLOC_CONF`` value turn expandable segments on? (last key wins)."""
    on = False
    for item in (alloc_conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip().lower() in ("true", "1")
    return on


def plan_export(ptr: int, nbytes: int, info: PointerInfo, alloc_conf: str | None = None) -> int:
    """Return the offset of ``[ptr, ptr+nbytes)`` inside its allocation, or refuse. Pure.

    Raises ``RegistrationError`` (with the fix) when the memory is not shareable with legacy
    CUDA IPC, or when the range is not inside one allocation.
    """
    if nbytes <= 0:
        raise RegistrationError(f"cannot export an empty range at {ptr:#x}")
    if not info.legacy_ipc_capable:
        cause = (
            "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments"
            if expandable_segments_enabled(alloc_conf)
            else "the memory is not from cudaMalloc (cuMem VMM, a cudaMallocAsync pool, or managed memory)"
        )
        raise RegistrationError(
            f"the KV cache at {ptr:#x} cannot be shared with CUDA IPC: {cause}. Fix: {VMM_FIX}"
        )
    offset = ptr - info.range_start
    if offset < 0 or offset + nbytes > info.range_size:
        raise RegistrationError(
            f"[{ptr:#x}, +{nbytes}) is not inside one CUDA allocation "
            f"([{info.range_start:#x}, +{info.range_size})); export each backing storage separately"
        )
    return offset


_libcuda: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        cupy()  # loads the driver (and fails with the install hint when CuPy is missing)
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        lib.cuPointerGetAttribute.restype = ctypes.c_int
        _libcuda = lib
    return _libcuda


def _attr(ptr: int, attr: int) -> int:
    # Zeroed 8 bytes: the driver writes 4 (int/bool) or 8 (CUdeviceptr, size_t) of them.
    out = ctypes.c_uint64(0)
    rc = _driver().cuPointerGetAttribute(ctypes.byref(out), attr, ptr)
    if rc != 0:
        raise RegistrationError(f"cuPointerGetAttribute({attr}) on {ptr:#x} failed with CUresult {rc}")
    return int(out.value)


def pointer_info(ptr: int, device: int) -> PointerInfo:
    """Query the driver about ``ptr`` with ``device`` current (cudaSetDevice makes its context current)."""
    with cupy().cuda.Device(device):
        return PointerInfo(
            range_start=_attr(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR),
            range_size=_attr(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE),
            legacy_ipc_capable=bool(_attr(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) & 0xFFFFFFFF),
            device=_attr(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) & 0xFFFFFFFF,
        )


def export_pointer(region_id: int, ptr: int, nbytes: int, device: int) -> Region:
    """Export ``[ptr, ptr+nbytes)`` of device memory on ``device`` as a cuda ``Region``."""
    info = pointer_info(ptr, device)
    offset = plan_export(ptr, nbytes, info, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    with cupy().cuda.Device(device):
        handle = bytes(runtime().ipcGetMemHandle(ptr))
    if len(handle) != IPC_HANDLE_BYTES:
        raise RegistrationError(
            f"cudaIpcGetMemHandle returned {len(handle)} bytes, expected {IPC_HANDLE_BYTES}"
        )
    return Region(
        region_id=region_id,
        kind="cuda",
        size=nbytes,
        handle=handle,
        device_uuid=device_uuid(device),
        offset=offset,
    )


def export_tensor(region_id: int, tensor: torch.Tensor) -> Region:
    """Export the whole backing storage of a torch CUDA tensor (views address into it).

    The region starts at the storage's byte 0 (``untyped_storage().data_ptr()``), not at the
    tensor's first element: ``View.offset`` values are relative to the storage.
    """
    if getattr(tensor, "device", None) is None or tensor.device.type != "cuda":
        raise RegistrationError(f"region {region_id}: export_tensor needs a CUDA tensor, got {tensor.device}")
    storage = tensor.untyped_storage()
    return export_pointer(region_id, int(storage.data_ptr()), int(storage.nbytes()), int(tensor.device.index))
