"""DMA copies: a descriptor batch as one ``cudaMemcpyBatchAsync``, or one ``cudaMemcpyAsync`` per row.

Role
    The copy path that runs on the GPU's copy engines (DMA), not on its SMs, so a compute engine
    sharing the GPU is not time-sliced against the daemon's copies. Where the CUDA runtime and
    driver are 12.8 or newer and NVIDIA's ``cuda-bindings`` is installed, a whole request is one
    ``cudaMemcpyBatchAsync`` (one attribute entry for every row: source read in stream order,
    ``cudaMemcpyFlagPreferOverlapWithCompute``); elsewhere each (coalesced) row is one
    ``cudaMemcpyAsync`` through CuPy. Which one a process uses is decided once, at first use
    (``batch_api``), and ``batch_api_reason`` says why the batch call is not used.

Signatures
    CUDA 12.8 declares ``cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs,
    numAttrs, failIdx*, stream)``; CUDA 13 dropped ``failIdx``. ``cuda-bindings`` takes the
    same arguments without the output pointer in both, and returns ``(err, failIdx)`` for 12.x
    and ``(err,)`` for 13.x: ``run_batch`` accepts either.

Threading
    Pure argument building; ``run_batch`` / ``run_rows`` enqueue on the caller's stream and
    return at once. The cached ``BatchApi`` is immutable and shared.

Failure
    An error returned while enqueueing raises ``CopyFailedError`` naming the row (``failIdx``
    where the runtime reports it). Rows enqueued before the error may still run: the caller
    must not reuse the stream (``hkvd.cuda.copy`` abandons the lane).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from hkvd.cuda.descriptors import DST, LEN, SRC
from hkvd.transport.errors import CopyFailedError

MIN_BATCH_VERSION = 12080  # cudaMemcpyBatchAsync first shipped in CUDA 12.8


@dataclass(frozen=True, slots=True)
class BatchApi:
    """``cudaMemcpyBatchAsync`` from cuda-bindings, with the one attribute entry every copy uses."""

    fn: Callable[..., Any]
    attrs: object  # a cudaMemcpyAttributes, passed through
    version: int  # min(runtime, driver) as CUDA writes versions: 12080 = 12.8


_lock = threading.Lock()
_resolved = False
_api: BatchApi | None = None
_reason = ""


def _version(result: Any) -> int:
    """cuda-bindings returns ``(err, value)``; the value of a successful call."""
    err, value = result
    if int(err) != 0:
        raise RuntimeError(f"error {int(err)}")
    return int(value)


def resolve_batch_api(import_runtime: Callable[[], ModuleType]) -> tuple[BatchApi | None, str]:
    """The batch call from the module ``import_runtime`` returns, or None and why not."""
    try:
        rt = import_runtime()
    except ImportError as e:
        return None, (f"cuda-bindings is not importable ({e}); install cuda-bindings matching the driver's CUDA "
                      "(pip install 'cuda-bindings>=12.8') to copy each request as one batch")
    fn = getattr(rt, "cudaMemcpyBatchAsync", None)
    if fn is None:
        return None, "this cuda-bindings has no cudaMemcpyBatchAsync (it needs 12.8 or newer)"
    try:
        version = min(_version(rt.cudaRuntimeGetVersion()), _version(rt.cudaDriverGetVersion()))
    except Exception as e:  # a broken install or no driver: say so rather than guessing
        return None, f"the CUDA runtime/driver version could not be read through cuda-bindings ({e})"
    if version < MIN_BATCH_VERSION:
        return None, (f"CUDA {version // 1000}.{version % 1000 // 10} is older than 12.8, which added "
                      "cudaMemcpyBatchAsync")
    attrs = rt.cudaMemcpyAttributes()
    attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    flags = getattr(rt, "cudaMemcpyFlags", None)
    overlap = getattr(flags, "cudaMemcpyFlagPreferOverlapWithCompute", None) if flags is not None else None
    if overlap is not None:
        attrs.flags = overlap
    return BatchApi(fn=fn, attrs=attrs, version=version), ""


def _import_nvidia_runtime() -> ModuleType:
    # Imported here, never at module import: the base install has no cuda-bindings. A checkout's
    # cuda/ folder on sys.path shadows NVIDIA's namespace (hkvd.cuda._cupy explains): then this
    # import fails and the per-row path is used, with the reason kept.
    return importlib.import_module("cuda.bindings.runtime")


def batch_api() -> BatchApi | None:
    """The process's batch call, or None (``batch_api_reason`` says why). Resolved once."""
    global _resolved, _api, _reason
    with _lock:
        if not _resolved:
            _api, _reason = resolve_batch_api(_import_nvidia_runtime)
            _resolved = True
        return _api


def batch_api_reason() -> str:
    batch_api()
    return _reason


def batch_args(desc: np.ndarray, stream_ptr: int, attrs: object) -> tuple[object, ...]:
    """Positional arguments of cuda-bindings' ``cudaMemcpyBatchAsync`` for every row of ``desc``.

    One attribute entry (index 0) covers all rows; ``stream_ptr`` must be a created stream (the
    legacy default stream 0 is refused by the call).
    """
    n = int(desc.shape[0])
    if n == 0:
        raise ValueError("an empty batch is not enqueued")
    if not stream_ptr:
        raise ValueError("cudaMemcpyBatchAsync refuses the legacy default stream; pass a created stream")
    return (desc[:, DST].tolist(), desc[:, SRC].tolist(), desc[:, LEN].tolist(), n, [attrs], [0], 1, stream_ptr)


def run_batch(api: BatchApi, desc: np.ndarray, stream_ptr: int) -> None:
    """Enqueue ``desc`` as one batch on ``stream_ptr``; raise ``CopyFailedError`` on an error."""
    result = api.fn(*batch_args(desc, stream_ptr, api.attrs))
    parts = tuple(result) if isinstance(result, tuple | list) else (result,)
    err = int(parts[0])
    if err != 0:
        where = f" at row {int(parts[1])}" if len(parts) > 1 else ""
        raise CopyFailedError(f"cudaMemcpyBatchAsync of {desc.shape[0]} rows failed{where} (cudaError {err})")


def run_rows(rt: ModuleType, desc: np.ndarray, stream_ptr: int) -> None:
    """Enqueue one ``cudaMemcpyAsync`` per row (CuPy's runtime ``rt``); unified addressing picks the kind."""
    kind = rt.memcpyDefault
    for i, (src, dst, nbytes) in enumerate(desc.tolist()):
        try:
            rt.memcpyAsync(dst, src, nbytes, kind, stream_ptr)
        except Exception as e:
            raise CopyFailedError(f"cudaMemcpyAsync of row {i} of {desc.shape[0]} failed: {e}") from e


def enqueue_dma(rt: ModuleType, desc: np.ndarray, stream_ptr: int, api: BatchApi | None) -> str:
    """Enqueue ``desc`` on the copy engines: one batch where ``api`` is given, else per row. Returns
    which ("batch" or "rows")."""
    if desc.shape[0] == 0:
        return "none"
    if api is not None and desc.shape[0] > 1:
        run_batch(api, desc, stream_ptr)
        return "batch"
    run_rows(rt, desc, stream_ptr)
    return "rows"
