"""Daemon side of CUDA IPC memory: match devices by UUID, open each handle once per process.

Role
    An engine registers ``Region(kind="cuda", handle, device_uuid, offset, size)`` (built by
    ``hkvd.cuda.export``). The daemon maps the allocation with ``cudaIpcOpenMemHandle`` on the
    device whose UUID matches, and addresses the region at ``opened_ptr + offset``.

Why a process-wide refcount
    ``cudaIpcOpenMemHandle`` maps an allocation once per process: one ``cudaIpcCloseMemHandle``
    unmaps it for every user in the process (LMCache's ``RawCudaIPCWrapper`` learnt this the
    hard way). Several regions often share one allocation (torch's caching allocator packs
    tensors into one cudaMalloc segment; vLLM views K and V of many layers in one tensor), and
    two attachments may name the same handle, so ``IpcMemRegistry`` opens a handle on first
    acquire and closes it on the last release.

Device matching
    Ordinals differ between processes (``CUDA_VISIBLE_DEVICES``); UUIDs do not. ``match_device``
    is pure and maps an exported UUID to the daemon's ordinal; a miss raises
    ``RegistrationError`` naming the daemon's visible UUIDs and the fix.

Threading
    ``IpcMemRegistry`` is guarded by a lock: attach/detach run on the event loop, a deferred
    detach may run on a copy thread. Each CUDA call runs with the target device current.

Lifecycle
    acquire (attach) -> pointer used by copies -> release (detach, or the last in-flight copy
    after a detach). ``close_all`` at engine shutdown releases whatever is left.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hkvd.cuda._cupy import cupy, runtime
from hkvd.transport.errors import RegistrationError

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) and sizeof(cudaIpcEventHandle_t)
logger = logging.getLogger(__name__)
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def normalize_uuid(uuid: str | bytes) -> str:
    """Canonical ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (lower-case) form of a device UUID.

    Accepts the 16 raw bytes of ``cudaDeviceProp.uuid``, nvidia-smi's ``GPU-...`` string,
    torch's bare ``xxxxxxxx-...`` string, or 32 hex digits. A ``MIG-`` prefix is kept: a MIG
    instance and its parent GPU are different devices.
    """
    if isinstance(uuid, bytes | bytearray):
        if len(uuid) != 16:
            raise ValueError(f"a raw device UUID is 16 bytes, got {len(uuid)}")
        digits, prefix = bytes(uuid).hex(), "GPU-"
    else:
        s = uuid.strip().lower()
        prefix = "GPU-"
        if s.startswith("mig-"):
            prefix, s = "MIG-", s[4:]
        elif s.startswith("gpu-"):
            s = s[4:]
        digits = s.replace("-", "")
        if not _HEX32.match(digits):
            raise ValueError(f"not a device UUID: {uuid!r}")
    d = digits
    return f"{prefix}{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"


def match_device(uuid: str | bytes, visible_uuids: Sequence[str | bytes]) -> int:
    """Return the index in ``visible_uuids`` (the daemon's CUDA ordinal) of the device ``uuid``.

    Raises ``RegistrationError`` when the device is not visible to the daemon, or when the
    UUID is malformed.
    """
    try:
        want = normalize_uuid(uuid)
    except ValueError as e:
        raise RegistrationError(f"bad device_uuid in a cuda region: {e}") from e
    have = [normalize_uuid(u) for u in visible_uuids]
    for i, u in enumerate(have):
        if u == want:
            return i
    raise RegistrationError(
        f"the engine's GPU {want} is not visible to the daemon (it sees {have or 'no GPU'}); run the "
        "daemon on the same node with that GPU visible (CUDA_VISIBLE_DEVICES unset or including it, "
        "and in containers the same devices plus --ipc=host)"
    )


def device_uuid(ordinal: int) -> str:
    """UUID of the current process's CUDA device ``ordinal``."""
    props = runtime().getDeviceProperties(ordinal)
    raw = props["uuid"]
    return normalize_uuid(bytes(raw) if isinstance(raw, bytes | bytearray) else str(raw))


def visible_device_uuids() -> list[str]:
    rt = runtime()
    return [device_uuid(i) for i in range(int(rt.getDeviceCount()))]


def check_region_fields(region_id: int, handle: bytes, size: int, offset: int) -> None:
    """Shape checks of a cuda region before any CUDA call (pure)."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise RegistrationError(
            f"region {region_id}: a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}"
        )
    if size <= 0 or offset < 0:
        raise RegistrationError(f"region {region_id}: bad size {size} or offset {offset}")


@dataclass(slots=True)
class _Opened:
    ptr: int
    device: int
    refs: int


class IpcMemRegistry:
    """Handle bytes -> one mapping per process, refcounted. See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bytes, _Opened] = {}

    def acquire(self, handle: bytes, device: int) -> int:
        """Map ``handle`` on ``device`` (once per process) and return the allocation's base pointer."""
        with self._lock:
            entry = self._open.get(handle)
            if entry is not None:
                if entry.device != device:
                    raise RegistrationError(
                        f"IPC handle already opened on device {entry.device}, now named for device {device}"
                    )
                entry.refs += 1
                return entry.ptr
            rt = runtime()
            try:
                with cupy().cuda.Device(device):
                    ptr = int(rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess))
            except Exception as e:
                raise RegistrationError(
                    f"cudaIpcOpenMemHandle failed on device {device}: {e}. The exporting process must be "
                    "alive, on this node, and share the IPC namespace (Docker: --ipc=host; Kubernetes: a "
                    "shared /dev/shm and hostIPC); the daemon cannot open a handle it exported itself"
                ) from e
            self._open[handle] = _Opened(ptr=ptr, device=device, refs=1)
            return ptr

    def release(self, handle: bytes) -> None:
        """Drop one reference; the last one unmaps. Releasing an unknown handle is a no-op."""
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                return
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self._open[handle]
            _close(entry)

    def refs(self, handle: bytes) -> int:
        with self._lock:
            entry = self._open.get(handle)
            return entry.refs if entry else 0

    def close_all(self) -> None:
        with self._lock:
            entries, self._open = list(self._open.values()), {}
        for entry in entries:
            _close(entry)


def _close(entry: _Opened) -> None:
    # Release paths must not raise (detach is idempotent and may run during shutdown, when the
    # context can already be gone); a failed unmap leaks address space, never correctness.
    try:
        rt = runtime()
        with cupy().cuda.Device(entry.device):
            rt.ipcCloseMemHandle(entry.ptr)
    except Exception:
        logger.warning(
            "cudaIpcCloseMemHandle(%#x) on device %d failed", entry.ptr, entry.device, exc_info=True
        )


# The one registry of this process (see "Why a process-wide refcount").
REGISTRY = IpcMemRegistry()
