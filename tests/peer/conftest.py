"""Peer-link tests: real daemons pulling from each other with NIXL over TCP.

Every test here needs NIXL (``make dev`` installs it); without it the folder skips with the reason.
``peerlib`` (loaded by path) has the helpers; the fixtures below start daemon pairs and stop them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def load_peerlib() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hkvd_test_peerlib", HERE / "peerlib.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peerlib = load_peerlib()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = peerlib.nixl_missing()
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.ucx)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def lib() -> ModuleType:
    return peerlib


@pytest.fixture
def pair_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []

    def make(**kw: Any) -> tuple[Any, Any]:
        prefill, decode = peerlib.start_pair(tmp_path, **kw)
        started.extend((prefill, decode))
        return prefill, decode

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            try:
                d.stop(20)
            except Exception:
                d.kill()


@pytest.fixture
def pair(pair_factory: Any) -> tuple[Any, Any]:
    return pair_factory()
