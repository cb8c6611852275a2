"""systemd integration against a real daemon: the notify protocol over a real NOTIFY_SOCKET, the unit file."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.notify import Notifier
from hkvd.daemon.options import load_toml
from hkvd.shim.client import DaemonClient

REPO = Path(__file__).resolve().parents[2]


def test_notifier_sends_to_path_and_abstract_sockets(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(tmp_path / "n.sock"))
        s.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")}).ready("up")
        assert s.recv(4096) == b"READY=1\nSTATUS=up"
    name = f"hkvd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("multi\nline")
        assert s.recv(4096) == b"STATUS=multi line"


def test_notifier_is_a_no_op_without_socket_and_survives_a_dead_manager(tmp_path):
    assert not Notifier({}).ready("x")
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).watchdog()  # never raises
    n = Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000"})
    assert n.watchdog_interval_s == 2.0
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}
                    ).watchdog_interval_s == 0  # the watchdog is for another process


def test_ready_only_after_socket_accepts_then_status_watchdog_and_stopping(spawn, notify_socket):
    d = spawn("--l1-size-gb", "0.25", "--chunk-size", "32",
              env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "200000"})
    before_ready: list[dict[str, str]] = []
    ready = notify_socket.wait_for("READY", on_message=before_ready.append)
    # The moment READY=1 arrives, the control socket must already accept and serve.
    with DaemonClient(d.socket_path, client_name="t", role="tool", timeout_s=5.0) as c:
        c.ping()
        assert c.status()["pool"]["total_bytes"] == 256 << 20
    assert "STATUS" in ready and "ready on" in ready["STATUS"] and "MiB pre-faulted" in ready["STATUS"]
    statuses = [m["STATUS"] for m in before_ready if "STATUS" in m]
    assert any("pre-faulting the first" in s for s in statuses), statuses
    # The first slice must finish before READY=1: systemd's start deadline is extended while it does.
    assert any(int(m.get("EXTEND_TIMEOUT_USEC", 0)) >= 10_000_000 for m in before_ready), before_ready
    # Watchdog pings keep arriving from the event loop (every 0.1 s here).
    for _ in range(3):
        notify_socket.wait_for("WATCHDOG", timeout_s=10)
    d.proc.send_signal(signal.SIGTERM)
    stopping = notify_socket.wait_for("STOPPING", timeout_s=20)
    assert stopping["STOPPING"] == "1" and "shutting down" in stopping["STATUS"]
    assert d.proc.wait(20) == 0


def test_no_watchdog_pings_without_watchdog_usec(spawn, notify_socket):
    d = spawn("--l1-size-gb", "0.0625", "--chunk-size", "32", env={"NOTIFY_SOCKET": notify_socket.path})
    notify_socket.wait_for("READY")
    d.stop()
    notify_socket.wait_for("STOPPING", timeout_s=10)
    assert not any("WATCHDOG" in m for m in notify_socket.messages)


def _unit(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_unit_file_has_what_an_sre_expects():
    u = _unit(REPO / "packaging/hkvd.service")
    assert u["Type"] == ["notify"]
    assert u["RuntimeDirectory"] == ["hkvd"]
    assert u["LimitMEMLOCK"] == ["infinity"]
    assert u["Restart"] == ["on-failure"]
    assert int(u["WatchdogSec"][0]) > 0
    assert "--config /etc/hkvd/hkvd.toml" in u["ExecStart"][0]
    assert "-HUP" in u["ExecReload"][0]


def test_example_config_is_valid():
    values = load_toml(str(REPO / "packaging/hkvd.toml"))
    cfg = DaemonConfig(**values)
    assert cfg.socket_path == "/run/hkvd/hkvd.sock"


def test_install_service_into_a_prefix(tmp_path):
    run = [sys.executable, "-m", "hkvd.daemon", "install-service", "--prefix", str(tmp_path), "--user", "nobody"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stdout
    unit = tmp_path / "etc/systemd/system/hkvd.service"
    conf = tmp_path / "etc/hkvd/hkvd.toml"
    assert unit.exists() and conf.exists()
    assert "systemctl daemon-reload" in out
    u = _unit(unit)
    assert u["User"] == ["nobody"] and u["Group"] == [grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name]
    assert u["CapabilityBoundingSet"] == [""]  # no capability at all: no CAP_SYS_PTRACE
    exec_start = u["ExecStart"][0]
    assert "/usr/local/bin/hkvd" not in exec_start and "serve --config /etc/hkvd/hkvd.toml" in exec_start
    conf.write_text("log-level = 'debug'\n")
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "kept" in out and conf.read_text() == "log-level = 'debug'\n"  # an edited config survives
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert verify.returncode == 0, verify.stderr


@pytest.mark.parametrize("user, why", [("root", "does not run as root"), ("no-such-user-hkvd", "no user")])
def test_install_service_refuses_root_and_unknown_users(tmp_path, user, why):
    run = [sys.executable, "-m", "hkvd.daemon", "install-service", "--prefix", str(tmp_path), "--user", user]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False,
                         env={k: v for k, v in os.environ.items() if k != "SUDO_USER"})
    assert out.returncode == 2 and why in out.stderr, out.stderr
    assert not (tmp_path / "etc/systemd/system/hkvd.service").exists()
