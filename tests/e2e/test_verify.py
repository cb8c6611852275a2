"""Sampled hits recomputed and compared, and quarantine, against a real ``hkvd serve`` (docs/verification.md).

A synthetic engine stores chunks, then "recomputes" them (writes values into its blocks) and sends a
``Verify`` naming those blocks; boundary states go through ``StepEvent.verifies`` under the snapshot
ordering. The last test runs the daemon under the wrong-entry hook (tests/e2e/_wrong_entry.py).
"""

from __future__ import annotations

import dataclasses
import http.client
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkvd.daemon.cli import query_status
from hkvd.shim.testing.launcher import DaemonProcess
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import NotFound, OutOfRange, ProtocolViolation
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import events, kv
from hkvd.transport.wire.events import StepResult
from hkvd.transport.wire.kv import Item, VerifyResult

CHUNK = 32
PAGE = 1024  # 512 bfloat16 values a layer page
HOOK = Path(__file__).with_name("_wrong_entry.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def fill(eng: SyntheticEngine, gid: int, blocks: list[int], seed: int, scale: float = 1.0) -> None:
    """Write bfloat16 values (normal, times ``scale``) into every layer page of ``blocks``."""
    rng = np.random.default_rng(seed)
    for b in blocks:
        for layer in range(eng.groups[gid].views[0].num_layers):
            page = eng.page(gid, layer, b)
            values = rng.standard_normal(page.size // 2).astype(np.float32) * scale
            page[:] = np.frombuffer((values.view(np.uint32) >> 16).astype(np.uint16).tobytes(), np.int8)


def verify(eng: SyntheticEngine, items: list[Item]) -> VerifyResult:
    """The daemon's reply to a Verify of ``items``, with req_id 0 (the one the expected results carry)."""
    rid = eng.client._submit(lambda r: kv.Verify(r, items))
    result = eng.client.wait([rid], 10.0)[rid].get(VerifyResult)
    assert result.req_id == rid
    return dataclasses.replace(result, req_id=0)


def step_event(eng: SyntheticEngine, seq: int, step: int, *, offers: list[Item] = (),  # type: ignore[assignment]
               confirms: list[int] = (), verifies: list[Item] = ()) -> int:  # type: ignore[assignment]
    return eng.client._submit(lambda r: events.StepEvent(r, seq, step, list(offers), list(confirms), b"", None,
                                                         list(verifies)))


def group_row(socket_path: str, fingerprint: bytes, gid: int) -> dict[str, Any]:
    rows = query_status(socket_path, 5.0)["verify"]["groups"]
    return next((r for r in rows if r["fingerprint"] == fingerprint.hex() and r["group"] == str(gid)),
                {"checks": 0, "divergences": 0, "quarantined": False})


def wait_for(what: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def hkvd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hkvd.daemon", *args], capture_output=True, text=True,
                          timeout=30, check=False)


def attention_engine(socket_path: str, model: str) -> tuple[SyntheticEngine, list[bytes], list[Item], list[Item]]:
    """Two full-attention groups, three chunks stored (2 blocks an entry)."""
    eng = SyntheticEngine(socket_path, [GroupShape("full", 2, PAGE), GroupShape("full", 2, PAGE)], num_blocks=32,
                          tokens_per_block=16, chunk_size=CHUNK, model=model)
    keys = chunk_keys(prompt_tokens(3 * CHUNK, seed=1), CHUNK)
    g0, g1 = eng.items(0, keys, first_block=1), eng.items(1, keys, first_block=1)
    fill(eng, 0, list(range(1, 7)), seed=10)
    fill(eng, 1, list(range(1, 7)), seed=11)
    eng.store(g0 + g1)
    return eng, keys, g0, g1


def test_verify_counts_quarantines_and_lifts(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", str(CHUNK), "--quarantine-after", "3",
                       "--metrics-port", str(port))
    eng, keys, g0, g1 = attention_engine(d.socket_path, "verify-a")
    fp = eng.fingerprint
    assert verify(eng, g0 + g1) == VerifyResult(0, 6 * 2 * 2 * PAGE, 6, 0, 0, 0.0, False)

    fill(eng, 0, list(range(1, 7)), seed=10, scale=1.01)  # another chunking's rounding: within tolerance
    r = verify(eng, g0)
    assert (r.checked, r.diverged, r.quarantined) == (3, 0, False) and 0 < r.max_error < 0.1

    fill(eng, 0, list(range(1, 7)), seed=99)  # other values: past tolerance
    r = verify(eng, g0[:1])
    assert (r.checked, r.diverged, r.quarantined) == (1, 1, False) and r.max_error > 0.5
    assert eng.lookup(keys, lease=False)[0] == 3  # below the threshold: still served
    r = verify(eng, g0[1:])
    assert (r.checked, r.diverged, r.quarantined) == (2, 2, True)
    assert eng.lookup(keys, lease=False)[0] == 0  # group 0 withheld: the hybrid hit is 0
    with pytest.raises(NotFound, match="quarantined"):
        eng.retrieve(g0[:1])
    eng.retrieve(g1)  # the other group is served

    # Another layout (another model: another fingerprint) with the same keys is unaffected.
    other, *_ = attention_engine(d.socket_path, "verify-b")
    assert other.fingerprint != fp and other.lookup(keys, lease=False)[0] == 3

    rows = {r["group"]: r for r in query_status(d.socket_path, 5.0)["verify"]["groups"]
            if r["fingerprint"] == fp.hex()}
    assert rows["0"]["quarantined"] and rows["0"]["divergences"] == 3 and rows["0"]["since"] > 0
    assert not rows["1"]["quarantined"] and rows["1"]["checks"] == 3 and rows["1"]["divergences"] == 0
    text = metrics(port)
    labels = f'fingerprint="{fp.hex()}",group="0",kind="full"'
    assert f"hkvd_quarantined{{{labels}}} 1.0" in text
    assert f"hkvd_verify_divergences_total{{{labels}}} 3.0" in text
    assert f'hkvd_quarantined{{fingerprint="{fp.hex()}",group="1",kind="full"}} 0.0' in text
    assert "hkvd_quarantines_total 1.0" in text
    status = hkvd("status", "--socket", d.socket_path)
    assert f"QUARANTINED {fp.hex()} group 0" in status.stdout, status

    listed = hkvd("quarantine", "--socket", d.socket_path)
    assert f"{fp.hex()} group 0 (full): 3 divergences" in listed.stdout, listed
    cleared = hkvd("quarantine", "--socket", d.socket_path, "--clear", fp.hex()[:12])
    assert cleared.returncode == 0 and cleared.stdout.strip() == f"lifted: {fp.hex()}/0", cleared
    assert eng.lookup(keys, lease=False)[0] == 3
    assert "no quarantine matched" in hkvd("quarantine", "--socket", d.socket_path, "--clear", "ffffffff").stdout

    assert verify(eng, g0).quarantined  # three more divergences: quarantined again
    assert eng.lookup(keys, lease=False)[0] == 0
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)  # after a fix, SIGHUP lifts every quarantine
    wait_for(lambda: eng.lookup(keys, lease=False)[0] == 3)
    assert "hkvd_quarantines_lifted_total 2.0" in metrics(port)


def test_bad_verifies_are_refused_whole_and_lose_nothing(daemon: Any) -> None:
    eng, keys, g0, g1 = attention_engine(daemon.socket_path, "verify-bad")
    with pytest.raises(OutOfRange, match="group 7 is not registered"):
        verify(eng, [g0[0], Item(7, 0, keys[0], [1, 2])])
    with pytest.raises(OutOfRange, match="outside"):
        verify(eng, [g0[0], Item(0, 1, keys[1], [3, 99])])
    row = group_row(daemon.socket_path, eng.fingerprint, 0)
    assert row["checks"] == 0  # refused whole: nothing compared
    assert eng.lookup(keys, lease=False)[0] == 3
    # A key the daemon does not hold (evicted, or never stored) is missing: neither copied nor compared.
    gone = chunk_keys(prompt_tokens(CHUNK, seed=2), CHUNK)
    assert verify(eng, [Item(0, 0, gone[0], [1, 2]), *g1]) == VerifyResult(0, 3 * 2 * 2 * PAGE, 3, 0, 1, 0.0, False)
    assert group_row(daemon.socket_path, eng.fingerprint, 0)["missing"] == 1


def mamba_engine(socket_path: str, model: str) -> tuple[SyntheticEngine, list[bytes]]:
    """A full-attention group and a Mamba group, two chunks stored: the states of chunks 0 and 1 in blocks 21
    and 22, offered and confirmed through step events 0-2."""
    eng = SyntheticEngine(socket_path, [GroupShape("full", 1, PAGE), GroupShape("mamba", 2, PAGE)],
                          num_blocks=64, tokens_per_block=CHUNK, chunk_size=CHUNK, model=model)
    keys = chunk_keys(prompt_tokens(2 * CHUNK, seed=5), CHUNK)
    fill(eng, 0, [1, 2], seed=1)
    fill(eng, 1, [21, 22], seed=2)
    eng.store(eng.items(0, keys, first_block=1))
    rid0 = step_event(eng, 0, 0, offers=[Item(1, 0, keys[0], [21], b"")])
    eng.run(rid0)
    rid1 = step_event(eng, 1, 1, offers=[Item(1, 1, keys[1], [22], keys[0])], confirms=[rid0])
    eng.run(rid1)
    eng.run(step_event(eng, 2, 2, confirms=[rid1]))
    assert eng.lookup(keys, lease=False)[0] == 2
    return eng, keys


def test_step_event_verifies_follow_the_snapshot_ordering(daemon: Any) -> None:
    eng, keys = mamba_engine(daemon.socket_path, "verify-mamba")
    fp = eng.fingerprint

    # Recomputed state of chunk 1 in block 30, identical: compared once confirmed.
    eng.page(1, 0, 30)[:] = eng.page(1, 0, 22)
    eng.page(1, 1, 30)[:] = eng.page(1, 1, 22)
    rid = step_event(eng, 3, 3, verifies=[Item(1, 1, keys[1], [30])])
    eng.run(rid)
    assert group_row(daemon.socket_path, fp, 1)["checks"] == 0  # not confirmed yet: not compared
    eng.run(step_event(eng, 4, 4, confirms=[rid]))
    wait_for(lambda: group_row(daemon.socket_path, fp, 1)["checks"] == 1)
    assert group_row(daemon.socket_path, fp, 1)["divergences"] == 0

    # A wrong state, confirmed: a divergence.
    fill(eng, 1, [31], seed=77)
    rid = step_event(eng, 5, 5, verifies=[Item(1, 1, keys[1], [31])])
    eng.run(rid)
    eng.run(step_event(eng, 6, 6, confirms=[rid]))
    wait_for(lambda: group_row(daemon.socket_path, fp, 1)["divergences"] == 1)

    # Never confirmed (dropped at step s+3): never compared.
    rid = step_event(eng, 7, 7, verifies=[Item(1, 1, keys[1], [31])])
    eng.run(rid)
    for seq, step in ((8, 8), (9, 9), (10, 10)):
        eng.run(step_event(eng, seq, step))
    eng.run(step_event(eng, 11, 11, confirms=[rid]))  # too late: the state may have been overwritten
    # Late: the engine reported step 13 already, so step 12's verify is refused (its block may be reused).
    eng.run(step_event(eng, 12, 13))
    late = step_event(eng, 13, 12, verifies=[Item(1, 1, keys[1], [31])])
    assert eng.run(late).get(StepResult).outcome == "late"
    eng.run(step_event(eng, 14, 14, confirms=[late]))
    time.sleep(0.5)  # a comparison, were one started, runs within this on an idle daemon
    row = group_row(daemon.socket_path, fp, 1)
    assert (row["checks"], row["divergences"]) == (2, 1)

    # Verifies name Mamba states only; the event is refused and its seq not taken.
    with pytest.raises(ProtocolViolation, match="verifies carry Mamba states only"):
        eng.run(step_event(eng, 15, 15, verifies=[Item(0, 1, keys[1], [2])]))
    assert eng.lookup(keys, lease=False)[0] == 2


def test_the_wrong_entry_hook_is_detected(tmp_path: Path) -> None:
    """A daemon that serves chunk i-1's entry for chunk i: loads get wrong bytes, sampled checks catch it."""
    d = DaemonProcess(str(tmp_path / "hkvd.sock"), ["--hugepages", "off", "--l1-size-gb", "0.125", "--chunk-size",
                                                    str(CHUNK), "--quarantine-after", "2"],
                      tmp_path / "hkvd.log", prefix=[sys.executable, str(HOOK)]).start()
    try:
        eng, keys, g0, _ = attention_engine(d.socket_path, "verify-hook")
        truth = [eng.block_bytes(0, b) for b in (3, 4)]  # chunk 1
        assert eng.lookup(keys, lease=False)[0] == 3
        eng.retrieve([Item(0, 1, keys[1], [20, 21])])
        served = [eng.block_bytes(0, b) for b in (20, 21)]
        assert served != truth and served == [eng.block_bytes(0, b) for b in (1, 2)]  # chunk 0's, well-formed
        r = verify(eng, g0)  # the engine computed all three chunks: their blocks hold the truth
        assert (r.checked, r.diverged, r.quarantined) == (3, 2, True)  # chunk 0 has no previous chunk
        assert eng.lookup(keys, lease=False)[0] == 0
        assert "quarantined fingerprint" in (tmp_path / "hkvd.log").read_text()

        # A Mamba group serves the previous boundary's state: the recomputed state of chunk 1 disagrees.
        ssm, mkeys = mamba_engine(d.socket_path, "verify-hook-mamba")
        for layer in (0, 1):
            ssm.page(1, layer, 30)[:] = ssm.page(1, layer, 22)  # the true state after chunk 1
        rid = step_event(ssm, 3, 3, verifies=[Item(1, 1, mkeys[1], [30], mkeys[0])])
        ssm.run(rid)
        ssm.run(step_event(ssm, 4, 4, confirms=[rid]))
        wait_for(lambda: group_row(d.socket_path, ssm.fingerprint, 1)["divergences"] == 1)
    finally:
        d.stop()


def test_an_evicted_entry_counts_as_missing(daemon_factory: Any) -> None:
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", str(CHUNK))
    big = 2 << 20  # one 2 MiB page a chunk: the 64 MiB pool holds fewer than 40
    eng = SyntheticEngine(d.socket_path, [GroupShape("full", 1, big)], num_blocks=42, tokens_per_block=CHUNK,
                          chunk_size=CHUNK, model="verify-evict")
    keys = chunk_keys(prompt_tokens(40 * CHUNK, seed=8), CHUNK)
    items = eng.items(0, keys, first_block=1)
    for i in range(0, 40, 8):
        eng.store(items[i:i + 8])
    assert eng.lookup(keys[:1], lease=False)[0] == 0  # the first chunk was evicted for the later ones
    r = verify(eng, [items[0], items[-1]])
    assert (r.checked, r.diverged, r.missing, r.nbytes) == (1, 0, 1, big)
