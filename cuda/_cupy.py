"""Lazy access to CuPy, the only way hkvd touches CUDA from Python.

``import hkvd.cuda`` (and every module in it) must work on the base install, which has no GPU
package: modules call ``cupy()`` / ``runtime()`` inside functions, never at import time. The
error names the fix. The first ``cupy()`` also checks, once per process, that CuPy's CUDA can
run on this driver and that its libraries load (``check_versions``): the one place every CuPy
use goes through, so a wrong CuPy is refused at start-up rather than at the first copy.
Nothing here imports NVIDIA's ``cuda`` namespace directly (a top-level
``cuda`` package of ours would shadow it; see docs/house-style).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

INSTALL_HINT = ("install the GPU extra: pip install -e '.[gpu]' (CuPy for CUDA 12, which CUDA 12 and 13 drivers "
                "run), or '.[gpu-cu13]' where torch is built for CUDA 13 (R580+ drivers); the copy kernel needs NVRTC")

# cudaError_t values we branch on (driver_types.h).
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


class CupyMissing(ImportError):
    """CuPy is not installed (or fails to import): the CUDA path cannot run here."""


class CudaVersionMismatch(CupyMissing):
    """CuPy is built for a CUDA the driver cannot run, or its CUDA libraries are missing (``check_versions``)."""


_versions_ok = False  # check_versions passed in this process (cupy() runs it once)


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
    global _versions_ok
    if not _versions_ok:
        check_versions(cp)
        _versions_ok = True
    return cp


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def check_versions(cp: ModuleType) -> None:
    """Refuse a CuPy that cannot run here, before its first copy; ``CudaVersionMismatch`` names the fix.

    CUDA runs a runtime on any driver of its major or a later one (a CUDA 13 driver runs a CUDA 12
    runtime; within a major, minor-version compatibility), never on an older major. Refused:

    - CuPy built for a CUDA major above the driver's (``runtimeGetVersion`` > ``driverGetVersion``):
      cupy-cuda13x on a driver older than R580, say;
    - CuPy whose own CUDA libraries do not load: its runtime (``libcudart`` of its major) or NVRTC
      (the copy kernel's compiler); a CUDA 13 torch brings CUDA 13 libraries only, so cupy-cuda12x
      beside it would otherwise fail at the first copy.

    No driver at all (version 0) is not checked here: ``device_count`` reports no device.
    """
    rt = cp.cuda.runtime
    try:
        driver = int(rt.driverGetVersion())
    except Exception:
        return  # no usable driver: device_count reports no device
    if driver == 0:
        return
    built = int(rt.runtimeGetVersion())
    major, driver_major = built // 1000, driver // 1000
    if major > driver_major:
        raise CudaVersionMismatch(
            f"CuPy is built for CUDA {_version(built)}, but the NVIDIA driver runs CUDA {_version(driver)} at most: "
            f"a CUDA runtime cannot run on an older major's driver. Install the CuPy for the driver: "
            f"pip uninstall -y cupy-cuda{major}x && pip install 'hkvd[gpu-cu{driver_major}]', or upgrade the driver")
    probes = [("runtime", getattr(cp.cuda, "get_local_runtime_version", None))]
    nvrtc = getattr(cp.cuda, "nvrtc", None)
    probes.append(("NVRTC", getattr(nvrtc, "getVersion", None)))
    for what, probe in probes:
        if probe is None:
            continue  # an older CuPy without this probe: its first use reports the problem
        try:
            probe()
        except Exception as e:
            raise CudaVersionMismatch(
                f"CuPy is built for CUDA {major}, and the CUDA {major} {what} library does not load ({e}). Install "
                f"it (pip install 'cupy-cuda{major}x[ctk]', or the CUDA {major} toolkit), or install the CuPy for the "
                f"CUDA libraries this node has: pip uninstall -y cupy-cuda{major}x && pip install 'hkvd[gpu-cu13]' "
                "(torch built for CUDA 13) or 'hkvd[gpu-cu12]'") from e


def runtime() -> ModuleType:
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
