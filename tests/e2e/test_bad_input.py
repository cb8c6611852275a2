"""Bad input gets a typed error, loses nothing, and never hurts another client."""

from __future__ import annotations

import bisect
import itertools
import socket
import struct
import time
from pathlib import Path

import msgpack
import pytest

from hkvd.shim.client import DaemonClient
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ErrorCode
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import PROTOCOL_VERSION, control, kv


def raw_conn(path: str, hello: bool = True) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    if hello:
        s.sendall(encode(control.Hello(PROTOCOL_VERSION, "raw", "tool")))
        assert isinstance(read_msgs(s, 1)[0], control.HelloAck)
    return s


def read_msgs(s: socket.socket, n: int) -> list:
    dec = FrameDecoder()
    out: list = []
    while len(out) < n:
        data = s.recv(65536)
        if not data:
            break
        out += [decode_body(b) for b in dec.feed(data)]
    return out


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", ErrorCode.PROTOCOL_VIOLATION),  # malformed msgpack
        (frame({"not": "a list"}), ErrorCode.PROTOCOL_VIOLATION),
        (frame([9999, 1]), ErrorCode.UNKNOWN_MESSAGE),
        (frame([20, 1, "not-a-list", True]), ErrorCode.PROTOCOL_VIOLATION),  # Lookup with a bad field
        (frame([20, 1, [b"short"], True]), ErrorCode.PROTOCOL_VIOLATION),
        (frame([22, 5, [[0, 0, b"x" * 16, [1]]]]), ErrorCode.NOT_REGISTERED),  # store before register
        (frame([20, 6, [], True]), ErrorCode.NOT_REGISTERED),
    ],
)
def test_bad_frames_get_typed_errors_and_the_connection_keeps_serving(daemon, payload, code):
    s = raw_conn(daemon.socket_path)
    s.sendall(payload)
    (err,) = read_msgs(s, 1)
    assert isinstance(err, kv.Error)
    assert err.code == code
    s.sendall(encode(control.Ping(77)))
    (pong,) = read_msgs(s, 1)
    assert pong == control.Pong(77)
    s.close()


def test_oversized_frame_is_refused_and_other_clients_unaffected(daemon):
    good = SyntheticEngine(daemon.socket_path, [GroupShape("full", 1, 4096)])
    keys = chunk_keys(prompt_tokens(64, seed=1), good.chunk_size)
    items = good.items(0, keys, first_block=1)
    good.store(items)
    s = raw_conn(daemon.socket_path)
    s.sendall(struct.pack(">I", 1 << 30))  # claims a 1 GiB body
    (err,) = read_msgs(s, 1)
    assert err.code == ErrorCode.FRAME_TOO_LARGE
    assert s.recv(1) == b""  # closed: the stream cannot be resynchronised
    assert good.lookup(keys, lease=False)[0] == 2  # the other client is fine
    good.close()


def test_wrong_protocol_version_is_refused(daemon):
    s = raw_conn(daemon.socket_path, hello=False)
    s.sendall(encode(control.Hello(PROTOCOL_VERSION + 41, "future", "tool")))
    (err,) = read_msgs(s, 1)
    assert err.code == ErrorCode.UNSUPPORTED_VERSION
    assert (f"client speaks protocol {PROTOCOL_VERSION + 41}, this daemon speaks protocol {PROTOCOL_VERSION}; run the "
            "shim and hkvd serve from the same hkvd version") in err.message, err.message


def test_first_message_must_be_hello(daemon):
    s = raw_conn(daemon.socket_path, hello=False)
    s.sendall(encode(control.Ping(1)))
    (err,) = read_msgs(s, 1)
    assert err.code == ErrorCode.PROTOCOL_VIOLATION


def test_a_flood_of_garbage_closes_only_that_connection(daemon):
    s = raw_conn(daemon.socket_path)
    # One write (a few hundred bytes: the socket buffer takes it whole): frame by frame, the daemon
    # could close the connection between two sends, and the next one would fail with EPIPE.
    s.sendall(b"".join(frame([9000 + i]) for i in range(40)))
    msgs = read_msgs(s, 100)
    assert 0 < len(msgs) <= 40 and all(m.code == ErrorCode.UNKNOWN_MESSAGE for m in msgs)
    with DaemonClient(daemon.socket_path, client_name="ok", role="tool") as c:
        c.ping()


