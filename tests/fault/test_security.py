"""Each attack is tried, and each fails to get in."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from hkvd.shim.client import DaemonClient
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import OutOfRange, RegistrationError
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.control import EngineSpec

NOBODY = 65534


def test_socket_is_created_0660(daemon):
    mode = stat.S_IMODE(os.stat(daemon.socket_path).st_mode)
    assert mode == 0o660
    print("\nRELIABILITY attack refused: the control socket is created 0660 (no window with wider permissions)")


def _open_path_to(path) -> None:
    """Let other users traverse every directory down to ``path`` (pytest's temp dirs are 0700)."""
    for d in [path, *path.parents]:
        if str(d) in ("/", "/tmp"):
            break
        os.chmod(d, os.stat(d).st_mode | 0o011)


def _as_nobody(socket_path: str) -> str:
    """Connect as uid ``nobody`` from a forked child (no exec: nobody cannot run our venv)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            c = DaemonClient(socket_path, client_name="intruder", role="worker", timeout_s=5)
            try:
                c.connect()
                c.ping()
                result = "GOT IN"
            except Exception as e:
                result = f"{type(e).__name__} {e}"
            os.write(w, result.encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_other_users_cannot_open_the_socket(daemon, tmp_path):
    _open_path_to(tmp_path)  # nobody can reach the directory; the 0660 socket still refuses it
    out = _as_nobody(daemon.socket_path)
    assert "GOT IN" not in out
    assert "DaemonUnavailable" in out and "Permission denied" in out
    print("\nRELIABILITY attack refused: another uid cannot open the 0660 socket (EACCES)")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_uid_allowlist_is_checked_with_so_peercred(daemon_factory, tmp_path):
    cfg = tmp_path / "open.toml"
    cfg.write_text('socket-mode = "666"\nchunk-size = 32\nl1-size-gb = 0.0625\n')
    _open_path_to(tmp_path)
    d = daemon_factory("--config", str(cfg), name="open")
    assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o666  # the file lets anyone connect...
    out = _as_nobody(d.socket_path)
    assert "GOT IN" not in out  # ...but the kernel-reported uid is not on the allowlist
    assert "PermissionDenied" in out
    print("\nRELIABILITY attack refused: a uid off the allowlist, on a 0666 socket, is refused (SO_PEERCRED)")


def test_a_client_cannot_register_memory_it_does_not_own(daemon):
    # The daemon copies from the pid the kernel reports (SO_PEERCRED): an address that is not
    # mapped in the client's own process is refused at registration, whatever the message claims.
    bogus = Region(0, "host", 1 << 20, addr=0x10)  # never mapped in any process
    view = View(0, 0, 1, 1 << 16, 4096, 4096)
    spec = EngineSpec("m", 1, 0, "t", 32, 16, 8192, "align", [bogus],
                      [GroupSpec(0, "full", 16, 0, 16, "bfloat16", (view,))])
    with DaemonClient(daemon.socket_path, client_name="t", role="worker") as c, \
            pytest.raises(RegistrationError):
        c.register(spec)
    print("\nRELIABILITY attack refused: registering memory the client does not map")


def test_descriptors_cannot_reach_outside_the_registered_region(daemon):
    buf = np.zeros(16 * 4096, dtype=np.int8)
    view = View(0, 0, 1, 16 * 4096, 4096, 4096)
    spec = EngineSpec("m", 1, 0, "t", 32, 16, 8192, "align", [Region(0, "host", buf.nbytes, addr=buf.ctypes.data)],
                      [GroupSpec(0, "full", 16, 0, 16, "bfloat16", (view,))])
    with DaemonClient(daemon.socket_path, client_name="t", role="worker") as c:
        c.register(spec)
        for blocks in ([15, 16], [1, 1 << 40], [-1, 2]):
            rid = c.submit_store([[0, 0, b"k" * 16, blocks]])
            comp = c.wait([rid], 10)[rid]
            assert not comp.ok
            assert isinstance(comp.error, OutOfRange), (blocks, comp.error)
    assert daemon.status()["index"]["entries"] == 0
    print("\nRELIABILITY attack refused: 3 descriptors outside the registered region, nothing copied")
