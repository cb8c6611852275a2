# SPDX-License-Identifier: Apache-2.0
"""Engine-side half of the CUDA path: export KV storages once, order copies with IPC events.

Role
    Used by ``shim/worker.py`` only when vLLM's KV caches live on a GPU (``hkvd serve
    --copy-engine cuda``). Registration exports each backing storage as a ``Region(kind="cuda")``
    (the worker calls ``hkvd.cuda.export.export_tensor``: legacy CUDA IPC, cudaMalloc memory only),
    all on ``one_device``. Per step:

    - ``step_end_event()`` records one interprocess event on the engine's current stream after
      the forward. Its handle travels with the step's stores and step event, and the daemon's
      stream waits on it before reading: a Mamba snapshot is read after exactly the step that
      wrote it, with no host synchronisation on the engine's side.
    - ``wait_loaded(handle)`` makes the engine's current stream wait for the event the daemon
      recorded after a retrieve, before the forward reads the loaded blocks.

Threading
    vLLM's execute thread only (the thread that owns the device).

Verification
    Needs a GPU and CuPy (``hkvd[gpu]``). Not exercised on the CPU-only CI machines; see
    ``tests/gpu`` (skipped without a GPU) and ``make test-gpu``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hkvd.cuda.ipc_events import IpcEventRing, OpenedEvents

if TYPE_CHECKING:  # torch is imported where it is used
    import torch


def one_device(tensors: dict[str, torch.Tensor]) -> int:
    """The GPU every KV tensor of this rank lives on (one rank, one device)."""
    devices = {t.device.index for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"hkvd: this rank's KV caches span GPUs {sorted(devices)}; register one GPU per rank")
    return devices.pop()


class GpuOrdering:
    """Step-end events out, load-done events in. See the module docstring."""

    def __init__(self, device: int) -> None:

        self.device = device
        self._ring = IpcEventRing(device)
        self._opened = OpenedEvents(device)

    def _stream(self) -> int:
        import torch

        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def step_end_event(self) -> bytes:
        _, handle = self._ring.record(self._stream())
        return handle

    def wait_loaded(self, handle: bytes) -> None:
        self._opened.wait(self._stream(), handle)

    def close(self) -> None:
        self._opened.close()
        self._ring.close()
