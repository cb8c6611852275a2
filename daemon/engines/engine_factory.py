"""Which copy engine the daemon runs: ``hkvd serve --copy-engine host|cuda``.

Role
    Checks that the named engine can run here (before the pool is pre-faulted) and builds it. The
    interface every engine implements, and the types it moves bytes with, are in
    ``hkvd.transport.copy_engine``; nothing else in the daemon knows which engine is in use.
"""

from __future__ import annotations

from hkvd.cuda._cupy import CupyMissing, cupy, device_count
from hkvd.cuda.copy import DEFAULT_METHOD, CudaCopyEngine
from hkvd.cuda.hostreg import MAX_REGISTER_BYTES
from hkvd.daemon.cache import HugePagePool
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.copy_engine import CopyEngine


class CopyEngineUnavailable(StartupError, RuntimeError):
    """The configured copy engine cannot run on this machine; the message names the fix."""


def check_copy_engine(name: str) -> None:
    """Fail fast (before the pool is pre-faulted) when ``name`` cannot run here; the message names the fix.

    No fallback: a daemon asked for CUDA that cannot use it refuses to start, rather than refusing
    every engine that registers GPU memory later.
    """
    if name == "host":
        return
    if name != "cuda":
        raise CopyEngineUnavailable(f"unknown copy engine {name!r}; choose host or cuda")

    try:
        cupy()
    except CupyMissing as e:
        raise CopyEngineUnavailable(f"--copy-engine cuda: {e}") from None
    if device_count() == 0:
        raise CopyEngineUnavailable(
            "--copy-engine cuda: no CUDA device is visible to hkvd (check nvidia-smi, CUDA_VISIBLE_DEVICES "
            "and the service's DeviceAllow); use --copy-engine host for CPU KV caches")


def make_copy_engine(name: str, pool: HugePagePool, *, copy_timeout_s: float, cuda_copy_method: str = DEFAULT_METHOD,
                     cuda_pin_chunk_bytes: int = MAX_REGISTER_BYTES) -> CopyEngine:
    """Build the engine ``hkvd serve --copy-engine`` names, for ``pool`` (a ``HugePagePool``);
    ``cuda_copy_method`` is ``--cuda-copy-method`` (the CUDA engine's path, ``hkvd.cuda.copy``) and
    ``cuda_pin_chunk_bytes`` the largest pinned registration (``--cuda-pin-chunk-gib``, ``hkvd.cuda.hostreg``)."""
    check_copy_engine(name)
    if name == "cuda":

        return CudaCopyEngine(pool, copy_timeout_s=copy_timeout_s, method=cuda_copy_method,
                              pin_chunk_bytes=cuda_pin_chunk_bytes)

    return HostCopyEngine(pool)
