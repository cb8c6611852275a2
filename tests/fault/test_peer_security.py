"""Attacks on the peer link (``hkvd serve --peer-listen``): only an allowlisted address that proves
the shared token gets anything, the token never crosses the wire, a proof cannot be replayed, and
bad input gets a typed error and a closed connection while the daemon keeps serving real peers.

The attacker here is a raw socket speaking our frames; the victims are real daemons."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hkvd.daemon.peer_auth import client_proof, server_proof
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ErrorCode, PermissionDenied
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import Message, MsgType, kv
from hkvd.transport.wire.peer import (
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
    """An attacker's connection: raw frames, no checks of its own."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
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
