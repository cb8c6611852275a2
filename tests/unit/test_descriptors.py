"""Out of descriptors while pinning an engine is a typed refusal naming the fix, never "the process exited".

Each check runs in a child process whose open-file table is really full (its soft limit lowered, the
free numbers taken by /dev/null), so the kernel itself answers EMFILE.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import os, resource, sys
    from hkvd.daemon.engines.client_process import ClientProcess
    from hkvd.transport.errors import KVError

    target = int(sys.argv[1])
    proc = ClientProcess.open(target)  # pinned while descriptors are plenty
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for what, call in (("open", lambda: ClientProcess.open(target)), ("check", proc.check),
                       ("pin", proc.pin_memory)):
        try:
            call()
            print(what, "ok")
        except KVError as e:
            print(what, e.code.name, e.message)
""")


@pytest.fixture
def target():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.mark.out_of_process
def test_pinning_without_a_free_descriptor_is_resource_exhausted(target: int) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(target)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    lines = {line.split(" ", 1)[0]: line for line in out.splitlines()}
    # open and pin need a descriptor each, check needs /proc files: all three are the typed refusal.
    for what in ("open", "check", "pin"):
        assert lines[what].startswith(f"{what} RESOURCE_EXHAUSTED "), out
        assert "out of file descriptors" in lines[what] and "LimitNOFILE" in lines[what], out
