"""Structured fuzzing of the wire: every registered message type, built from its own dataclass fields.

What is generated
    For each class in ``MESSAGE_CLASSES`` (so a new message type is fuzzed without touching this
    file; a field of a type no strategy knows fails with the fix) frames ``[TYPE, *fields]`` built
    from the dataclass's own fields, in equal parts: well-formed (values of the annotated type that
    this daemon may accept: small numbers, its stored chunk keys, its layout fingerprint, its items,
    the engine's own registration spec with at most one part changed; fields named ``version``,
    ``role``, ``fingerprint``, ``nonce``, ``proof``, ``wait_event``... get values of that meaning),
    well-formed but for one field, and wild. Wild values are of the annotated type with its boundary
    cases (integers 0, -1, 2**63 - 1, 2**63, 2**64 - 1, -2**63; bytes of 0, 15, 16, 17, 32, 64
    bytes; NaN and infinities; empty lists and lists one past ``MAX_KEYS``; a spec with up to three
    parts replaced or deleted), or of a wrong type, nested garbage included. One frame in five has
    a field too few or too many. msgpack carries integers in [-2**63, 2**64), so 2**64 cannot be
    framed as an integer: it travels as the float it becomes.

Phases (each one per message type, against real daemon processes)
    control socket: the frame as the first frame (before Hello); after Hello; after registering
    a valid synthetic engine (its stored keys and items in the strategies, so Store, Retrieve,
    Lookup, StepEvent and Pull reach the copy, index and peer code);
    peer port: the frame as the first frame; after PeerHello (in place of PeerAuth); after a
    genuine handshake (PeerLookup and PeerRelease with the agreed fingerprint and stored keys).

What is asserted
    Every reply decodes and validates, and an ``Error`` reply carries a known code other than
    INTERNAL; a connection the daemon keeps open keeps answering (a ping, an empty lookup); after
    each phase the daemon is alive, answers a fresh client's status request, counts no internal
    error and has logged no "internal error" and no traceback.

Cost
    ``HKVD_FUZZ_EXAMPLES`` examples per phase and message type (default 12; with 29 types and 6
    phases today, about 2,100 frames in about 15 s). Generation is derandomized (the same frames on
    every run) and keeps no example database; raise the count for long local runs, e.g.
    ``HKVD_FUZZ_EXAMPLES=500``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import math
import os
import socket
import string
import typing
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkvd.daemon.engines import validation
from hkvd.daemon.peers.auth import client_proof
from hkvd.shim.ptrace import allow_ptracer
from hkvd.shim.testing.launcher import DaemonProcess
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ErrorCode, OutOfRange
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import MAX_ITEMS, MAX_KEYS, MESSAGE_CLASSES, PROTOCOL_VERSION, Message, control, kv
from hkvd.transport.wire import peer as wpeer

EXAMPLES = int(os.environ.get("HKVD_FUZZ_EXAMPLES", "12"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
REPLY_TIMEOUT_S = 30.0  # a reply slower than this means the daemon hung (copies here take microseconds)
SHAPES = [GroupShape("full", 2, 4096), GroupShape("mamba", 1, 2048, block_stride=4096)]
CHUNKS = 4
SYNC_BASE = 1 << 62  # req_ids of the probes that follow each fuzzed frame

PEERLIB = Path(__file__).resolve().parents[1] / "peer" / "peerlib.py"


def _load_peerlib() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hkvd_test_peerlib_fuzz", PEERLIB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peerlib = _load_peerlib()
NIXL_MISSING = peerlib.nixl_missing()
TYPES = [MESSAGE_CLASSES[t] for t in sorted(MESSAGE_CLASSES)]
TYPE_IDS = [cls.__name__ for cls in TYPES]


# ---- strategies ------------------------------------------------------------------------------------
INT_EDGES = (0, 1, -1, 2, 3, 255, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))
FLOAT_EDGES = (0.0, -0.0, -1.0, 1e-9, 0.5, 30.0, 30.000001, 1e300, 2.0**64, math.inf, -math.inf, math.nan)
BYTE_LENGTHS = (0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65)
# Words the daemon gives meaning to, from the modules that define them (new ones come along).
WORDS = sorted({*control.ROLES, *control.REGION_KINDS, *validation.SUPPORTED_KINDS,
                validation.REQUIRED_MAMBA_CACHE_MODE, "none", "bfloat16", "int8", "127.0.0.1:1", "[::1]:0",
                "host:port:extra", "a" * (wpeer.MAX_PEER_ADDRESS + 1), "no_prefix_cache", ""})


@dataclasses.dataclass
class Context:
    """What makes generated values land on this daemon's state: stored keys, fingerprints, items, spec."""

    keys: list[bytes]
    fingerprints: list[bytes]
    items: list[list[Any]]
    spec: dict[str, Any]
    words: list[str]