def test_a_client_that_never_reads_its_replies_is_cut_off_without_slowing_others(daemon_factory):
    """Flow control: the daemon stops reading a client whose replies pile up, then drops it after
    --io-timeout-s; a second client is served the whole time."""
    d = daemon_factory("--l1-size-gb", "0.125", "--io-timeout-s", "2")
    flooder = raw_conn(d.socket_path)
    flooder.setblocking(False)
    pings = encode(control.Ping(7)) * 400_000  # 3.6 MB: far more than both socket buffers hold
    sent = 0
    while sent < len(pings):  # until both socket buffers are full: the daemon stopped reading us
        try:
            sent += flooder.send(pings[sent:sent + 65536])
        except BlockingIOError:
            break
    assert sent < len(pings), "the daemon read every request although no reply was read"
    with DaemonClient(d.socket_path, client_name="bystander", role="tool", timeout_s=5.0) as other:
        for _ in range(20):
            assert other.ping() < 5.0
    time.sleep(3.0)  # past --io-timeout-s with the replies still unread
    flooder.setblocking(True)
    flooder.settimeout(15)
    got = b""
    try:
        while chunk := flooder.recv(1 << 20):  # the replies already buffered, then EOF or a reset
            got += chunk
    except ConnectionResetError:
        pass
    assert len(got) < len(encode(control.Pong(7))) * 400_000  # cut off: not every request was answered
    assert "no progress reading its replies" in d.log_path.read_text()


def test_uncacheable_requests_are_counted_by_reason_and_bad_reasons_refused(daemon):
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 1, 4096)])
    eng.client.uncacheable("unknown_extra_key_x")
    eng.client.uncacheable("unknown_extra_key_x")
    eng.client.uncacheable("extra_keys_failed")
    assert eng.client.status()["uncacheable_requests"] == {"unknown_extra_key_x": 2, "extra_keys_failed": 1}
    s = raw_conn(daemon.socket_path)
    s.sendall(encode(kv.Uncacheable("x")))  # before registering: not an engine's request
    (err,) = read_msgs(s, 1)
    assert err.code == ErrorCode.NOT_REGISTERED
    s.sendall(frame([29, "Bad Reason!"]))
    (err,) = read_msgs(s, 1)
    assert err.code == ErrorCode.PROTOCOL_VIOLATION
    assert eng.client.status()["uncacheable_requests"] == {"unknown_extra_key_x": 2, "extra_keys_failed": 1}
    eng.close()


def test_abort_after_unregister_is_answered_not_an_internal_error(daemon):
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 1, 4096)])
    with eng.client._lock:  # a frame the client API never sends on its own: Unregister, then an Abort
        eng.client._conn.send_bytes(encode(control.Unregister(91)))
    eng.client.abort(92)  # the snapshot ordering of the engine is gone; the abort is still answered
    st = eng.client.status()  # the connection keeps serving
    assert st["counters"].get("internal_errors", 0) == 0
    assert st["engines"] == []
    eng.close()


