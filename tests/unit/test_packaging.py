"""The repo installs as the hkvd.* namespace, and never shadows NVIDIA's top-level `cuda`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.out_of_process
def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "serve" in out and "status" in out


@pytest.mark.out_of_process
def test_python_m_from_the_checkout_root_does_not_shadow_nvidias_cuda():
    """``python -m hkvd.daemon`` run from the checkout's root puts the root on sys.path, where ./cuda
    would shadow NVIDIA's ``cuda`` (CuPy failed to import there, on a GPU node). The CLI drops it."""
    probe = ("import importlib.util, sys; from hkvd.daemon.cli import main; "
             "sys.argv = ['hkvd', '--help']; before = importlib.util.find_spec('cuda'); "
             "import contextlib, io\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main()\n"
             "after = importlib.util.find_spec('cuda')\n"
             "where = lambda s: [str(x) for x in (s.submodule_search_locations or [])] if s else []\n"
             "print(repr(where(before)), repr(where(after)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout
    before, after = out.strip().split("] [")
    assert str(REPO / "cuda") in before  # the shadow is real: '' (the cwd) leads sys.path here
    assert str(REPO / "cuda") not in after


def test_a_shadowed_cuda_gets_an_error_that_names_the_fix(monkeypatch):
    import types

    from hkvd.cuda import _cupy

    fake = types.ModuleType("cuda")
    fake.__path__ = [str(REPO / "cuda")]
    monkeypatch.setitem(sys.modules, "cuda", fake)
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a node where `import cupy` fails
    try:
        _cupy.cupy()
    except _cupy.CupyMissing as e:
        assert "shadowed by the hkvd checkout" in str(e) and "-P" in str(e)
    else:
        raise AssertionError("cupy() imported with cupy blocked")
