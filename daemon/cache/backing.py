"""What the kernel actually put behind the pool, and NUMA placement of it.

Role
    ``observe(base_addr)`` reads ``/proc/self/smaps`` for the mapping that starts at ``base_addr``
    and says which pages back it *now*: ``hugetlb`` (KernelPageSize above 4 KiB), ``thp`` (part
    of it PMD-mapped shmem, ``ShmemPmdMapped``) or ``plain``. This is what ``hkvd status`` and
    ``/metrics`` report, not the kind the pool asked for: THP in particular is a request the kernel
    may ignore (``shmem_enabled`` = never, or no free 2 MiB blocks).

    ``bind(addr, nbytes, node)`` applies ``mbind(MPOL_BIND)`` before the first fault, so every page
    of the pool comes from that node (the one next to the GPU's PCIe root on a multi-socket node).
    ``memory_nodes()`` lists the nodes that have memory; a node outside it is refused with them.

Cost
    Reading smaps walks the page tables of every mapping: ~1 ms per GiB of 4 KiB pages. The pool
    calls ``observe`` on a thread at start-up milestones and caches the answer; never per request.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import NamedTuple

from hkvd.transport.errors import PoolError
from hkvd.transport.libc import LIBC

_NODE_ROOT = "/sys/devices/system/node"
_MPOL_BIND = 2
_MPOL_MF_STRICT = 1
# mbind(2) has no wrapper in Python or in glibc before 2.x numa headers: call it by number.
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}


class Backing(NamedTuple):
    kind: str  # hugetlb | thp | plain
    page_size: int  # bytes of the largest page backing part of the pool
    huge_bytes: int  # bytes backed by huge pages (hugetlb or PMD-mapped THP)
    resident_bytes: int
    numa_policy: str  # from numa_maps: "default", "bind:0", ...
    node_bytes: dict[int, int]  # resident bytes per NUMA node


def _parse_kb(value: str) -> int:
    parts = value.split()
    return int(parts[0]) * 1024 if parts else 0


def _smaps_entry(base_addr: int, path: str) -> dict[str, str]:
    prefix = f"{base_addr:x}-"
    fields: dict[str, str] = {}
    with open(path) as f:
        found = False
        for line in f:
            if not found:
                found = line.startswith(prefix)
                continue
            key, sep, rest = line.partition(":")
            if not sep or " " in key:  # the next mapping's header line
                break
            fields[key] = rest.strip()
    if not found:
        raise PoolError(f"the pool mapping at {base_addr:#x} is not in {path}")
    return fields


def _numa_maps_entry(base_addr: int, path: str) -> tuple[str, dict[int, int]]:
    prefix = f"{base_addr:x} "
    try:
        with open(path) as f:
            line = next((x for x in f if x.startswith(prefix)), "")
    except OSError:
        return "unknown", {}
    words = line.split()
    if len(words) < 2:
        return "unknown", {}
    page = 4096
    pages: dict[int, int] = {}
    for w in words:
        if w.startswith("kernelpagesize_kB="):
            page = int(w.split("=", 1)[1]) * 1024
    for w in words:
        if w.startswith("N") and "=" in w and w[1:].split("=", 1)[0].isdigit():
            node, n = w[1:].split("=", 1)
            pages[int(node)] = int(n)
    return words[1], {node: n * page for node, n in pages.items()}


def observe(base_addr: int, *, smaps: str = "/proc/self/smaps", numa_maps: str = "/proc/self/numa_maps",
            thp_page: int = 2 << 20) -> Backing:
    """The pages backing the mapping at ``base_addr`` now, as the kernel reports them."""
    fields = _smaps_entry(base_addr, smaps)
    kernel_page = _parse_kb(fields.get("KernelPageSize", "4 kB"))
    hugetlb = _parse_kb(fields.get("Shared_Hugetlb", "0")) + _parse_kb(fields.get("Private_Hugetlb", "0"))
    pmd = _parse_kb(fields.get("ShmemPmdMapped", "0")) + _parse_kb(fields.get("FilePmdMapped", "0"))
    policy, nodes = _numa_maps_entry(base_addr, numa_maps)
    if kernel_page > 4096:
        return Backing("hugetlb", kernel_page, hugetlb, hugetlb, policy, nodes)
    rss = _parse_kb(fields.get("Rss", "0"))
    if pmd:
        return Backing("thp", thp_page, pmd, rss, policy, nodes)
    return Backing("plain", kernel_page, 0, rss, policy, nodes)


def thp_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


def _parse_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def memory_nodes(root: str = _NODE_ROOT) -> list[int]:
    """NUMA nodes with memory (``has_memory``); [0] where the kernel has no NUMA support."""
    try:
        with open(os.path.join(root, "has_memory")) as f:
            return _parse_list(f.read()) or [0]
    except OSError:
        return [0]


def bind(addr: int, nbytes: int, node: int, *, nodes: list[int] | None = None) -> None:
    """``mbind(MPOL_BIND, {node}, MPOL_MF_STRICT)`` over ``[addr, addr + nbytes)``, before any fault.

    Raises ``PoolError`` naming the nodes that exist when ``node`` has no memory here.
    """
    have = memory_nodes() if nodes is None else nodes
    if node not in have:
        raise PoolError(f"--numa-node {node}: this machine has memory on NUMA node(s) "
                        f"{', '.join(map(str, have))} only; pick the node next to the GPUs (`nvidia-smi topo -m` "
                        "shows each GPU's NUMA affinity, `numactl -H` lists the nodes) or leave --numa-node unset")
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise PoolError(f"--numa-node: mbind is not wired for {platform.machine()}; leave --numa-node unset "
                        "and start hkvd under `numactl --membind=N` instead")
    maxnode = max(node + 1, 64)
    mask = (ctypes.c_ulong * (-(-maxnode // 64)))()
    mask[node // 64] = 1 << (node % 64)
    libc = LIBC
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_int(_MPOL_BIND),
                      mask, ctypes.c_ulong(maxnode + 1), ctypes.c_uint(_MPOL_MF_STRICT))
    if rc != 0:
        err = ctypes.get_errno()
        raise PoolError(f"--numa-node {node}: mbind failed: {os.strerror(err)} ({errno.errorcode.get(err, err)}); "
                        "leave --numa-node unset or start hkvd under `numactl --membind=N`")
