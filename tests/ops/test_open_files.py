"""``hkvd serve`` raises its soft open-file limit to the hard one at start, and says so (both limits)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hkvd.shim.testing.launcher import DaemonProcess


def _serve(tmp_path: Path, nofile: str) -> DaemonProcess:
    return DaemonProcess(str(tmp_path / "hkvd.sock"), ["--hugepages", "off", "--l1-size-gb", "0.0625"],
                         tmp_path / "hkvd.log", prefix=["prlimit", f"--nofile={nofile}", "--"]).start(60)


def _limits(pid: int) -> tuple[int, int]:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def test_serve_raises_the_soft_limit_to_the_hard_one(tmp_path: Path) -> None:
    d = _serve(tmp_path, "256:4096")
    try:
        assert d.proc is not None
        assert _limits(d.proc.pid) == (4096, 4096)  # prlimit execs the daemon: same pid
        s = d.status()["descriptors"]
        assert (s["limit"], s["hard_limit"]) == (4096, 4096) and 0 < s["used"] < 256
        out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "status", "--socket", d.socket_path],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert re.search(r"^files +\d+ of 4096 open \(hard 4096, 256 reserved\): room for ~1\d\d\d engines; "
                         r"0 refused$", out, re.M), out
    finally:
        d.stop()
    log = d.log()
    assert re.search(r"level=info .*open files: soft limit raised from 256 to 4096, hard limit 4096: room for "
                     r"about 1\d\d\d engine connections", log), log


def test_a_limit_with_little_room_for_engines_is_a_warning_naming_the_fix(tmp_path: Path) -> None:
    d = _serve(tmp_path, "512:512")
    d.stop()
    line = next(x for x in d.log().splitlines() if "open files:" in x)
    assert "level=warning" in line and "soft limit 512, hard limit 512: room for about" in line
    assert "LimitNOFILE" in line
