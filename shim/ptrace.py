"""The engine's half of host copies: let the daemon read and write this process (Yama).

Under ``kernel.yama.ptrace_scope = 1`` a process may attach only to its descendants, unless the
target names it with ``prctl(PR_SET_PTRACER)``. The shim calls ``allow_ptracer`` with the daemon's
pid (from ``HelloAck``) before it registers host regions, so the daemon's process_vm_readv/writev
are allowed. Kernels without Yama need nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os

from hkvd.transport.libc import LIBC

PR_SET_PTRACER = 0x59616D61  # "Yama"
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value  # any process may attach (benchmarks only)

_libc = LIBC
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.prctl.restype = ctypes.c_int


def allow_ptracer(daemon_pid: int) -> bool:
    """Let ``daemon_pid`` attach to this process (Yama ``PR_SET_PTRACER``).

    Returns False where the kernel has no Yama (EINVAL): then ordinary same-user rules apply and
    nothing needs allowing.
    """
    if _libc.prctl(PR_SET_PTRACER, daemon_pid, 0, 0, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"prctl(PR_SET_PTRACER, {daemon_pid}): {os.strerror(err)}")
