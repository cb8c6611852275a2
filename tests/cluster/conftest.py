"""Cluster-tier tests: a real ``mooncake_master`` and two ``hkvd serve --cluster`` daemons in two network
namespaces joined by a veth pair, values moving over TCP on the veth.

Needs Mooncake (``pip install -e '.[cluster]'``; ``make dev`` installs it with the OS package libibverbs1)
and root (or CAP_NET_ADMIN) for the namespaces; skips with the reason otherwise. Engines run in the test
process (or a spawned child) and reach both daemons through their Unix sockets, which namespaces do not
split. ``clusterlib`` (loaded by path) has the helpers.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


clusterlib = _load("hkvd_test_clusterlib", HERE / "clusterlib.py")
netns = _load("hkvd_test_netns", HERE.parent / "peer" / "test_netns.py")  # its veth fixture


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = clusterlib.mooncake_missing()
    for item in items:
        if why and HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=why))


veth = netns.veth


@pytest.fixture
def lib() -> ModuleType:
    return clusterlib


@pytest.fixture
def cluster(veth: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """A master in node 1's namespace; ``make_node`` starts daemons in either namespace."""
    c = clusterlib.Cluster(veth, tmp_path)
    try:
        c.start_master()
        yield c
    finally:
        for d in c.nodes:
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
                try:
                    d.stop(20)
                except Exception:
                    d.kill()
        c.stop_master()
