"""SIGHUP reload and structured per-engine logs, against a real daemon process."""

from __future__ import annotations

import re
import signal

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys


def lease_ttl(socket_path: str) -> float:
    eng = SyntheticEngine(socket_path, [GroupShape("full", 2, 4096)], num_blocks=16)
    try:
        keys = chunk_keys(prompt_tokens(64, seed=1), eng.chunk_size)
        items = eng.items(0, keys, first_block=1)
        eng.store(items)
        c = eng.run(eng.client.submit_lookup(keys, True))
        assert c.result.hit_chunks == len(keys)
        return c.result.lease_ttl_s
    finally:
        eng.close()


def test_sighup_reloads_log_level_and_lease_ttl_only(spawn, notify_socket, tmp_path):
    conf = tmp_path / "hkvd.toml"
    conf.write_text('log-level = "info"\nlease-ttl-s = 30\nchunk-size = 32\nl1-size-gb = 0.0625\n')
    d = spawn("--config", str(conf), env={"NOTIFY_SOCKET": notify_socket.path})
    notify_socket.wait_for("READY")
    assert lease_ttl(d.socket_path) == 30
    assert "level=debug" not in d.log()

    conf.write_text('log-level = "debug"\nlease-ttl-s = 5\nchunk-size = 64\nl1-size-gb = 0.0625\n')
    d.proc.send_signal(signal.SIGHUP)
    assert "MONOTONIC_USEC" in notify_socket.wait_for("RELOADING", timeout_s=10)
    notify_socket.wait_for("READY", timeout_s=10)
    text = d.wait_log("SIGHUP: config reloaded")
    line = next(ln for ln in text.splitlines() if "SIGHUP: config reloaded" in ln)
    assert "log_level 'info' -> 'debug'" in line and "lease_ttl_s 30.0 -> 5.0" in line
    assert "needs a restart (ignored): chunk_size" in line
    assert lease_ttl(d.socket_path) == 5
    d.wait_log("level=debug logger=hkvd pid=")  # the new level is live
    assert d.proc.poll() is None

    conf.write_text("log-level = \n")  # broken: logged, ignored, still serving
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("config not reloaded")
    assert lease_ttl(d.socket_path) == 5
    assert d.stop() == 0


def test_sighup_without_config_keeps_serving(spawn, notify_socket):
    d = spawn("--l1-size-gb", "0.0625", "--chunk-size", "32", env={"NOTIFY_SOCKET": notify_socket.path})
    notify_socket.wait_for("READY")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("started without --config; nothing to reload")
    assert lease_ttl(d.socket_path) == 30
    assert d.stop() == 0


def test_per_engine_log_lines_carry_engine_and_peer_pid_fields(daemon, engine_proc):
    engine_proc(daemon.socket_path, "store", "--tokens", "64", "--seed", "1")
    daemon.stop()
    lines = [ln for ln in daemon.log().splitlines() if "registered engine" in ln]
    assert lines, daemon.log()
    for line in lines:
        assert re.match(r'ts=\S+ \S+ level=info logger=hkvd\.service pid=\d+ engine=\d+ peer_pid=\d+ msg="', line), line
    assert all(ln.startswith("ts=") and " level=" in ln for ln in daemon.log().splitlines() if ln.strip())