def test_a_region_that_wraps_the_address_space_is_refused(daemon):
    import numpy as np

    from hkvd.shim.client import DaemonClient
    from hkvd.transport.copy_engine import Region
    from hkvd.transport.errors import RegistrationError
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire.control import EngineSpec

    buf = np.zeros(4096, dtype=np.int8)
    huge = Region(0, "host", (1 << 64) - 1, addr=buf.ctypes.data)  # its end wraps to just below the start
    spec = EngineSpec("m", 1, 0, "t", 32, 16, 8192, "align", [huge],
                      [GroupSpec(0, "full", 16, 0, 16, "bfloat16", (View(0, 0, 1, 16 * 4096, 4096, 4096),))])
    with DaemonClient(daemon.socket_path, client_name="t", role="worker") as c, \
            pytest.raises(RegistrationError, match="64-bit address space"):
        c.register(spec)
    assert daemon.status()["counters"].get("internal_errors", 0) == 0


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_sliding_window_of_zero_is_a_registration_error_on_either_side(daemon, role):
    import numpy as np

    from hkvd.shim.client import DaemonClient
    from hkvd.transport.copy_engine import Region
    from hkvd.transport.errors import RegistrationError
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire.control import EngineSpec

    buf = np.zeros(2 * 16 * 4096, dtype=np.int8)
    views = (View(0, 0, 1, 16 * 4096, 4096, 4096),), (View(0, 16 * 4096, 1, 16 * 4096, 4096, 4096),)
    regions = [Region(0, "host", buf.nbytes, addr=buf.ctypes.data)] if role == "worker" else []
    spec = EngineSpec("m", 1, 0, "t", 32, 16, 8192, "align", regions,
                      [GroupSpec(0, "full", 16, 0, 16, "bfloat16", views[0]),
                       GroupSpec(1, "swa", 16, 0, 16, "bfloat16", views[1])])
    with DaemonClient(daemon.socket_path, client_name="t", role=role) as c, \
            pytest.raises(RegistrationError) as e:
        c.register(spec)
    assert "group 1: an swa group needs window_tokens > 0" in str(e.value)
    assert "group 1: group 1" not in str(e.value)
    assert daemon.status()["counters"].get("internal_errors", 0) == 0


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_burst_of_requests_with_unread_replies_is_not_served_ahead(daemon_factory):
    """One write of 40,000 Status requests whose replies are never read: the daemon serves what fits
    before its writes pause, holds the rest unserved, and serves another client meanwhile. Serving the
    whole burst would buffer every reply (tens of MB) in the daemon."""
    d = daemon_factory("--l1-size-gb", "0.125", "--io-timeout-s", "5")
    d.wait_status(lambda s: s["pool"]["prefault"]["done"], 60)  # the pool's pages are all in RSS already
    with DaemonClient(d.socket_path, client_name="bystander", role="tool", timeout_s=10.0) as other:
        reply = len(encode(control.StatusReply(1, other.status())))
        before = _rss_bytes(d.proc.pid)
        flooder = raw_conn(d.socket_path)
        frames = [encode(control.Status(i)) for i in range(40_000)]
        burst = b"".join(frames)
        # Written without blocking, for at most a second: what the socket buffers and the daemon's reads take
        # before its reads pause depends on the size of a status reply and the machine's pace; a blocking
        # write of what remains would stall until the daemon closes the link for not reading its replies.
        flooder.setblocking(False)
        sent, deadline = 0, time.monotonic() + 1.0
        while sent < len(burst) and time.monotonic() < deadline:
            try:
                sent += flooder.send(burst[sent:])
            except BlockingIOError:
                time.sleep(0.01)
        requests = bisect.bisect_right(list(itertools.accumulate(map(len, frames))), sent)
        assert requests >= 10_000, f"only {requests} requests of the burst were taken: the test proves nothing"
        for _ in range(20):
            assert other.ping() < 10.0
        grown = _rss_bytes(d.proc.pid) - before
        assert grown < requests * reply // 4, (grown, reply, requests)  # far from every reply buffered
        assert other.status()["counters"].get("internal_errors", 0) == 0
    flooder.close()


def test_a_register_with_a_million_views_is_refused_and_others_keep_serving(daemon):
    from hkvd.transport.wire.control import MAX_TOTAL_VIEWS

    view = [0, 0, 1, 4096, 4096, 4096]
    group = {"group_id": 0, "kind": "full", "tokens_per_block": 16, "window_tokens": 0, "num_blocks": 16,
             "dtype": "bfloat16", "views": [view] * 4096}
    spec = {"model": "m", "world_size": 1, "rank": 0, "layout_tag": "t", "chunk_size": 32, "block_size": 16,
            "max_num_batched_tokens": 8192, "mamba_cache_mode": "align", "regions": [], "identity": "",
            "groups": [{**group, "group_id": i} for i in range(256)]}  # 256 x 4096 views: a 13.7 MB frame
    frame = encode(control.Register(7, spec))
    assert len(frame) > 13 << 20 and MAX_TOTAL_VIEWS < 256 * 4096
    s = raw_conn(daemon.socket_path)
    s.sendall(frame)
    with DaemonClient(daemon.socket_path, client_name="other", role="tool") as other:
        assert other.ping() >= 0  # another client is served meanwhile
    reply = read_msgs(s, 1)[0]
    assert isinstance(reply, kv.Error) and reply.code == ErrorCode.PROTOCOL_VIOLATION
    assert f"at most {MAX_TOTAL_VIEWS} views in all groups" in reply.message
    s.close()
    assert daemon.status()["counters"].get("internal_errors", 0) == 0 and daemon.status()["engines"] == []
