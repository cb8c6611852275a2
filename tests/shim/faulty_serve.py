# SPDX-License-Identifier: Apache-2.0
"""``hkvd serve`` that kills itself mid-copy, or kills or stops itself mid-load (fault injection, tests only).

Run like the CLI: ``HKVD_FAULT=retrieve:1 python tests/shim/faulty_serve.py serve --socket S ...``.
``HKVD_FAULT=<retrieve|store>:<n>``: the n-th copy in that direction (retrieve = pool -> engine,
store = engine -> pool, step-event states included) moves the first half of its segments into
place and then the process sends itself SIGKILL. The engine sees exactly what a real crash or
``kill -9`` mid-copy leaves: a closed socket, no Done, and half-written KV blocks on a load.

``HKVD_FAULT=places:<n>`` (SIGKILL) or ``places-stop:<n>`` (SIGSTOP): with the n-th lookup reply that
carries pool places (``LookupReply.places``, an in-step load) the process sends itself that signal, and the
reply reaches the engine once the signal has taken the daemon (a forked child writes it then): the engine
holds the places of a leased hit in the pool of a daemon that is dead or stopped, and copies the hit after
that, in the step the reply plans. A stopped daemon stays stopped until someone sends it SIGCONT. The line
it prints names the engine's process (``pid <n>``).
Without HKVD_FAULT it is plain ``hkvd serve``.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _install(fault: str) -> None:
    import hkvd.transport.wire  # noqa: F401 - first, as the daemon's own start-up imports it
    from hkvd.daemon.engines import copies
    from hkvd.transport.copy_engine import Direction

    kind, _, nth = fault.partition(":")
    if not nth.isdigit() or int(nth) < 1:
        raise SystemExit(f"faulty_serve: HKVD_FAULT={fault!r}; use retrieve:N, store:N, places:N or "
                         "places-stop:N (N >= 1)")
    if kind in ("places", "places-stop"):
        _after_places(int(nth), signal.SIGKILL if kind == "places" else signal.SIGSTOP)
        return
    want = {"retrieve": Direction.FROM_POOL, "store": Direction.TO_POOL}.get(kind)
    if want is None:
        raise SystemExit(f"faulty_serve: HKVD_FAULT={fault!r}; use retrieve:N, store:N, places:N or places-stop:N")
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


def _after_places(target: int, sig: signal.Signals) -> None:
    """Send ``sig`` to this process with the ``target``-th lookup reply that carries places, and have that reply
    reach the engine only once the signal has taken this process (dead, or stopped): a forked child writes it
    to the connection's socket then. So the engine reads the places of a daemon that is gone or stopped, and
    copies the hit afterwards, whatever the machine's load."""
    from hkvd.daemon.engines import lookup_replies, places
    from hkvd.transport.codec import encode

    of, answer = places.Places.of, lookup_replies.LookupReplies._answer
    placed = 0

    def counted_of(self, plan, *args, **kw):  # type: ignore[no-untyped-def]
        nonlocal placed
        out = of(self, plan, *args, **kw)
        placed += bool(out)
        return out

    def answer_then_signal(self, conn, engine, msg, plan):  # type: ignore[no-untyped-def]
        before, send, held = placed, conn.send, []
        conn.send = held.append
        try:
            answer(self, conn, engine, msg, plan)
        finally:
            conn.send = send
        transport = send.__self__.transport
        if not before < target <= placed or transport.get_write_buffer_size():  # no frame may be cut in two
            for m in held:
                send(m)
            return
        fd = transport.get_extra_info("socket").fileno()
        data = b"".join(encode(m) for m in held)
        print(f"faulty_serve: {sig.name} after lookup reply #{target} with places (engine {engine.engine_id}, "
              f"pid {conn.pid}, {plan.hit_chunks} chunks); the reply is written once the signal took the daemon",
              file=sys.stderr, flush=True)
        parent = os.getpid()
        if os.fork() == 0:  # the child touches no lock of the parent's threads: it polls, writes, exits
            try:
                while os.getppid() == parent and not _stopped(parent):
                    time.sleep(0.001)
                while data:  # the socket is non-blocking (and stays so: a stopped daemon resumes on it)
                    try:
                        data = data[os.write(fd, data):]
                    except BlockingIOError:
                        time.sleep(0.001)
            finally:
                os._exit(0)
        os.kill(parent, sig)

    places.Places.of = counted_of  # type: ignore[method-assign]
    lookup_replies.LookupReplies._answer = answer_then_signal  # type: ignore[method-assign]


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T in /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"T"


if __name__ == "__main__":
    if os.environ.get("HKVD_FAULT"):
        _install(os.environ["HKVD_FAULT"])
    from hkvd.daemon.cli import main

    sys.exit(main(sys.argv[1:]))
