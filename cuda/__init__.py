"""hkvd's GPU path (importable without CuPy; every CUDA call imports CuPy lazily).

- ``export``: shim side, a torch/CuPy CUDA storage -> ``Region(kind="cuda")`` (IPC handle, UUID, offset).
- ``ipc``: daemon side, UUID -> device matching and one refcounted IPC mapping per handle per process.
- ``events``: interprocess events ordering the engine's stream and the daemon's copy stream.
- ``hostreg``: ``cudaHostRegister`` of the pool.
- ``descriptors``: pure segment -> ``(src, dst, nbytes)`` descriptor arithmetic (CPU-tested).
- ``copy``: ``CudaCopyEngine``, batched gather/scatter on the daemon's own streams.
"""
