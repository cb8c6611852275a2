"""The fast tier's rule (tests/unit/conftest.py), run on a folder of made-up modules by a real pytest."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.out_of_process  # a pytest of its own, on a folder of made-up modules

HERE = Path(__file__).resolve().parent

MODULES = {
    "test_plain.py": "def test_plain():\n    assert True\n",
    "test_spawns.py": ("import subprocess, sys\n\n"
                       "def test_spawns():\n"
                       "    subprocess.run([sys.executable, '-c', 'pass'], check=True, timeout=60)\n"),
    "test_swallows.py": ("import os\n\n"
                         "def test_swallows():\n"
                         "    try:\n"
                         "        os.system('true')\n"
                         "    except Exception:\n"
                         "        pass\n"),
    "test_marked.py": ("import subprocess, sys\nimport pytest\n\n"
                       "pytestmark = pytest.mark.out_of_process\n\n"
                       "def test_marked():\n"
                       "    subprocess.run([sys.executable, '-c', 'pass'], check=True, timeout=60)\n"),
    "test_vllm_inside.py": ("import pytest\n\n"
                            "def _request():\n    pytest.importorskip('vllm')\n\n"
                            "def test_uses_vllm():\n    _request()\n"),
}


def _pytest(folder: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                          "--rootdir", str(folder), *args, str(folder / "unit")],
                         capture_output=True, text=True, timeout=120, check=False, cwd=folder)
    return out.stdout + out.stderr


def test_every_unit_test_is_fast_unless_it_starts_a_process_or_uses_vllm(tmp_path: Path) -> None:
    unit = tmp_path / "unit"
    unit.mkdir()
    shutil.copy(HERE / "conftest.py", unit / "conftest.py")
    for name, text in MODULES.items():
        (unit / name).write_text(text)
    listed = _pytest(tmp_path, "-m", "fast", "--collect-only")
    selected = {line.split("::")[-1] for line in listed.splitlines() if "::" in line}
    # A new module is in the tier without being named anywhere; marked or vLLM-using tests are not.
    assert selected == {"test_plain", "test_spawns", "test_swallows"}, listed
    ran = _pytest(tmp_path, "-m", "fast")
    assert "PASSED unit/test_plain.py::test_plain" in ran, ran
    # A fast test that starts a process fails, naming the marker, also where the error is swallowed.
    assert "FAILED unit/test_spawns.py::test_spawns" in ran, ran
    assert "ERROR unit/test_swallows.py::test_swallows" in ran, ran
    assert "started a process (os.system)" in ran and "pytest.mark.out_of_process" in ran, ran
    # Outside the fast tier the marked test runs its process.
    assert "PASSED unit/test_marked.py::test_marked" in _pytest(tmp_path, "-k", "marked")
