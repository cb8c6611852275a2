"""Store and retrieve against memcpy on plain, thp and hugetlb pools, side by side, in one run.

For each backing the machine is set up (as root: ``shmem_enabled=advise`` for THP, hugetlb pages
reserved through ``nr_hugepages``; both restored after) and ``bench.store_retrieve`` runs its quick
sizes with the daemon, the raw references and memcpy on that backing. A row per backing and page
size, at the largest batch: hkvd's store and retrieve GB/s over memcpy's on the same buffers. Backings
this machine cannot give (not root) are left out, and the rows say which backing the pool got.
"""

from __future__ import annotations

from typing import Any

from bench import store_retrieve
from bench.common import human_bytes
from bench.prefault import _backing
from hkvd.daemon.cache.pool import HugePagePool

RESERVE_BYTES = 3 << 30  # hugetlb pages for the daemon's pool, the helper's and the scratch pool


def _got(mode: str) -> str:
    """The backing a pool asked for with ``mode`` gets on this machine now."""
    with HugePagePool(64 << 20, mode) as pool:  # type: ignore[arg-type]
        pool.prefault()
        return pool.backing(refresh=True).kind


def run(quick: bool, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for kind in ("plain", "thp", "hugetlb"):
        with _backing(kind, RESERVE_BYTES) as ok:
            if not ok:
                log(f"  {kind}: needs root to set the machine up; left out")
                continue
            mode = "off" if kind == "plain" else "auto"
            got = _got(mode)
            log(f"  {kind}: pools get {got} pages")
            result = store_retrieve.run(quick=True, hugepages=mode, log=log)
            largest: dict[int, dict[str, Any]] = {}
            for r in result["rows"]:
                if r["page_bytes"] not in largest or r["batch"] > largest[r["page_bytes"]]["batch"]:
                    largest[r["page_bytes"]] = r
            for page, r in sorted(largest.items()):
                rows.append({"backing": got, "page_bytes": page, "batch": r["batch"],
                             "store_gbps": r["store_gbps"], "memcpy_to_gbps": r["memcpy_to_gbps"],
                             "store_vs_memcpy": r["store_vs_memcpy"], "retrieve_gbps": r["retrieve_gbps"],
                             "memcpy_from_gbps": r["memcpy_from_gbps"], "retrieve_vs_memcpy": r["retrieve_vs_memcpy"]})
    return {"rows": rows}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["backing", "page", "batch", "store GB/s", "memcpy GB/s", "store/memcpy", "retrieve GB/s",
               "memcpy GB/s", "retrieve/memcpy"]
    rows = [[r["backing"], human_bytes(r["page_bytes"]), r["batch"], r["store_gbps"], r["memcpy_to_gbps"],
             r["store_vs_memcpy"], r["retrieve_gbps"], r["memcpy_from_gbps"], r["retrieve_vs_memcpy"]]
            for r in result["rows"]]
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Any) -> list[str]:
    return []
