"""The transport host: a child process that owns the daemon's NIXL agent (``python -m hkvd.transport.nixl.host``).

Role
    UCX can crash the process it runs in when one peer is misconfigured: a pulling daemon whose UCX
    address the serving daemon cannot route to (multi-homed node, ``UCX_NET_DEVICES`` pinned to the
    other interface) made the serving daemon exit with SIGSEGV inside UCX in 3 of 4 runs
    (tests/peer/test_netns.py). So the daemon never loads NIXL itself: ``hkvd.transport.nixl.hosted``
    spawns this process, which maps the daemon's pool (its memfd, inherited), registers it with a
    ``NixlTransport`` and serves the daemon's calls and READs over a socketpair
    (``hkvd.transport.nixl.host_wire``). A crash here ends this process only; the daemon fails the READs
    that were in flight, keeps serving its engines and starts a new host.

Threading
    One asyncio loop reads the pipe; the ``NixlTransport`` runs its own NIXL thread as in-process.

Lifecycle
    spawned with ``--sock FD --mem FD --size BYTES`` -> maps the pool -> ``start`` (agent up) ->
    ``register`` / ``metadata`` / ``add_peer`` / READs -> the pipe closes (the daemon stops or died)
    -> the agent is closed (READs in flight settle or are cut off) -> ``os._exit``. Exiting skips
    the interpreter's teardown: NIXL's destructors at interpreter exit segfaulted in every daemon
    that loaded it (exit status -11 after "hkvd stopped"), and nothing is left to flush.
    ``PR_SET_PDEATHSIG`` ends this process if the daemon is killed while this loop is stuck.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import signal
import socket
import sys
import threading
from typing import Any

from hkvd.transport.errors import InternalError, KVError
from hkvd.transport.nixl.agent import NixlTransport
from hkvd.transport.nixl.host_wire import CALL, ERR, OK, READ, SETTLED, Decoder, FrameError, encode, unpack_descs

log = logging.getLogger("hkvd.nixl_host")

CLOSE_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


class _Host:
    """Dispatches the daemon's messages to one ``NixlTransport`` over the pool mapped at ``base``."""

    def __init__(self, writer: asyncio.StreamWriter, base: int, size: int) -> None:
        self.writer = writer
        self.base = base
        self.size = size
        self.transport: NixlTransport | None = None

    async def call(self, op: str, args: list[Any]) -> Any:
        t = self.transport
        if op == "start":
            name, backends, delay_us = args
            self.transport = NixlTransport(str(name), backends=tuple(backends), progress_delay_us=int(delay_us))
            await self.transport.start(60.0)
            return self.base
        if t is None:
            raise InternalError(f"transport host: {op} before start")
        match op:
            case "register":
                offset, nbytes = int(args[0]), int(args[1])
                if offset < 0 or offset + nbytes > self.size:
                    raise InternalError(f"register [{offset}, +{nbytes}) outside the {self.size}-byte pool mapping")
                await t.register(self.base + offset, nbytes)
                return None
            case "metadata":
                return await t.metadata()
            case "add_peer":
                return await t.add_peer(bytes(args[0]))
            case "remove_peer":
                await t.remove_peer(str(args[0]))
                return None
            case _:
                raise InternalError(f"transport host: unknown call {op!r}")

    async def answer(self, call_id: int, op: str, args: list[Any]) -> None:
        try:
            value = await self.call(op, args)
        except KVError as e:
            self.send([ERR, call_id, int(e.code), e.message])
        except Exception as e:
            log.exception("transport host: %s failed", op)
            self.send([ERR, call_id, int(InternalError.code), f"{op} failed in the transport host: {e!r}"])
        else:
            self.send([OK, call_id, value])

    def read(self, xfer_id: int, peer: str, packed: bytes) -> None:
        if self.transport is None:
            self.send([SETTLED, xfer_id, 0, int(InternalError.code), "READ before start"])
            return
        transfer = self.transport.read(peer, unpack_descs(packed))

        def settled(f: asyncio.Future[int]) -> None:
            exc = None if f.cancelled() else f.exception()
            if f.cancelled() or exc is not None:
                code = exc.code if isinstance(exc, KVError) else InternalError.code
                self.send([SETTLED, xfer_id, 0, int(code), str(exc or "cancelled")])
            else:
                self.send([SETTLED, xfer_id, f.result(), 0, ""])

        transfer.settled.add_done_callback(settled)

    def send(self, msg: list[object]) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))


MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the pages are the daemon's, already faulted (or about to be)
POPULATE_STEP = 256 << 20


def _populate(mapping: mmap.mmap, size: int) -> None:
    with contextlib.suppress(OSError):
        mapping.madvise(MADV_HUGEPAGE)  # like the daemon's own mapping, where THP backs the pool
    for start in range(0, size, POPULATE_STEP):
        try:
            mapping.madvise(MADV_POPULATE_WRITE, start, min(POPULATE_STEP, size - start))
        except (OSError, ValueError):
            return  # an old kernel, or the pool is going away: READs fault pages in as they go


async def serve(sock_fd: int, mem_fd: int, size: int) -> None:
    mapping = mmap.mmap(mem_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(mem_fd)
    # A fresh mapping of the daemon's pages has no page tables: every page a READ touches would fault
    # first (measured: READs at a third of a bare agent's rate). Map them in, behind serving.
    threading.Thread(target=_populate, args=(mapping, size), name="hkvd-host-populate", daemon=True).start()
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=sock_fd))
    host = _Host(writer, base, size)
    decoder = Decoder()
    try:
        async with asyncio.TaskGroup() as tg:
            while data := await reader.read(1 << 20):
                for msg in decoder.feed(data):
                    if msg[0] == CALL:
                        tg.create_task(host.answer(int(msg[1]), str(msg[2]), list(msg[3:])))
                    elif msg[0] == READ:
                        host.read(int(msg[1]), str(msg[2]), bytes(msg[3]))
                    else:
                        raise FrameError(f"unexpected message kind {msg[0]} from the daemon")
    finally:
        if host.transport is not None:
            await host.transport.aclose(CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            writer.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hkvd.transport.nixl.host", description=__doc__.splitlines()[0])
    p.add_argument("--sock", type=int, required=True, help="this end of the daemon's socketpair")
    p.add_argument("--mem", type=int, required=True, help="the pool's memfd")
    p.add_argument("--size", type=int, required=True, help="bytes of the pool to map")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    with contextlib.suppress(Exception):  # best effort: not every libc exposes prctl
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format='ts=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg="%(message)s"')
    rc = 0
    try:
        asyncio.run(serve(args.sock, args.mem, args.size))
    except BaseException:
        log.exception("the transport host failed")
        rc = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()
