"""The daemon copies only the memory of the process that connected, as it was when it connected.

The attack: an allowed unprivileged user connects, forks a child that keeps the socket, and the
parent (the pid the kernel reported) execs a setuid-root program that holds a root-only secret.
The child then asks the daemon, which runs as root, to copy that program's memory. Each test runs
the attack against a real daemon and a real setuid-root program (a setuid copy of Python).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hkvd.shim.client import DaemonClient
from hkvd.transport.copy_engine import Region
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.control import EngineSpec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs clients as nobody and a setuid program")

NOBODY = 65534
ADDR = 0x6D0000000000  # where the setuid program keeps its secret (a non-PIE binary's data is this predictable)
SIZE = 16 * 4096
SECRET = b"root-only secret " * 8

# The setuid-root program: maps the secret at ADDR, says "ready", then on "dump" reports its buffer.
VICTIM = textwrap.dedent("""
    import ctypes, os, sys
    out, inp, secret, addr, size = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    p = libc.mmap(addr, size, 3, 0x22 | 0x100000, -1, 0)  # PRIVATE|ANONYMOUS|FIXED_NOREPLACE
    data = open(secret, "rb").read()
    ctypes.memmove(p + 4096, data, len(data))  # in block 1, where the registered region's chunk starts
    os.write(out, b"ready %d %d\\n" % (os.getuid(), os.geteuid()))
    os.read(inp, 16)
    os.write(out, ctypes.string_at(p + 4096, len(data)).hex().encode() + b"\\n")
    os.read(inp, 16)
