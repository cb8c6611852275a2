"""The C library, for the few system calls Python's standard library does not wrap.

Role
    One handle, shared by the host copy engine (``process_vm_readv``/``writev``), the pool's
    ``madvise`` (which, unlike ``mmap.madvise``, drops the GIL), the NUMA binding (``mbind`` by
    syscall number) and the shim's ``prctl``. Each caller sets the argument and result types of the
    functions it uses; they are the C prototypes, so callers never disagree.

Why not ``ctypes.util.find_library``
    On Linux it runs ``ldconfig -p`` in a subprocess at import: a cost at every start, and a
    process started by an import. The process's own symbols (``CDLL(None)``) already include the
    C library every CPython on Linux links.
"""

from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
