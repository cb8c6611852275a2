"""A stand-in engine process for the GPU tests (started with multiprocessing "spawn").

It owns a CUDA buffer (a torch tensor when torch has CUDA, else a CuPy array), exports it with
``hkvd.cuda.export`` and answers commands over a Pipe. The daemon side (the test process)
must be another process: CUDA refuses to open an IPC handle in the process that exported it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SPIN_SOURCE = r"""
extern "C" __global__ void spin(const long long cycles)
{
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def serve(conn: Any) -> None:
    from hkvd.cuda._cupy import cupy
    from hkvd.cuda.export import export_pointer, export_tensor
    from hkvd.cuda.ipc_events import IpcEventRing, OpenedEvents

    cp = cupy()
    rt = cp.cuda.runtime
    try:
        import torch

        use_torch = bool(torch.cuda.is_available())
    except ImportError:
        use_torch = False
    keep: list[Any] = []
    ptr = 0
    nbytes = 0
    stream = None
    ring = None
    opened = None
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "alloc":
                nbytes, seed, region_ids = args
                cp.cuda.Device(0).use()
                if use_torch:
                    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
                    keep.append(t)
                    ptr = int(t.data_ptr())
                    regions = [export_tensor(r, t) for r in region_ids]
                else:
                    a = cp.empty(nbytes, dtype=cp.uint8)
                    keep.append(a)
                    ptr = int(a.data.ptr)
                    regions = [export_pointer(r, ptr, nbytes, 0) for r in region_ids]
                host = pattern(seed, nbytes)
                rt.memcpy(ptr, host.ctypes.data, nbytes, rt.memcpyHostToDevice)
                rt.deviceSynchronize()
                stream = cp.cuda.Stream(non_blocking=True)
                ring = IpcEventRing(0)
                opened = OpenedEvents(0)
                conn.send(("ok", [(r.region_id, r.size, r.handle, r.device_uuid, r.offset) for r in regions],
                           "torch" if use_torch else "cupy"))
            elif cmd == "fill":
                (seed,) = args
                host = pattern(seed, nbytes)
                rt.memcpy(ptr, host.ctypes.data, nbytes, rt.memcpyHostToDevice)
                rt.deviceSynchronize()
                conn.send(("ok",))
            elif cmd == "read":
                out = np.empty(nbytes, dtype=np.uint8)
                rt.deviceSynchronize()
                rt.memcpy(out.ctypes.data, ptr, nbytes, rt.memcpyDeviceToHost)
                conn.send(("ok", out.tobytes()))
            elif cmd == "slow_fill":
                # The engine's step: a slow kernel, then the write, then the step-end IPC event;
                # the handle goes out at once, with no host synchronisation (as in the shim).
                seed, ms = args
                mem = cp.cuda.alloc_pinned_memory(nbytes)
                host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
                host[:] = pattern(seed, nbytes)
                keep.append(mem)
                khz = int(rt.getDeviceProperties(0).get("clockRate", 0)) or 2_000_000
                spin = cp.RawKernel(SPIN_SOURCE, "spin")
                spin((1,), (1,), (np.int64(khz * ms),), stream=stream)
                rt.memcpyAsync(ptr, mem.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr)
                _, handle = ring.record(stream.ptr)
                conn.send(("ok", handle))
            elif cmd == "wait_read":
                # The shim's side of a retrieve: the engine stream waits on the daemon's event.
                (handle,) = args
                opened.wait(stream.ptr, handle)
                mem = cp.cuda.alloc_pinned_memory(nbytes)
                out = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
                rt.memcpyAsync(mem.ptr, ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
                stream.synchronize()
                conn.send(("ok", out.tobytes()))
            elif cmd == "exit":
                if opened is not None:
                    opened.close()
                if ring is not None:
                    ring.close()
                conn.send(("ok",))
                return
            else:
                conn.send(("err", f"unknown command {cmd!r}"))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))
