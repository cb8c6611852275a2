"""``hkvd serve --copy-engine cuda`` refuses a CuPy the driver cannot run, or whose CUDA libraries are missing.

CuPy is replaced at its boundary by a stand-in module (``sys.modules["cupy"]``) whose runtime reports
the versions of each case; everything above it is hkvd's own: ``hkvd.cuda._cupy.cupy()`` (the one
place every CuPy use goes through) and ``check_copy_engine``, which ``hkvd serve`` runs at start-up.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from hkvd.cuda import _cupy
from hkvd.daemon.engines.engine_factory import CopyEngineUnavailable, check_copy_engine


def _fake_cupy(runtime: int, driver: int, *, devices: int = 1, cudart_loads: bool = True,
               nvrtc_loads: bool = True) -> SimpleNamespace:
    calls: list[str] = []

    def loads(ok: bool, what: str) -> Any:
        def probe() -> Any:
            calls.append(what)
            if not ok:
                raise OSError(f"lib{what}.so.{runtime // 1000}: cannot open shared object file")
            return runtime
        return probe

    def driver_version() -> int:
        calls.append("driver")
        return driver

    rt = SimpleNamespace(driverGetVersion=driver_version, runtimeGetVersion=lambda: runtime,
                         getDeviceCount=lambda: devices)
    cuda = SimpleNamespace(runtime=rt, get_local_runtime_version=loads(cudart_loads, "cudart"),
                           nvrtc=SimpleNamespace(getVersion=loads(nvrtc_loads, "nvrtc")))
    return SimpleNamespace(cuda=cuda, calls=calls)


@pytest.fixture
def use(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(**kw: Any) -> SimpleNamespace:
        fake = _fake_cupy(**kw)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        monkeypatch.setattr(_cupy, "_versions_ok", False)
        return fake
    return install


def test_a_cuda_13_cupy_on_a_cuda_12_driver_is_refused_with_the_pip_command(use: Any) -> None:
    use(runtime=13000, driver=12080)
    with pytest.raises(CopyEngineUnavailable) as e:
        check_copy_engine("cuda")
    msg = str(e.value)
    assert "built for CUDA 13.0" in msg and "CUDA 12.8 at most" in msg
    assert "pip uninstall -y cupy-cuda13x && pip install 'hkvd[gpu-cu12]'" in msg
    assert _cupy.device_count() == 0  # nothing else uses that CuPy either


@pytest.mark.parametrize(("runtime", "driver"), [(12080, 13000), (12080, 12080), (12090, 12040), (13000, 13010)],
                         ids=["cu12-on-13-driver", "same", "newer-minor", "cu13-on-13-driver"])
def test_a_runtime_the_driver_runs_is_accepted_and_checked_once(use: Any, runtime: int, driver: int) -> None:
    fake = use(runtime=runtime, driver=driver)
    check_copy_engine("cuda")
    assert _cupy.cupy() is fake
    assert fake.calls == ["driver", "cudart", "nvrtc"]  # once per process, not per use


@pytest.mark.parametrize("missing", ["cudart", "nvrtc"])
def test_a_cupy_whose_cuda_libraries_do_not_load_is_refused(use: Any, missing: str) -> None:
    use(runtime=12080, driver=13000, cudart_loads=missing != "cudart", nvrtc_loads=missing != "nvrtc")
    with pytest.raises(CopyEngineUnavailable) as e:
        check_copy_engine("cuda")
    msg = str(e.value)
    assert f"lib{missing}.so.12" in msg and ("NVRTC" if missing == "nvrtc" else "runtime") in msg
    assert "pip install 'cupy-cuda12x[ctk]'" in msg and "'hkvd[gpu-cu13]'" in msg


def test_no_driver_is_reported_as_no_device_not_as_a_version_mismatch(use: Any) -> None:
    use(runtime=12080, driver=0, devices=0)
    with pytest.raises(CopyEngineUnavailable, match="no CUDA device is visible"):
        check_copy_engine("cuda")