def _ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(INT_EDGES), st.integers(0, 80), st.integers(-(2**63), 2**64 - 1))


def _floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats())


def _bytes(ctx: Context) -> st.SearchStrategy[bytes]:
    return st.one_of(st.sampled_from(ctx.keys + ctx.fingerprints),
                     st.sampled_from(BYTE_LENGTHS).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
                     st.binary(max_size=100))


def _text(ctx: Context) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(WORDS + ctx.words), st.text(max_size=30),
                     st.text(string.ascii_lowercase + string.digits + "_", max_size=70), st.just("x" * 5000))


def _garbage() -> st.SearchStrategy[Any]:
    """Any msgpack value, nested; maps with non-string keys too (the decoder refuses those)."""
    leaf = st.one_of(st.none(), st.booleans(), _ints(), _floats(), st.text(max_size=10), st.binary(max_size=20))
    nested = st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=12)
    return st.one_of(nested, nested, nested, st.dictionaries(st.integers(-3, 3), leaf, min_size=1, max_size=2))


def _item(ctx: Context) -> st.SearchStrategy[list[Any]]:
    """Something shaped like an item ``[group_id, chunk_index, key, block_ids(, parent)]``, or a real one."""
    blocks = st.one_of(st.lists(_ints(), max_size=5), st.lists(st.integers(0, 70), min_size=1, max_size=3),
                       st.just([1] * (kv.MAX_BLOCKS_PER_ITEM + 1)), _garbage())
    shaped = st.tuples(_ints(), _ints(), _bytes(ctx), blocks,
                       st.one_of(st.just(()), st.tuples(_bytes(ctx)))).map(lambda t: [*t[:4], *t[4]])
    return st.one_of(st.sampled_from(ctx.items), shaped, st.lists(_garbage(), max_size=6))


def _spec_paths(spec: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every leaf (and every list and map) of a registration spec, as a path of keys and indexes."""
    out: list[tuple[Any, ...]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        out.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(spec, ())
    return out[1:]


_DELETE = object()


def _mutated_spec(ctx: Context, max_changes: int = 3) -> st.SearchStrategy[dict[str, Any]]:
    """The engine's valid spec with one to ``max_changes`` parts replaced (by a value of their type, or
    not), or deleted."""
    paths = _spec_paths(ctx.spec)

    def value_for(path: tuple[Any, ...]) -> st.SearchStrategy[Any]:
        node: Any = ctx.spec
        for k in path:
            node = node[k]
        typed = {int: _ints(), str: _text(ctx), bytes: _bytes(ctx)}.get(type(node), st.nothing())
        return st.one_of(typed, typed, _garbage(), st.just(_DELETE))

    def apply(changes: list[tuple[tuple[Any, ...], Any]]) -> dict[str, Any]:
        spec = copy.deepcopy(ctx.spec)
        for path, value in changes:
            node: Any = spec
            try:
                for k in path[:-1]:
                    node = node[k]
                if value is _DELETE and isinstance(node, dict):
                    node.pop(path[-1], None)
                elif value is not _DELETE:
                    node[path[-1]] = value
            except (KeyError, IndexError, TypeError):
                pass  # an earlier change replaced a parent
        return spec

    change = st.sampled_from(paths).flatmap(lambda p: st.tuples(st.just(p), value_for(p)))
    return st.lists(change, min_size=1, max_size=max_changes).map(apply)


def _typed(hint: Any, name: str, ctx: Context) -> st.SearchStrategy[Any]:
    """Values of the annotated type, boundary cases included."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return _garbage()
    if origin is list:
        (inner,) = typing.get_args(hint)
        if inner is kv.Item:  # the messages' item lists (Store.items, StepEvent.offers, ...)
            element, filler = _item(ctx), ctx.items[0]
        else:
            fillers: dict[Any, Any] = {bytes: ctx.keys[0], int: 1}
            element, filler = _typed(inner, name, ctx), fillers.get(inner, 0)
        limit = max(MAX_KEYS, MAX_ITEMS)
        return st.one_of(st.lists(element, max_size=6), st.lists(element, min_size=1, max_size=3),
                         st.sampled_from([limit, limit + 1]).map(lambda n: [filler] * n))
    if origin is dict:
        return st.one_of(st.dictionaries(st.text(max_size=12), _garbage(), max_size=4), _mutated_spec(ctx))
    simple = {int: _ints, float: _floats, bool: st.booleans}
    if hint in simple:
        return simple[hint]()
    if hint is str:
        return _text(ctx)
    if hint is bytes:
        return _bytes(ctx)
    raise TypeError(f"{name}: no strategy for fields of type {hint!r}; add one to _typed in {__file__}")


