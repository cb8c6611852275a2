"""Lazy access to CuPy, the only way hkvd touches CUDA from Python.

``import hkvd.cuda`` (and every module in it) must work on the base install, which has no GPU
package: modules call ``cupy()`` / ``runtime()`` inside functions, never at import time. The
error names the fix. Nothing here imports NVIDIA's ``cuda`` namespace directly (a top-level
``cuda`` package of ours would shadow it; see docs/house-style).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

INSTALL_HINT = "install the GPU extra: pip install -e '.[gpu]' (cupy-cuda12x with nvrtc for the copy kernel)"

# cudaError_t values we branch on (driver_types.h).
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


class CupyMissing(ImportError):
    """CuPy is not installed (or fails to import): the CUDA path cannot run here."""


def cupy() -> ModuleType:
    try:
        import cupy as cp
    except ImportError as e:  # includes a broken install (missing libcudart etc.)
        raise CupyMissing(f"the CUDA path needs CuPy, which failed to import ({e}): {INSTALL_HINT}") from e
    return cp


def runtime() -> Any:
    return cupy().cuda.runtime


def cupy_available() -> bool:
    try:
        cupy()
    except CupyMissing:
        return False
    return True


def device_count() -> int:
    """Visible CUDA devices; 0 when CuPy is missing or the driver reports none."""
    try:
        rt = runtime()
        return int(rt.getDeviceCount())
    except CupyMissing:
        return 0
    except Exception:
        return 0


def status_of(exc: BaseException) -> int | None:
    """The cudaError_t of a CuPy runtime error, or None."""
    status = getattr(exc, "status", None)
    return int(status) if isinstance(status, int) else None
