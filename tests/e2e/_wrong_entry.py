"""Test hook: run ``hkvd serve`` in a daemon that serves a wrong but well-formed entry.

``python _wrong_entry.py PYTHON -m hkvd.daemon serve ...`` (``DaemonProcess(prefix=[sys.executable, this file])``)
patches the index before the daemon starts: every lookup of an entry by key (``Index.get``: what retrieves
load and sampled-hit checks compare with) answers with the entry of the *previous* chunk of the same layout
and group when the index holds it READY, so a Mamba group serves the state of the previous boundary and an
attention group a chunk shifted by one. Hit planning (``is_ready``) is untouched: lookups still hit.

Test-only by construction: no option, flag or environment variable of the daemon reaches this code; only a
test that launches the daemon through this file gets it.
"""

from __future__ import annotations

import runpy
import sys

from hkvd.daemon.cache.entry import Entry, EntryKey, EntryState
from hkvd.daemon.cache.index import Index

_own_get = Index.get


def _previous_entry(self: Index, key: EntryKey) -> Entry | None:
    e = _own_get(self, key)
    if e is None or not e.parent:
        return e
    prev = _own_get(self, (key[0], key[1], e.parent))
    return prev if prev is not None and prev.state is EntryState.READY else e


def main() -> None:
    Index.get = _previous_entry  # type: ignore[method-assign]
    rest = sys.argv[1:]  # PYTHON -m hkvd.daemon serve ...
    if rest[1:3] != ["-m", "hkvd.daemon"]:
        raise SystemExit(f"usage: _wrong_entry.py PYTHON -m hkvd.daemon serve ...; got {rest}")
    sys.argv = ["hkvd", *rest[3:]]
    runpy.run_module("hkvd.daemon", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
