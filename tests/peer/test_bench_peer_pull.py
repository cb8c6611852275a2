"""bench/peer_pull.py runs end to end (quick mode): two daemons, a pull and a bare NIXL READ of the
same extents, the pulled bytes checked against the stored ones, and a row with both rates."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# bench/ is a folder of the checkout, not a package: on sys.path only while it imports (a plain
# `import cuda` must never find hkvd's cuda/ folder; tests/unit/test_packaging.py).
sys.path.insert(0, str(ROOT))
try:
    from bench import peer_pull
finally:
    sys.path.remove(str(ROOT))


def test_quick_run_gives_a_row_with_both_rates() -> None:
    result = peer_pull.run(quick=True, hugepages="off", log=lambda *_: None)
    (row,) = result["rows"]
    assert (row["tls"], row["size_mib"], row["entry_kib"], row["entries"]) == ("tcp", 32, 512, 64)
    assert row["pull_gbps"] > 0 and row["bare_gbps"] > 0 and row["ratio"] > 0
    headers, rows = peer_pull.table(result)
    assert len(rows) == 1 and len(rows[0]) == len(headers)
    assert peer_pull.table({"skipped": "no NIXL", "rows": []})[1][0][5] == "skipped: no NIXL"
