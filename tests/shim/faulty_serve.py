# SPDX-License-Identifier: Apache-2.0
"""``hkvd serve`` that kills itself with SIGKILL in the middle of a copy (fault injection, tests only).

Run like the CLI: ``HKVD_FAULT=retrieve:1 python tests/shim/faulty_serve.py serve --socket S ...``.
``HKVD_FAULT=<retrieve|store>:<n>``: the n-th copy in that direction (retrieve = pool -> engine,
store = engine -> pool, step-event states included) moves the first half of its segments into
place and then the process sends itself SIGKILL. The engine sees exactly what a real crash or
``kill -9`` mid-copy leaves: a closed socket, no Done, and half-written KV blocks on a load.
Without HKVD_FAULT it is plain ``hkvd serve``.
"""

from __future__ import annotations

import os
import signal
import sys


def _install(fault: str) -> None:
    import hkvd.transport.wire  # noqa: F401 - first, as the daemon's own start-up imports it
    from hkvd.daemon.engines import copies
    from hkvd.transport.copy_engine import Direction

    kind, _, nth = fault.partition(":")
    want = {"retrieve": Direction.FROM_POOL, "store": Direction.TO_POOL}.get(kind)
    if want is None or not nth.isdigit() or int(nth) < 1:
        raise SystemExit(f"faulty_serve: HKVD_FAULT={fault!r}; use retrieve:N or store:N (N >= 1)")
    target = int(nth)
    original = copies.Copies.run
    seen = 0

    async def run_copy(self, conn, attachment, segments, direction, *args, **kw):  # type: ignore[no-untyped-def]
        nonlocal seen
        if direction is want:
            seen += 1
            if seen == target:  # copies run concurrently: `seen` may move on while this one awaits
                half = segments[: max(1, len(segments) // 2)]
                await original(self, conn, attachment, half, direction, *args, **kw)
                print(f"faulty_serve: SIGKILL in {kind} copy #{target} after {len(half)}/{len(segments)} segments",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return await original(self, conn, attachment, segments, direction, *args, **kw)

    copies.Copies.run = run_copy  # type: ignore[method-assign]


if __name__ == "__main__":
    if os.environ.get("HKVD_FAULT"):
        _install(os.environ["HKVD_FAULT"])
    from hkvd.daemon.cli import main

    sys.exit(main(sys.argv[1:]))
