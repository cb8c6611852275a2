"""Fuzz a real daemon with >= 10^5 frames; count typed errors, crashes (0) and harm to others (0).

Frames are mutations of valid messages (wrong types, huge lengths and counts, unknown types,
out-of-range and null block ids, bad keys, wrong versions) and random msgpack values. A bystander
engine stores a prefix before the storm and must read it back byte-exact afterwards. The figures
are printed for the README's reliability section. HKVD_FUZZ_FRAMES raises the count for long runs.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading

import msgpack

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ErrorCode
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import PROTOCOL_VERSION, control, kv

FRAMES = int(os.environ.get("HKVD_FUZZ_FRAMES", "100000"))
CONNECTIONS = 8


def _value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(9 if depth < 2 else 6)
    return [
        lambda: rng.randrange(-(1 << 63), (1 << 64) - 1),
        lambda: rng.choice([0, 1, -1, 2**32, 2**64 - 1, 255]),
        lambda: rng.random() * 1e9,
        lambda: rng.randbytes(rng.choice([0, 1, 15, 16, 17, 64])),
        lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(8))),
        lambda: rng.choice([None, True, False]),
        lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {str(i): _value(rng, depth + 1) for i in range(rng.randrange(3))},
        lambda: [rng.randrange(0, 30), rng.randrange(0, 9), rng.randbytes(16), [rng.randrange(-2, 1 << 20)]],
    ][pick]()


def _frame(rng: random.Random, key: bytes) -> bytes:
    kind = rng.randrange(10)
    if kind == 0:  # random msgpack with a random (often known) type number
        body = msgpack.packb([rng.choice([1, 3, 20, 22, 23, 25, 28, 40, 99, 65535]),
                              *(_value(rng) for _ in range(rng.randrange(5)))], use_bin_type=True)
    elif kind == 1:  # raw garbage body
        body = rng.randbytes(rng.randrange(1, 64))
    elif kind == 2:  # store with out-of-range / null / negative blocks and odd groups
        body = msgpack.packb([22, rng.randrange(1 << 40), [[rng.randrange(-1, 9), rng.randrange(0, 4), key,
                                                             [rng.choice([0, -5, 1 << 40, 3])]]]],
                             use_bin_type=True)
    elif kind == 3:  # lookup with huge key lists or short keys
        n = 70000 if rng.random() < 0.01 else rng.choice([0, 1, 3])
        body = msgpack.packb([20, 1, [key if rng.random() < 0.9 else b"x"] * n, True], use_bin_type=True)
    elif kind == 4:  # retrieve with a forged lease
        body = msgpack.packb([23, 7, rng.randrange((1 << 64) - 1), [[0, 0, key, [1, 2]]]], use_bin_type=True)
    elif kind == 5:  # hello again, wrong version
        body = msgpack.packb([1, rng.randrange(100), "x", "worker"], use_bin_type=True)
    elif kind == 6:  # step event with impossible values
        body = msgpack.packb([40, 1, rng.choice([-1, 0, (1 << 64) - 1]), 0, [[1, 0, key, [1, 2]]], ["x"]],
                             use_bin_type=True)
    elif kind == 7:  # register with broken specs
        body = msgpack.packb([3, 1, {"model": 1, "regions": [{"size": -1}], "groups": "x"}], use_bin_type=True)
    elif kind == 8:  # a valid ping (keeps the connection honest)
        body = msgpack.packb(control.Ping(rng.randrange(1 << 32)).to_wire(), use_bin_type=True)
    else:  # release of a random lease (no reply) followed by a ping
        body = msgpack.packb([28, rng.randrange((1 << 64) - 1)], use_bin_type=True)
    return struct.pack(">I", len(body)) + body


class Tally:
    def __init__(self) -> None:
        self.errors = 0
        self.closed = 0
        self.codes: dict[str, int] = {}


def _reader(s: socket.socket, tally: Tally) -> None:
    """Drain replies continuously, so the daemon's writes never back up behind our sends."""
    dec = FrameDecoder()
    try:
        while data := s.recv(1 << 20):
            for body in dec.feed(data):
                msg = decode_body(body)
                if isinstance(msg, kv.Error):
                    tally.errors += 1
                    name = ErrorCode(msg.code).name
                    tally.codes[name] = tally.codes.get(name, 0) + 1
    except OSError:
        pass
    tally.closed += 1


def _storm(path: str, rng: random.Random, key: bytes, n: int, tally: Tally) -> int:
    """Send ``n`` frames, reconnecting whenever the daemon closes a connection; returns frames sent."""
    sent = 0
    while sent < n:
        s = _connect(path)
        t = threading.Thread(target=_reader, args=(s, tally), daemon=True)
        t.start()
        try:
            while sent < n:
                batch = [_frame(rng, key) for _ in range(min(64, n - sent))]
                s.sendall(b"".join(batch))
                sent += len(batch)
        except OSError:
            pass  # closed by the daemon (too many bad requests in a row): reconnect
        s.shutdown(socket.SHUT_WR)
        t.join(60)
        s.close()
    return sent


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    s.sendall(encode(control.Hello(PROTOCOL_VERSION, "fuzz", "tool")))
    return s


def test_fuzz_frames_get_typed_errors_and_hurt_no_one(daemon):
    bystander = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, 4096)], num_blocks=64)
    keys = chunk_keys(prompt_tokens(32 * 4, seed=99), bystander.chunk_size)
    items = bystander.items(0, keys, first_block=1)
    blocks = [b for it in items for b in it.block_ids]
    bystander.fill_random(0, blocks, seed=3)
    before = [bystander.block_bytes(0, b) for b in blocks]
    bystander.store(items)

    rng = random.Random(20261122)
    sent = 0
    per_conn = FRAMES // CONNECTIONS
    tally = Tally()
    for _ in range(CONNECTIONS):
        sent += _storm(daemon.socket_path, rng, keys[0], per_conn, tally)
    errors, codes, reconnects = tally.errors, tally.codes, tally.closed

    assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon crashed"
    # The bystander is unharmed: its entries are intact and byte-exact.
    hit, lease = bystander.lookup(keys)
    assert hit == len(keys)
    bystander.zero(0, blocks)
    bystander.retrieve(items, lease)
    assert [bystander.block_bytes(0, b) for b in blocks] == before
    st = daemon.status()
    assert st["index"]["writing"] == 0 and st["index"]["pinned_entries"] == 0
    assert errors > 0 and "INTERNAL" not in codes, codes  # every rejection was typed, none a bug
    print(f"\nRELIABILITY fuzz: frames sent {sent}, typed errors {errors}, crashes 0, other-client failures 0, "
          f"connections {reconnects}, by code {codes}")
    bystander.close()
