"""Copy-engine selection and event ordering as a host daemon sees them (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hkvd.cuda._cupy import device_count
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import kv


def test_store_with_a_gpu_event_on_the_host_engine_is_refused_and_stores_nothing(daemon):
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, 4096)], num_blocks=32)
    keys = chunk_keys(prompt_tokens(32 * 3, seed=11), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    req = eng.client.submit_store(items, wait_event=b"e" * 64)
    done = eng.client.wait([req], 10)[req]
    assert isinstance(done.error, ProtocolViolation)
    assert "no GPU events" in str(done.error) and "without wait_event" in str(done.error)
    assert eng.lookup(keys, lease=False)[0] == 0  # nothing half-stored
    assert eng.store(items).result.stored == len(items)  # the same items, without an event, store fine
    assert eng.lookup(keys, lease=False)[0] == len(keys)
    eng.close()


def test_old_clients_without_the_optional_fields_still_parse():
    msg = kv.Store(7, [kv.Item(0, 0, b"k" * 16, [1])])
    wire = msg.to_wire()
    assert len(wire) == 3  # the default event is not sent
    assert kv.Store.from_wire(wire[1:]) == msg
    with_event = kv.Store(7, [kv.Item(0, 0, b"k" * 16, [1])], b"e" * 64)
    assert kv.Store.from_wire(with_event.to_wire()[1:]) == with_event
    with pytest.raises(ProtocolViolation, match="64 bytes"):
        kv.Store.from_wire([7, [], b"short"])
    # The optional fields: wait_event, notes, tenant, turn_end, skip_tiers.
    with pytest.raises(ProtocolViolation, match="expected 2 to 7 fields"):
        kv.Store.from_wire([7])


@pytest.mark.skipif(device_count() > 0, reason="a GPU is visible: the cuda engine would start")
def test_serve_with_the_cuda_engine_and_no_gpu_fails_fast_with_the_fix(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hkvd.daemon.cli", "serve", "--copy-engine", "cuda",
                        "--socket", str(tmp_path / "s.sock"), "--l1-size-gb", "0.0625"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "--copy-engine cuda" in r.stderr
    assert "pip install -e '.[gpu]'" in r.stderr or "no CUDA device" in r.stderr
    assert "pre-fault" not in r.stderr  # refused before the pool is touched
    assert not (tmp_path / "s.sock").exists()
