"""hkvd's GPU path (importable without CuPy; every CUDA call imports CuPy lazily).

- ``_cupy``: the lazy CuPy access every module goes through, and the once-per-process check that CuPy's
  CUDA runs on this driver (the error names the extra to install).
- ``export``: shim side, a torch/CuPy CUDA storage -> ``Region(kind="cuda")`` (IPC handle, UUID, offset).
- ``ipc``: daemon side, UUID -> device matching and one refcounted IPC mapping per handle per process.
- ``ipc_events``: interprocess events ordering the engine's stream and the daemon's copy stream.
- ``hostreg``: ``cudaHostRegister`` of the pool.
- ``descriptors``: pure segment -> ``(src, dst, nbytes)`` descriptor arithmetic (CPU-tested).
- ``dma``: a descriptor batch as one ``cudaMemcpyBatchAsync`` (cuda-bindings, CUDA 12.8+) or one
  ``cudaMemcpyAsync`` per row, on the GPU's copy engines.
- ``completion``: host-side completion of enqueued copies (``cudaLaunchHostFunc``), no polling thread.
- ``copy``: ``CudaCopyEngine``, batched gather/scatter on the daemon's own streams.
"""
