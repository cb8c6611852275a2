"""Attacks on the peer link (``hkvd serve --peer-listen``): only an allowlisted address that proves
the shared token gets anything, the token never crosses the wire, a proof cannot be replayed, and
bad input gets a typed error and a closed connection while the daemon keeps serving real peers.
Strangers cannot make the daemon hold memory or descriptors: it reads nothing from a refused address,
at most a handshake-sized frame before authentication, and caps connections per address and in all
(within a quarter of its open-file limit, so engines still reach the control socket).

The attacker here is a raw socket speaking our frames; the victims are real daemons."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hkvd.daemon.peers.auth import client_proof, server_proof
from hkvd.daemon.peers.serving import PREAUTH_MAX_FRAME_BYTES, REQUEST_MAX_FRAME_BYTES, fd_caps
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ErrorCode, PermissionDenied
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import KEY_BYTES, MAX_KEYS, Message, MsgType, kv
from hkvd.transport.wire.peer import (
    FINGERPRINT_BYTES,
    MAX_FINGERPRINTS,
    PEER_VERSION,
    PeerAuth,
    PeerChallenge,
    PeerHello,
    PeerLookup,
    PeerRelease,
    PeerWelcome,
)

PEERLIB = Path(__file__).resolve().parents[1] / "peer" / "peerlib.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hkvd_test_peerlib_fault", PEERLIB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lib = _load()
pytestmark = [pytest.mark.ucx, pytest.mark.skipif(lib.nixl_missing() is not None, reason=str(lib.nixl_missing()))]
FULL = [GroupShape("full", 2, 8192)]


class Raw:
    """An attacker's connection: raw frames, no checks of its own; ``source``: the local address to
    connect from (any of 127.0.0.0/8 on loopback, so that caps per address can be told apart)."""

    def __init__(self, address: str, source: str = "", timeout_s: float = 10) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s,
                                             source_address=(source, 0) if source else None)
        self.dec = FrameDecoder()
        self.frames: list[bytes] = []
        self.received = b""

    def send(self, msg: Message | bytes) -> None:
        self.sock.sendall(msg if isinstance(msg, bytes) else encode(msg))

    def recv(self) -> Message | None:
        """The next message, or None at EOF."""
        while not self.frames:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.received += data
            self.frames.extend(self.dec.feed(data))
        return decode_body(self.frames.pop(0))

    def close(self) -> None:
        self.sock.close()


def _serving(pair_factory: Any, **kw: Any) -> tuple[Any, Any, list[bytes], bytes]:
    prefill, decode = pair_factory(**kw)
    eng = SyntheticEngine(prefill.socket_path, FULL, num_blocks=64)
    keys = chunk_keys(prompt_tokens(32 * 4, seed=1), eng.chunk_size)
    eng.fill_random(0, range(1, 9), seed=2)
    eng.store(eng.items(0, keys, first_block=1))
    return prefill, decode, keys, eng.fingerprint


@pytest.fixture
def pair_factory(tmp_path: Path) -> Any:
    started: list[Any] = []

    def make(**kw: Any) -> tuple[Any, Any]:
        prefill, decode = lib.start_pair(tmp_path, **kw)
        started.extend((prefill, decode))
        return prefill, decode

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.stop(20)


def _pull(socket_path: str, peer: str, keys: list[bytes]) -> Any:
    eng = SyntheticEngine(socket_path, FULL, num_blocks=64)
    rid = eng.client.submit_pull(peer, keys)
    return eng.client.wait([rid], 30)[rid]


def _hello(raw: Raw, nonce: bytes = b"c" * 32) -> PeerChallenge:
    raw.send(PeerHello(PEER_VERSION, "attacker", nonce))
    ch = raw.recv()
    assert isinstance(ch, PeerChallenge)
    return ch


def test_wrong_token_gets_nothing(pair_factory: Any) -> None:
    prefill, decode, keys, fp = _serving(pair_factory, decode_token="a-different-token-of-enough-length")
    # The decode daemon checks the serving daemon's proof first and refuses to go on.
    c = _pull(decode.socket_path, prefill.peer_address, keys)
    assert isinstance(c.error, PermissionDenied) and "peer token" in c.error.message
    # The serving side sees the hang-up after its challenge, and says why it most likely happened.
    prefill.wait_status(lambda s: s["counters"].get("peer_refused", 0) >= 1, 10)
    assert "hung up after our challenge" in prefill.log()
    # An attacker that answers the challenge with a guess gets PERMISSION and a closed link.
    raw = Raw(prefill.peer_address)
    _hello(raw)
    raw.send(PeerAuth(b"\0" * 32, [fp]))
    err = raw.recv()
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PERMISSION
    assert raw.recv() is None  # closed
    assert b"agent" not in raw.received and not any(isinstance(m, PeerWelcome) for m in [err])
    raw.close()
    s = prefill.wait_status(lambda s: s["counters"].get("peer_refused", 0) >= 2, 10)
    assert s["index"]["leases"] == 0
    assert decode.status()["index"]["entries"] == 0


def test_address_outside_the_allowlist_gets_nothing(pair_factory: Any) -> None:
    prefill, decode, keys, _ = _serving(pair_factory, serve_args=("--peer-allow", "10.9.9.0/24"))
    c = _pull(decode.socket_path, prefill.peer_address, keys)
    assert isinstance(c.error, PermissionDenied) and "--peer-allow" in c.error.message
    raw = Raw(prefill.peer_address)
    raw.send(PeerHello(PEER_VERSION, "attacker", b"c" * 32))
    err = raw.recv()  # no challenge: refused before the handshake
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PERMISSION
    assert raw.recv() is None
    raw.close()
    assert decode.status()["index"]["entries"] == 0


def test_a_refused_address_is_refused_before_it_sends_and_nothing_it_sends_is_read(pair_factory: Any) -> None:
    prefill, _, _, _ = _serving(pair_factory, serve_args=("--peer-allow", "10.9.9.0/24", "--peer-timeout-s", "30"))
    port = int(prefill.peer_address.rsplit(":", 1)[1])
    # Sending nothing: the refusal and the hang-up come at once, not after a first frame or the timeout.
    raw = Raw(prefill.peer_address, timeout_s=5)
    err = raw.recv()
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PERMISSION and "--peer-allow" in err.message
    assert raw.recv() is None
    raw.close()
    # A frame announcing 16 MiB, then 64 KiB of it: every byte stays in the daemon's socket, unread.
    sent = struct.pack(">I", 16 << 20) + b"\0" * (64 << 10)
    for _attempt in range(3):  # the refused socket lingers 1 s: look again should a stall outlast it
        raw = Raw(prefill.peer_address, timeout_s=5)
        raw.sock.sendall(sent)
        unread = _server_rx_queue(port, raw.sock.getsockname()[1])
        raw.close()
        if unread is not None:
            break
    assert unread == len(sent)
    s = prefill.wait_status(lambda s: lib.counter(s, "peer_refused") >= 2, 10)
    assert s["peer"]["serving"]["connections"]["connections"] == 0


def _server_rx_queue(server_port: int, client_port: int) -> int | None:
    """Bytes the daemon's end of this loopback connection holds unread (its socket's receive queue,
    from /proc/net/tcp), or None once that socket is gone."""
    want = (f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}")
    deadline = time.monotonic() + 0.5
    seen: int | None = None
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        rx = [int(r[4].split(":")[1], 16) for r in rows if (r[1], r[2]) == want]
        if not rx:
            return seen
        seen = rx[0]
        if seen:
            return seen
        time.sleep(0.01)
    return seen


def test_a_proof_cannot_be_replayed(pair_factory: Any, tmp_path: Path) -> None:
    prefill, _, _, fp = _serving(pair_factory)
    token = lib.TOKEN.encode()
    nonce = b"r" * 32
    first = Raw(prefill.peer_address)
    ch1 = _hello(first, nonce)
    assert ch1.proof == server_proof(token, nonce, ch1.nonce)
    proof = client_proof(token, nonce, ch1.nonce)
    first.send(PeerAuth(proof, [fp]))
    assert isinstance(first.recv(), PeerWelcome)  # the genuine exchange works
    first.close()
    # The same Hello and the recorded proof on a new connection: a fresh server nonce defeats it.
    second = Raw(prefill.peer_address)
    ch2 = _hello(second, nonce)
    assert ch2.nonce != ch1.nonce
    second.send(PeerAuth(proof, [fp]))
    err = second.recv()
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PERMISSION
    second.close()


def test_the_token_never_crosses_the_wire(pair_factory: Any) -> None:
    """A fake serving daemon records what a real pulling daemon sends it."""
    _, decode = pair_factory()
    token = lib.TOKEN.encode()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    captured: dict[str, Any] = {}

    def fake_server() -> None:
        conn, _ = listener.accept()
        conn.settimeout(10)
        dec, data, frames = FrameDecoder(), b"", []

        def read_one() -> Message:
            nonlocal data
            while not frames:
                chunk = conn.recv(1 << 16)
                data += chunk
                frames.extend(dec.feed(chunk))
            return decode_body(frames.pop(0))

        hello = read_one()
        assert isinstance(hello, PeerHello)
        nonce_s = b"s" * 32
        conn.sendall(encode(PeerChallenge(PEER_VERSION, "fake", nonce_s, server_proof(token, hello.nonce, nonce_s))))
        captured["auth"] = read_one()
        captured["hello"] = hello
        captured["bytes"] = data
        conn.close()

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    keys = chunk_keys(prompt_tokens(64, seed=3), 32)
    c = _pull(decode.socket_path, f"127.0.0.1:{port}", keys)
    t.join(15)
    listener.close()
    assert c.error is not None  # the fake never welcomes it
    sent = captured["bytes"]
    assert token not in sent and token.hex().encode() not in sent and token.upper() not in sent
    auth = captured["auth"]
    assert isinstance(auth, PeerAuth)
    assert auth.proof == client_proof(token, captured["hello"].nonce, b"s" * 32)


def test_bad_input_is_refused_and_the_daemon_keeps_serving(pair_factory: Any) -> None:
    prefill, decode, keys, fp = _serving(pair_factory)
    # 1. garbage that is not a frame body
    raw = Raw(prefill.peer_address)
    raw.send(b"\x00\x00\x00\x05hello")
    err = raw.recv()
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PROTOCOL_VIOLATION
    raw.close()
    # 2. a length far past the frame limit: refused before it is buffered
    raw = Raw(prefill.peer_address)
    raw.send(b"\x7f\xff\xff\xff")
    err = raw.recv()
    assert isinstance(err, kv.Error) and err.code == ErrorCode.FRAME_TOO_LARGE
    raw.close()
    # 3. a request before the handshake
    raw = Raw(prefill.peer_address)
    raw.send(PeerLookup(1, fp, keys, 0, 0.0, 0))
    err = raw.recv()
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PROTOCOL_VIOLATION
    assert raw.recv() is None
    raw.close()
    # 4. after a genuine handshake, a lookup for a layout that was not agreed
    token = lib.TOKEN.encode()
    raw = Raw(prefill.peer_address)
    ch = _hello(raw, b"n" * 32)
    raw.send(PeerAuth(client_proof(token, b"n" * 32, ch.nonce), [fp]))
    assert isinstance(raw.recv(), PeerWelcome)
    raw.send(PeerLookup(7, b"x" * 16, keys, 0, 0.0, 0))
    err = raw.recv()
    assert isinstance(err, kv.Error) and err.req_id == 7 and err.code == ErrorCode.OUT_OF_RANGE
    # the link still serves a good request
    raw.send(PeerLookup(8, fp, keys, 0, 0.0, 0))
    reply = raw.recv()
    assert reply is not None and reply.TYPE == MsgType.PEER_LOOKUP_REPLY and reply.hit_chunks == 4
    raw.close()
    # and a real pull still works
    c = _pull(decode.socket_path, prefill.peer_address, keys)
    assert c.ok and c.result.hit_chunks == 4


def test_a_peer_releases_only_the_leases_its_own_link_took(pair_factory: Any) -> None:
    prefill, _decode, keys, fp = _serving(pair_factory)
    token = lib.TOKEN.encode()
    links = []
    for nonce in (b"a" * 32, b"b" * 32):
        raw = Raw(prefill.peer_address)
        ch = _hello(raw, nonce)
        raw.send(PeerAuth(client_proof(token, nonce, ch.nonce), [fp]))
        assert isinstance(raw.recv(), PeerWelcome)
        links.append(raw)
    victim, other = links
    victim.send(PeerLookup(1, fp, keys, 0, 0.0, 0))
    reply = victim.recv()
    assert reply is not None and reply.hit_chunks == 4 and reply.lease_id
    other.send(PeerRelease(2, reply.lease_id))  # another link, even one that knows the id
    s = prefill.wait_status(lambda s: s["counters"].get("peer_release_refused", 0) >= 1, 10)
    assert s["index"]["leases"] == 1  # the victim's lease holds
    victim.send(PeerRelease(3, reply.lease_id))
    s = prefill.wait_status(lambda s: s["index"]["leases"] == 0, 10)
    assert s["index"]["leases"] == 0
    for raw in links:
        raw.close()


@pytest.mark.parametrize(("content", "mode", "why"), [
    ("0123456789abcdef0123", 0o644, "chmod 600"),
    ("short", 0o600, "at least 16"),
])
def test_unsafe_tokens_stop_the_daemon_at_start(tmp_path: Path, content: str, mode: int, why: str) -> None:
    tok = tmp_path / "token"
    tok.write_text(content)
    tok.chmod(mode)
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--peer-listen", "127.0.0.1:1", "--peer-token-file", str(tok)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert why in out.stderr


def test_serving_without_a_token_is_refused_at_start(tmp_path: Path) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "HKVD_PEER_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--peer-listen", "127.0.0.1:1"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "--peer-token-file" in out.stderr


# ---- resources a stranger can make the serving daemon hold -----------------------------------------


def test_the_frame_caps_fit_the_largest_messages() -> None:
    hello = PeerHello(PEER_VERSION, "\U0001F600" * 256, b"n" * 32)  # 256 four-byte characters
    auth = PeerAuth(b"p" * 32, [b"f" * FINGERPRINT_BYTES] * MAX_FINGERPRINTS)
    lookup = PeerLookup((1 << 64) - 1, b"f" * FINGERPRINT_BYTES, [b"k" * KEY_BYTES] * MAX_KEYS, 1 << 40, 30.0,
                        (1 << 64) - 1)
    for msg in (hello, auth):
        msg.validate()
        assert len(encode(msg)) * 3 < PREAUTH_MAX_FRAME_BYTES
    lookup.validate()
    assert len(encode(lookup)) <= REQUEST_MAX_FRAME_BYTES < 2 << 20
    # Peer sockets stay within a quarter of the open-file limit, lingering refusals included.
    for soft in (64, 128, 1024, 1 << 20):
        caps = fd_caps(128, soft)
        assert caps.connections >= 1 and caps.connections + caps.lingering <= max(2, soft // 4)
    assert fd_caps(128, 1024).connections == 128


def _rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def _open_connections(daemon: Any) -> int:
    return int(daemon.status()["peer"]["serving"]["connections"]["connections"])


def test_strangers_before_authentication_cost_no_memory(pair_factory: Any) -> None:
    """24 connections, each announcing a 16 MiB frame and sending 4 MiB of it, before any handshake."""
    prefill, decode, keys, _ = _serving(pair_factory, serve_args=("--peer-timeout-s", "30"))
    assert _pull(decode.socket_path, prefill.peer_address, keys).ok  # warm: the link and NIXL set up
    prefill.wait_status(lambda s: s["pool"]["prefault"]["done"], 60)  # the pool's pages are all in RSS already
    pid = prefill.proc.pid
    before = _rss_kib(pid)
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib(pid))
            stop.wait(0.005)

    raws = [Raw(prefill.peer_address, source=f"127.0.0.{2 + i}") for i in range(24)]

    def attack(raw: Raw) -> None:
        with contextlib.suppress(OSError):  # refused part-way: what we want
            raw.sock.sendall(struct.pack(">I", 16 << 20) + b"\0" * (4 << 20))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=attack, args=(raw,), daemon=True) for raw in raws]
    for t in threads:
        t.start()
    during = _pull(decode.socket_path, prefill.peer_address, keys)  # an honest peer, meanwhile
    for t in threads:
        t.join(20)
    with contextlib.suppress(AssertionError):  # give the daemon a moment to close them; checked below
        prefill.wait_status(lambda s: s["peer"]["serving"]["connections"]["connections"] <= 1, 3)
    stop.set()
    sampler.join(5)
    grown_mib = (peak[0] - before) / 1024
    print(f"prefill RSS {before / 1024:.1f} MiB, peak +{grown_mib:.1f} MiB under 24 x 16 MiB announced frames")
    assert grown_mib < 8, f"RSS grew {grown_mib:.1f} MiB"
    assert _open_connections(prefill) <= 1  # closed, long before the 30 s handshake timeout
    for raw in raws:
        err = raw.recv()
        assert isinstance(err, kv.Error) and err.code == ErrorCode.FRAME_TOO_LARGE
        assert raw.recv() is None
        raw.close()
    assert lib.counter(prefill.status(), "peer_refused") >= 24
    assert during.ok and during.result.hit_chunks == 4
    after = _pull(decode.socket_path, prefill.peer_address, keys)
    assert after.ok and after.result.hit_chunks == 4


def test_connections_past_the_cap_of_an_address_are_refused(pair_factory: Any) -> None:
    prefill, decode, keys, fp = _serving(pair_factory, serve_args=(
        "--peer-max-connections-per-address", "4", "--peer-timeout-s", "30"))
    held = [Raw(prefill.peer_address, source="127.0.0.2") for _ in range(4)]  # idle, before the handshake
    prefill.wait_status(lambda s: s["peer"]["serving"]["connections"]["connections"] == 4, 10)
    t0 = time.monotonic()
    for _ in range(3):
        extra = Raw(prefill.peer_address, source="127.0.0.2", timeout_s=5)
        err = extra.recv()  # at once, without sending a byte
        assert isinstance(err, kv.Error) and err.code == ErrorCode.BUSY
        assert "--peer-max-connections-per-address" in err.message
        assert extra.recv() is None
        extra.close()
    assert time.monotonic() - t0 < 10
    # Another address, and the real pulling daemon, are served meanwhile.
    c = _pull(decode.socket_path, prefill.peer_address, keys)
    assert c.ok and c.result.hit_chunks == 4
    prefill.wait_status(lambda s: lib.counter(s, "peer_refused") >= 3, 10)
    assert "refused a peer connection from 127.0.0.2" in prefill.log()
    assert prefill.log().count("refused a peer connection from 127.0.0.2") == 1  # once, not per connection
    # Closing them frees the address's slots: a genuine handshake from it succeeds.
    for raw in held:
        raw.close()
    prefill.wait_status(lambda s: s["peer"]["serving"]["connections"]["connections"] <= 1, 10)
    raw = Raw(prefill.peer_address, source="127.0.0.2")
    ch = _hello(raw, b"q" * 32)
    raw.send(PeerAuth(client_proof(lib.TOKEN.encode(), b"q" * 32, ch.nonce), [fp]))
    assert isinstance(raw.recv(), PeerWelcome)
    raw.close()


def test_peer_connections_leave_engines_file_descriptors(tmp_path: Path) -> None:
    """The serving daemon runs with 128 open files; 150 idle peer connections from many addresses,
    with the configured caps far above that, must not lock engines out of the control socket."""
    token = lib.write_token(tmp_path / "prefill.token")
    port = lib.free_port()
    prefill = lib.PeerDaemon(tmp_path, "prefill", [
        "--l1-size-gb", "0.25", "--chunk-size", "32", "--peer-token-file", str(token),
        "--peer-listen", f"127.0.0.1:{port}", "--peer-timeout-s", "30",
        "--peer-max-connections", "1000", "--peer-max-connections-per-address", "1000"],
        prefix=["prlimit", "--nofile=128:128", "--"])
    prefill.peer_address = f"127.0.0.1:{port}"
    prefill.spawn()
    raws: list[Raw] = []
    try:
        prefill.wait_ready(60)
        for i in range(150):
            with contextlib.suppress(OSError):
                raws.append(Raw(prefill.peer_address, source=f"127.0.{1 + i // 200}.{2 + i % 200}", timeout_s=2))
        s = prefill.wait_status(lambda s: lib.counter(s, "peer_refused") >= 100, 20)
        assert s["peer"]["serving"]["connections"]["connections"] == 28
        # Engines still connect, register and store.
        engines = [SyntheticEngine(prefill.socket_path, FULL, num_blocks=64) for _ in range(3)]
        keys = chunk_keys(prompt_tokens(32 * 4, seed=5), engines[0].chunk_size)
        engines[0].fill_random(0, range(1, 9), seed=6)
        assert engines[0].store(engines[0].items(0, keys, first_block=1)).ok
        assert engines[1].lookup(keys)[0] == 4
        for eng in engines:
            eng.close()
        assert "serving at most 28 peer connections" in prefill.log()
    finally:
        for raw in raws:
            raw.close()
        prefill.stop(20)