""")


def _traversable(path: Path) -> None:
    for d in [path, *path.parents]:
        if str(d) in ("/", "/tmp"):
            break
        os.chmod(d, os.stat(d).st_mode | 0o011)


def _setuid_python(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A setuid-root Python that ``nobody`` can run, and the environment it needs."""
    d = tmp_path / "suid"
    d.mkdir()
    _traversable(d)
    ours = (os.path.realpath(sys.executable), {"PYTHONHOME": sys.base_prefix})
    for candidate, env in (("/usr/bin/python3", {}), ours):
        if not os.path.exists(candidate):
            continue
        exe = d / "python-suid"
        shutil.copy(os.path.realpath(candidate), exe)
        os.chown(exe, 0, 0)
        os.chmod(exe, 0o4755)
        probe = subprocess.run([str(exe), "-I", "-c", "import os; print(os.geteuid())"], capture_output=True,
                               text=True, timeout=60, env=env, user=NOBODY, group=NOBODY, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == "0":
            return str(exe), env
        exe.unlink()
    pytest.skip("no Python runs setuid-root here (a nosuid mount?)")


def _spec(addr: int) -> EngineSpec:
    view = View(0, 0, 1, SIZE, 4096, 4096)
    return EngineSpec("m", 1, 0, "t", 32, 16, 8192, "align", [Region(0, "host", SIZE, addr=addr)],
                      [GroupSpec(0, "full", 16, 0, 16, "bfloat16", (view,))])


def _mmap_fixed(addr: int, fill: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    assert libc.mmap(addr, SIZE, 3, 0x22 | 0x100000, -1, 0) == addr
    ctypes.memset(addr, fill[0], SIZE)


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "DONE"


def _attack(socket_path: str, suid: str, env: dict[str, str], secret: Path, before_exec: Callable[[Any], None],
            after_exec: Callable[[Any], list[str]]) -> tuple[list[str], bytes, str]:
    """Run the attack; return what the child saw, the setuid program's buffer at the end, and its ids."""
    v_out_r, v_out_w = os.pipe()
    v_in_r, v_in_w = os.pipe()
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    attacker = os.fork()
    if attacker == 0:  # the allowed user: connects, then forks a child and execs the setuid program
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            c = DaemonClient(socket_path, client_name="attacker", role="worker", timeout_s=10)
            c.connect()
            before_exec(c)
            if os.fork() == 0:  # the child keeps the socket
                os.read(go_r, 16)
                lines = after_exec(c)
                os.write(res_w, ("\n".join(lines) + "\n").encode()[:60000])
                os._exit(0)
            os.set_inheritable(v_out_w, True)
            os.set_inheritable(v_in_r, True)
            os.execve(suid, [suid, "-I", "-c", VICTIM, str(v_out_w), str(v_in_r), str(secret), str(ADDR),
                             str(SIZE)], env)
        except BaseException as e:  # shown by the assertion below: the program never says ready
            os.write(v_out_w, f"attacker failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(code)
    for fd in (v_out_w, v_in_r, res_w, go_r):
        os.close(fd)
    with os.fdopen(v_out_r, "rb") as v_out, os.fdopen(res_r, "rb") as res:
        ready = v_out.readline().decode()
        assert ready.startswith("ready"), f"the setuid program did not start: {ready!r}"
        os.write(go_w, b"go")
        seen = res.read().decode().splitlines()
        os.write(v_in_w, b"dump")
        buffer = bytes.fromhex(v_out.readline().decode().strip())
        os.write(v_in_w, b"exit")
    os.waitpid(attacker, 0)
    for fd in (go_w, v_in_w):
        os.close(fd)
    return seen, buffer, ready.strip()


@pytest.fixture
def setup(daemon_factory: Any, tmp_path: Path) -> tuple[Any, str, dict[str, str], Path]:
    _traversable(tmp_path)
    cfg = tmp_path / "open.toml"
    cfg.write_text('socket-mode = "666"\nchunk-size = 32\nl1-size-gb = 0.0625\nallowed-uids = [0, 65534]\n')
    d = daemon_factory("--config", str(cfg), name="deputy")
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)  # root's
    suid, env = _setuid_python(tmp_path)
    return d, suid, env, secret


def test_a_setuid_exec_under_the_connected_pid_cannot_be_registered(setup: Any) -> None:
    d, suid, env, secret = setup

    def after(c: Any) -> list[str]:
        return [_outcome(lambda: c.register(_spec(ADDR)))]

    seen, buffer, ids = _attack(d.socket_path, suid, env, secret, lambda c: None, after)
    assert ids == f"ready {NOBODY} 0"  # the program really ran setuid root, under the connected pid
    assert seen[0].startswith("PermissionDenied") and "changed credentials" in seen[0], seen
    assert hex(ADDR) not in seen[0] and "mapped" not in seen[0]  # the reply maps nothing
    assert buffer == SECRET
    assert d.status()["engines"] == []
    print(f"\nRELIABILITY attack refused: register after a setuid exec under the connected pid: {seen[0][:90]}")


def test_an_exec_after_registration_stops_every_copy(setup: Any) -> None:
    d, suid, env, secret = setup

    def before(c: Any) -> None:  # register and store a chunk of the attacker's own memory at ADDR
        _mmap_fixed(ADDR, b"A")
        c.register(_spec(ADDR))
        rid = c.submit_store([[0, 0, b"a" * 16, [1, 2]]])
        comp = c.wait([rid], 10)[rid]
        assert comp.ok, comp.error

    def after(c: Any) -> list[str]:
        out = []
        for submit in (lambda: c.submit_store([[0, 0, b"s" * 16, [1, 2]]]),  # would read the secret
                       lambda: c.submit_retrieve([[0, 0, b"a" * 16, [1, 2]]])):  # would overwrite it
            rid = submit()
            comp = c.wait([rid], 10)[rid]
            out.append("DONE" if comp.ok else f"{type(comp.error).__name__}: {comp.error}")
        return out

    seen, buffer, _ = _attack(d.socket_path, suid, env, secret, before, after)
    assert len(seen) == 2 and all(s.startswith("PermissionDenied") for s in seen), seen
    assert buffer == SECRET  # nothing was written into the setuid program
    assert d.status()["index"]["entries"] == 1  # the attacker's own chunk; nothing of the secret was kept
    log = Path(d.log_path).read_text()
    assert "internal error" not in log.lower()
    print(f"\nRELIABILITY attack refused: store and retrieve after an exec under a registered pid: {seen[0][:90]}")


def test_an_engine_that_exited_is_never_copied() -> None:
    # A process that exits after registering: its pid may name another process later. Every copy
    # checks the pinned address space first, so the copy fails typed before any byte moves.
    import numpy as np

    buf = np.ones(SIZE, dtype=np.int8)  # before the fork: the child maps it at the same address
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    from hkvd.daemon.cache.pool import HugePagePool
    from hkvd.daemon.engines.host_engine import HostCopyEngine
    from hkvd.transport.copy_engine import Direction, Segment
    from hkvd.transport.errors import CopyFailedError

    pool = HugePagePool(32 << 20, "off")
    engine = HostCopyEngine(pool)
    try:
        att = engine.attach(child, [Region(0, "host", SIZE, addr=buf.ctypes.data)])  # fork: same address
        os.close(w)
        os.waitpid(child, 0)
        with pytest.raises(CopyFailedError, match="has exited"):
            engine.copy(att, [Segment(0, 0, 0, 4096)], Direction.TO_POOL)
        engine.detach(att)
    finally:
        engine.close()
        pool.close()
