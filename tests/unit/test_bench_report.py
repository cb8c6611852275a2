"""docs/benchmarks.md's tables are the ones bench/results/*.json give, with date and machine."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# bench/ is not an installed package: its folder's parent goes on sys.path only while it imports
# (see tests/unit/test_bench.py); its submodules then load through the imported package.
sys.path.insert(0, str(REPO))
try:
    from bench import report
finally:
    sys.path.remove(str(REPO))


def test_the_docs_tables_are_generated_from_the_results():
    assert report.main(["--root", str(REPO)]) == 0, "run: python -m bench report --write"


def test_a_changed_result_makes_the_docs_stale(tmp_path, capsys):
    shutil.copytree(REPO / "bench" / "results", tmp_path / "bench" / "results")
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks.md")
    path = tmp_path / "bench" / "results" / "scale.json"
    payload = json.loads(path.read_text())
    payload["index"][0]["lookup_hit_ns"] = 123456789
    path.write_text(json.dumps(payload))
    assert report.main(["--root", str(tmp_path)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert report.main(["--root", str(tmp_path), "--write"]) == 0
    text = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "123456789" in text and "2026-11-22, full run, 2 CPUs" in text
    assert payload["commit"] not in text  # no commit hashes in the docs