def _hinted(field: str, ctx: Context) -> st.SearchStrategy[Any] | None:
    """Plausible values for fields whose name says more than their type, in whichever message they are."""
    hints: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
        "version": lambda: st.sampled_from([PROTOCOL_VERSION, wpeer.PEER_VERSION]),
        "role": lambda: st.sampled_from(control.ROLES),
        "fingerprint": lambda: st.sampled_from(ctx.fingerprints),
        "fingerprints": lambda: st.lists(st.sampled_from(ctx.fingerprints), max_size=2),
        "nonce": lambda: st.binary(min_size=wpeer.NONCE_BYTES, max_size=wpeer.NONCE_BYTES),
        "proof": lambda: st.binary(min_size=wpeer.PROOF_BYTES, max_size=wpeer.PROOF_BYTES),
        "peer": lambda: st.sampled_from(ctx.words or WORDS),
        "wait_event": lambda: st.one_of(st.just(b""), st.binary(min_size=kv.EVENT_HANDLE_BYTES,
                                                                max_size=kv.EVENT_HANDLE_BYTES)),
        "reason": lambda: st.text(string.ascii_lowercase + string.digits + "_", min_size=1, max_size=kv.MAX_REASON),
    }
    make = hints.get(field)
    return make() if make is not None else None


def _plausible(hint: Any, name: str, ctx: Context) -> st.SearchStrategy[Any]:
    """Values of the annotated type that this daemon may well accept: small numbers, its keys, its items."""
    field = name.rpartition(".")[2]
    if (hinted := _hinted(field, ctx)) is not None:
        return st.one_of(hinted, hinted, hinted, _plausible(hint, "", ctx))
    origin = typing.get_origin(hint)
    if origin is list:
        (inner,) = typing.get_args(hint)
        pools: dict[Any, list[Any]] = {kv.Item: ctx.items, bytes: ctx.keys}
        pool = pools.get(inner, [])
        if not pool:
            return st.lists(_plausible(inner, name, ctx), max_size=4)
        # Items: one group's chunks in order (a store, a retrieve, a step event's Mamba offers), or a mix.
        groups = sorted({it[0] for it in pool})
        runs = [[it for it in pool if it[0] == g] for g in groups] if inner is kv.Item else [pool]
        prefixes = [run[:n] for run in runs for n in range(len(run) + 1)]
        return st.one_of(st.sampled_from(prefixes), st.lists(st.sampled_from(pool), max_size=len(pool)))
    if origin is dict:
        return st.one_of(st.just(ctx.spec), _mutated_spec(ctx, max_changes=1))
    simple: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(0, 70), float: st.one_of(st.just(0.0), st.floats(0, 31)), bool: st.booleans(),
        str: st.sampled_from(WORDS + ctx.words),
        bytes: st.one_of(st.sampled_from([b"", *ctx.keys, *ctx.fingerprints]),
                         st.sampled_from((16, 32, 64)).flatmap(lambda n: st.binary(min_size=n, max_size=n))),
    }
    if hint in simple:
        return simple[hint]
    return _typed(hint, name, ctx)


