"""Lazy access to CuPy, the only way hkvd touches CUDA from Python.

``import hkvd.cuda`` (and every module in it) must work on the base install, which has no GPU
package: modules call ``cupy()`` / ``runtime()`` inside functions, never at import time. The
error names the fix. Nothing here imports NVIDIA's ``cuda`` namespace directly (a top-level
``cuda`` package of ours would shadow it; see docs/house-style).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

INSTALL_HINT = "install the GPU extra: pip install -e '.[gpu]' (cupy-cuda12x with nvrtc for the copy kernel)"

# cudaError_t values we branch on (driver_types.h).
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


class CupyMissing(ImportError):
    """CuPy is not installed (or fails to import): the CUDA path cannot run here."""


def _is_checkout(root: Path) -> bool:
    """``root`` is an hkvd checkout: its ``cuda/`` folder is ``hkvd.cuda``, not NVIDIA's ``cuda``."""
    return (root / "cuda" / "_cupy.py").is_file() and (root / "daemon" / "cli.py").is_file()


def checkout_entries() -> list[str]:
    """Entries of ``sys.path`` that are an hkvd checkout's root. There, the checkout's ``cuda/``
    folder (installed as ``hkvd.cuda``) is found as a top-level ``cuda`` package and shadows
    NVIDIA's ``cuda`` namespace, which CuPy imports. ``python -m ...`` run from the checkout's
    root puts it there (as ``''`` or the path)."""
    return [entry for entry in sys.path if _is_checkout(Path(entry or os.getcwd()))]


def unshadow_nvidia_cuda() -> None:
    """Drop hkvd checkouts from ``sys.path`` (``hkvd serve`` calls this before anything imports
    CuPy; hkvd itself is imported through its installed package, never through those entries)."""
    for entry in checkout_entries():
        sys.path.remove(entry)


def cupy() -> ModuleType:
    try:
        import cupy as cp
    except ImportError as e:  # includes a broken install (missing libcudart etc.)
        shadow = sys.modules.get("cuda")
        where = [str(p) for p in getattr(shadow, "__path__", []) if _is_checkout(Path(p).parent)]
        if where:
            raise CupyMissing(f"CuPy failed to import ({e}) because NVIDIA's `cuda` package is shadowed by the "
                              f"hkvd checkout's folder {where[0]}: its parent is on sys.path (python run from "
                              "the checkout's root?). Run from another directory, use the `hkvd` command, or "
                              "start Python with -P") from e
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
