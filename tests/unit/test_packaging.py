"""The repo installs as the hkvd.* namespace, and never shadows NVIDIA's top-level `cuda`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_hkvd_cuda_imports_from_the_repo_folder():
    import hkvd.cuda

    assert Path(hkvd.cuda.__file__).resolve().parent == REPO / "cuda"


def test_top_level_cuda_does_not_resolve_into_the_repo():
    # The tests run with the repo root off sys.path (importlib mode, no root conftest), so a plain
    # `import cuda` (as CuPy does for NVIDIA's cuda.bindings) can never find ./cuda.
    assert str(REPO) not in [str(Path(p).resolve()) for p in sys.path if p]
    spec = importlib.util.find_spec("cuda")
    if spec is not None:
        locations = [spec.origin or "", *(spec.submodule_search_locations or [])]
        assert not any(str(REPO / "cuda") in str(loc) for loc in locations)


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "serve" in out and "status" in out