def frames(cls: type[Message], ctx: Context) -> st.SearchStrategy[bytes]:
    """Frames of message type ``cls``, its fields from their annotations: in equal parts well-formed (values
    this daemon may accept), well-formed but for one field, and wild; one in five with a field too few or
    too many."""
    hints = typing.get_type_hints(cls)
    fields = [(f"{cls.__name__}.{f.name}", hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    good = [_plausible(hint, name, ctx) for name, hint in fields]
    wild = [st.one_of(_typed(hint, name, ctx), _garbage()) for name, hint in fields]
    one_bad = st.integers(0, max(len(fields) - 1, 0)).flatmap(
        lambda i: st.tuples(*good[:i], *wild[i:i + 1], *good[i + 1:]))

    def frame(t: tuple[tuple[Any, ...], str, int, list[Any]]) -> bytes:
        body, arity, cut, extra = t
        wire = list(body)
        if arity == "short":
            wire = wire[:cut % max(len(wire), 1)]
        elif arity == "long":
            wire += extra
        data = msgpack.packb([int(cls.TYPE), *wire], use_bin_type=True)
        return len(data).to_bytes(4, "big") + data

    return st.tuples(st.one_of(st.tuples(*good), one_bad, st.tuples(*wild)),
                     st.sampled_from(["exact"] * 8 + ["short", "long"]),
                     st.integers(0, 8), st.lists(_garbage(), min_size=1, max_size=3)).map(frame)


# ---- connections -----------------------------------------------------------------------------------
class Link:
    """A raw connection speaking our frames; every read bounded by ``REPLY_TIMEOUT_S``."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(REPLY_TIMEOUT_S)
        self.sock = sock
        self.dec = FrameDecoder()
        self.frames: deque[bytes] = deque()
        self.eof = False

    @classmethod
    def unix(cls, path: str) -> Link:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return cls(s)

    @classmethod
    def tcp(cls, address: str) -> Link:
        host, port = address.rsplit(":", 1)
        return cls(socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S))

    def send(self, data: bytes | Message) -> bool:
        """False when the daemon has closed the connection already."""
        try:
            self.sock.sendall(data if isinstance(data, bytes) else encode(data))
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def recv(self) -> Message | None:
        """The next reply, checked (see ``check_reply``); None at EOF."""
        while not self.frames:
            if self.eof:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                return None
            self.frames.extend(self.dec.feed(data))
        msg = decode_body(self.frames.popleft())
        check_reply(msg)
        return msg

    def until(self, done: Callable[[Message], bool]) -> list[Message]:
        """Replies up to and including the first one ``done`` accepts, or up to EOF."""
        got: list[Message] = []
        while (msg := self.recv()) is not None:
            got.append(msg)
            if done(msg):
                break
        return got

    def close(self) -> None:
        self.sock.close()


def check_reply(msg: Message) -> None:
    if isinstance(msg, kv.Error):
        assert msg.code in ErrorCode.__members__.values(), f"unknown error code {msg.code}: {msg.message}"
        assert msg.code != ErrorCode.INTERNAL, f"INTERNAL error reply (a bug): {msg.message}"


def _is(kind: type[Message], req_id: int) -> Callable[[Message], bool]:
    return lambda m: isinstance(m, kind) and getattr(m, "req_id", None) == req_id


class Session:
    """A connection brought to one phase's state, re-opened whenever a fuzzed frame ended that state."""

    def __init__(self, opener: Callable[[], Link]) -> None:
        self.opener = opener
        self.link: Link | None = None

    def get(self) -> Link:
        if self.link is None:
            self.link = self.opener()
        return self.link

    def reset(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


_sync_ids = itertools.count(SYNC_BASE)


# ---- daemons ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    """The daemon under fuzz, its bystander engine and what the strategies need to know about it."""

    daemon: DaemonProcess
    engine: SyntheticEngine
    ctx: Context
    peer_address: str = ""
    token: bytes = b""
    log_offset: int = 0
    internal_errors: float = 0

    def healthy(self) -> None:
        """Alive, serving a fresh client, no internal error counted or logged since the last check."""
        proc = self.daemon.proc
        assert proc is not None and proc.poll() is None, f"the daemon died:\n{self.daemon.log()[-4000:]}"
        before, self.internal_errors = self.internal_errors, self.daemon.status()["counters"].get("internal_errors", 0)
        assert self.internal_errors == before, f"{self.internal_errors - before} internal errors counted"
        log = self.daemon.log()
        fresh, self.log_offset = log[self.log_offset:], len(log)
        bad = [line for line in fresh.splitlines() if "internal error" in line.lower() or "Traceback" in line]
        assert not bad, "\n".join(bad[:5])[:6000]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One daemon for the module: with the peer port when NIXL is installed, else without it."""
    workdir = tmp_path_factory.mktemp("fuzz")
    args = ["--hugepages", "off", "--log-level", "debug", "--l1-size-gb", "0.125", "--chunk-size", "32"]
    address, token = "", b""
    if NIXL_MISSING is None:
        port = peerlib.free_port()
        address, token = f"127.0.0.1:{port}", peerlib.TOKEN.encode()
        tok = peerlib.write_token(workdir / "peer.token")
        # A short peer timeout bounds a fuzzed PeerLookup's wait (at most half of it) and a fuzzed Pull.
        d: DaemonProcess = peerlib.PeerDaemon(workdir, "fuzz", [
            *args[4:], "--peer-token-file", str(tok), "--peer-listen", address, "--peer-timeout-s", "1",
            "--peer-pull-timeout-s", "3"])
        d.spawn()
        d.wait_ready(60)
    else:
        d = DaemonProcess(str(workdir / "fuzz.sock"), args, workdir / "fuzz.log").start(60)
    engine = None
    try:
        engine = SyntheticEngine(d.socket_path, SHAPES, num_blocks=64, timeout_s=30)
        keys = chunk_keys(prompt_tokens(engine.chunk_size * CHUNKS, seed=77), engine.chunk_size)
        engine.fill_random(0, range(1, 64), seed=5)
        full = engine.items(0, keys, first_block=1)
        mamba = engine.items(1, keys, first_block=40)
        engine.store(full)
        items = [[it.group_id, it.chunk_index, it.key, list(it.block_ids), *((it.parent,) if it.parent else ())]
                 for it in [*full, *mamba]]
        ctx = Context(keys=keys, fingerprints=[engine.fingerprint], items=items, spec=engine.spec.to_wire(),
                      words=[address] if address else [])
        t = Target(d, engine, ctx, address, token)
        t.healthy()
        yield t
    finally:
        if engine is not None:
            engine.close()
        if d.proc is not None and d.proc.poll() is None:
            d.stop(20)


def _fuzz(target: Target, cls: type[Message], one: Callable[[bytes], None]) -> None:
    @FUZZ
    @given(frame=frames(cls, target.ctx))
    def run(frame: bytes) -> None:
        one(frame)

    run()
    target.healthy()


# ---- control socket ----------------------------------------------------------------------------------
def _hello(link: Link) -> None:
    link.send(control.Hello(PROTOCOL_VERSION, "fuzz", "worker"))
    assert isinstance(link.recv(), control.HelloAck)


@pytest.mark.parametrize("cls", TYPES, ids=TYPE_IDS)
def test_control_first_frame(target: Target, cls: type[Message]) -> None:
    """Before Hello: a HelloAck for a valid Hello, else one typed error and a closed connection."""

    def one(frame: bytes) -> None:
        link = Link.unix(target.daemon.socket_path)
        try:
            link.send(frame)
            got = link.until(lambda m: isinstance(m, control.HelloAck))
            assert got, "no reply before the daemon closed the connection"
            assert isinstance(got[-1], (kv.Error, control.HelloAck)), got
        finally:
            link.close()

    _fuzz(target, cls, one)


@pytest.mark.parametrize("cls", TYPES, ids=TYPE_IDS)
def test_control_after_hello(target: Target, cls: type[Message]) -> None:
    """After Hello, unregistered: typed replies, and the connection still answers a ping."""

    def opener() -> Link:
        link = Link.unix(target.daemon.socket_path)
        _hello(link)
        return link

    session = Session(opener)

    def one(frame: bytes) -> None:
        link = session.get()
        sync = next(_sync_ids)
        if link.send(frame) and link.send(control.Ping(sync)):
            got = link.until(_is(control.Pong, sync))
        else:
            got = link.until(lambda m: False)
        if link.eof or any(isinstance(m, control.RegisterAck) for m in got):
            # A fuzzed spec that registered points at this process's memory: never send it a Retrieve.
            session.reset()
        else:
            assert got and _is(control.Pong, sync)(got[-1]), got

    try:
        _fuzz(target, cls, one)
    finally:
        session.reset()


@pytest.mark.parametrize("cls", TYPES, ids=TYPE_IDS)
def test_control_after_register(target: Target, cls: type[Message]) -> None:
    """Registered (the bystander's spec and memory): frames reach the copy, index and peer code."""
    allow_ptracer(target.engine.client.daemon_pid)

    def opener() -> Link:
        link = Link.unix(target.daemon.socket_path)
        _hello(link)
        link.send(control.Register(next(_sync_ids), target.ctx.spec))
        got = link.recv()
        assert isinstance(got, control.RegisterAck), got
        return link

    session = Session(opener)

    def one(frame: bytes) -> None:
        link = session.get()
        sync = next(_sync_ids)
        # An empty lookup: answered in order, and NOT_REGISTERED once a fuzzed Unregister ended the engine.
        if link.send(frame) and link.send(kv.Lookup(sync, [], False)):
            got = link.until(lambda m: getattr(m, "req_id", None) == sync)
        else:
            got = link.until(lambda m: False)
        if link.eof or (got and isinstance(got[-1], kv.Error) and got[-1].code == ErrorCode.NOT_REGISTERED):
            session.reset()
        else:
            assert got and _is(kv.LookupReply, sync)(got[-1]), got

    try:
        _fuzz(target, cls, one)
    finally:
        session.reset()


# ---- peer port --------------------------------------------------------------------------------------
needs_peer = pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))
NONCE = b"f" * wpeer.NONCE_BYTES


@needs_peer
@pytest.mark.parametrize("cls", TYPES, ids=TYPE_IDS)
def test_peer_first_frame(target: Target, cls: type[Message]) -> None:
    """Before the handshake: a challenge for a valid PeerHello, else one typed error and a close."""

    def one(frame: bytes) -> None:
        link = Link.tcp(target.peer_address)
        try:
            link.send(frame)
            got = link.until(lambda m: isinstance(m, wpeer.PeerChallenge))
            assert got, "no reply before the daemon closed the connection"
        finally:
            link.close()

    _fuzz(target, cls, one)


@needs_peer
@pytest.mark.parametrize("cls", TYPES, ids=TYPE_IDS)
def test_peer_in_place_of_auth(target: Target, cls: type[Message]) -> None:
    """After a genuine PeerHello, the frame in place of PeerAuth: one typed error and a close."""

    def one(frame: bytes) -> None:
        link = Link.tcp(target.peer_address)
        try:
            link.send(wpeer.PeerHello(wpeer.PEER_VERSION, "fuzz", NONCE))
            assert isinstance(link.recv(), wpeer.PeerChallenge)
            link.send(frame)
            got = link.until(lambda m: False)
            assert got and isinstance(got[-1], kv.Error), got  # no proof of the token: never welcomed
        finally:
            link.close()

    _fuzz(target, cls, one)


@needs_peer
@pytest.mark.parametrize("cls", TYPES, ids=TYPE_IDS)
def test_peer_after_handshake(target: Target, cls: type[Message]) -> None:
    """After a genuine handshake: typed replies, and the link still answers an empty lookup."""
    fp = target.ctx.fingerprints[0]

    def opener() -> Link:
        link = Link.tcp(target.peer_address)
        link.send(wpeer.PeerHello(wpeer.PEER_VERSION, "fuzz", NONCE))
        ch = link.recv()
        assert isinstance(ch, wpeer.PeerChallenge)
        link.send(wpeer.PeerAuth(client_proof(target.token, NONCE, ch.nonce), [fp]))
        assert isinstance(link.recv(), wpeer.PeerWelcome)
        return link

    session = Session(opener)

    def one(frame: bytes) -> None:
        link = session.get()
        sync = next(_sync_ids)
        if link.send(frame) and link.send(wpeer.PeerLookup(sync, fp, [], 0, 0.0, 0)):
            got = link.until(_is(wpeer.PeerLookupReply, sync))
        else:
            got = link.until(lambda m: False)
        if link.eof:
            session.reset()
        else:
            assert got and _is(wpeer.PeerLookupReply, sync)(got[-1]), got

    try:
        _fuzz(target, cls, one)
    finally:
        session.reset()


# ---- regressions: what this fuzzer found, as plain examples -------------------------------------------
@needs_peer
def test_a_pull_from_the_daemon_itself_is_refused_with_the_fix(target: Target) -> None:
    """A Pull naming the daemon's own peer address was an INTERNAL error (NIXL cannot load its own agent
    as a peer: NIXL_ERR_INVALID_PARAM); it is OUT_OF_RANGE and says where to point the pull."""
    eng = target.engine
    keys = chunk_keys(prompt_tokens(eng.chunk_size * 2, seed=4242), eng.chunk_size)  # stored nowhere
    rid = eng.client.submit_pull(target.peer_address, keys)
    c = eng.client.wait([rid], 30)[rid]
    assert isinstance(c.error, OutOfRange), c.error
    assert "itself" in c.error.message and "--peer-advertise" in c.error.message
    target.healthy()
