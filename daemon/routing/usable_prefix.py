"""Usable-prefix lookups for routers: how long a prefix of a prompt this node can serve, per tier.

Role
    A router that picks a node for a prompt of a hybrid model needs more than "which blocks exist":
    a full-attention hit is no hit without the sliding-window suffix and a Mamba/GDN state at exactly
    its boundary. The daemon applies that rule for every engine lookup (``hkvd.daemon.cache.hybrid``); this
    module answers the same question for a router, over HTTP on the metrics port
    (``hkvd.daemon.http``): ``POST /v1/usable_prefix`` and ``GET /v1/models`` (docs/routing.md).

Formats
    Index keys start with the engine layout's fingerprint, which a router cannot know.
    ``FormatBook`` shows the cache's record of engine formats (``hkvd.daemon.cache.Formats``: the
    layouts of the engines that registered here, up to ``MAX_FORMATS`` worlds, kept after they
    leave), each under the model name its engine registered and a short public label (``format``:
    the chunk size and 8 hex digits of a hash of the fingerprint, which reveal no fingerprint bits).
    A request names the model (the registered name, or its last path component) and, where the model
    has several formats here, the format. Layouts of disk-tier files are not recoverable after a
    restart (a file's header has the fingerprint, group and size, not the model, chunk size or
    windows): a format is known once an engine of it registers.

Keys
    The same chunk keys the shim computes (``hkvd.transport.keys``), with the same extras
    (``hkvd.transport.extras``: LoRA adapter, ``cache_salt``, multimodal items, reproduced from
    vLLM 0.32's rule without vLLM). A LoRA adapter's files digest is read by this daemon from the
    path the request names (``lora.path``, the path the engine was given), or taken from
    ``lora.digest``; digests read here are cached ``ADAPTER_TTL_S``.

Answer
    Per tier (pool, disk, cluster; null for a tier not configured), the longest prefix, in tokens,
    that tier alone could serve to a fresh engine; ``usable_tokens``, the hit an engine's lookup
    would get now from all tiers together (what ``KVService`` plans over the pool and what the tiers
    can read into it), capped as the shim caps a lookup: at most ``(len(token_ids) - 1) // C``
    chunks, since vLLM computes at least the last prompt token; ``prefix_tokens``, the same without
    the cap. Each of them reaches past its last whole chunk where a partial chunk of the prompt serves
    (``hkvd.daemon.routing.partial_prefix``: Mamba engines hashing below their block size).
    Read-only: no lease, no read into the pool, no pin, no change of LRU order. The cluster is asked
    with one batched existence check per batch of concurrent requests, within the tier's lookup
    timeout (a request waits for the check in flight, then joins the next batch). Lengths only:
    never keys, fingerprints or bytes.

Bounds and costs
    ``MAX_TOKENS`` token ids and ``MAX_MM_ITEMS`` multimodal items per request; the HTTP layer
    bounds the body (``hkvd.daemon.http.MAX_BODY_BYTES``). Bad input is a 400 naming the fix, an
    unknown model a 404. Work is on the event loop: keys are hashed as the planner first needs them
    (a new prompt costs one hash), and a request of more than ``SLICE_CHUNKS`` chunks is hashed in
    slices, giving the loop back between them, so engines' requests are not held behind one long
    prompt's hashing. Parsing a JSON list of numbers costs most of a request: ``token_ids_b64``
    (little-endian uint32, base64) costs less, and a msgpack body (``Content-Type:
    application/msgpack``, the same fields) with ``token_ids`` as a bin of little-endian uint32 least.

Threading
    Event loop only; adapter digests are read on the default executor.
"""

from __future__ import annotations

import array
import asyncio
import binascii
import collections
import hashlib
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, TypedDict, cast

import msgpack

from hkvd.daemon.cache import MAX_WORLDS, EntryKey, Formats, GroupRule, HasFn
from hkvd.daemon.engines.registry import EngineState
from hkvd.daemon.http import Request, Response
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing import partial_prefix
from hkvd.daemon.tiers.contract import Tier
from hkvd.transport.extras import MMItem, Uncacheable, chunk_extras, read_adapter_digest
from hkvd.transport.keys import ROOT_KEY, chunk_keys_le32

if TYPE_CHECKING:  # for annotations only (daemon/app.py builds the service and hands it over)
    from hkvd.daemon.engines.service import KVService
    from hkvd.daemon.tiers.disk import DiskTier

log = logging.getLogger("hkvd.routing")

MAX_TOKENS = 131072
MAX_MM_ITEMS = 4096
MAX_FORMATS = MAX_WORLDS  # worlds the routing view keeps (the record's bound)
MAX_NAME = 4096  # characters of a model name, format, salt, adapter name or path, mm identifier
SLICE_CHUNKS = 2048  # keys of a long prompt hashed per turn of the event loop
ADAPTER_CACHE = 64
ADAPTER_TTL_S = 60.0
LABEL_HEX = 8
TIERS = ("pool", "disk", "cluster")
JSON = "application/json"
MSGPACK = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_U32 = "I"  # 4 bytes on every platform hkvd runs on (checked at import)
if array.array(_U32).itemsize != 4:  # pragma: no cover
    raise ImportError("hkvd.daemon.routing needs a 4-byte array.array('I')")
_SWAP = sys.byteorder != "little"
_FIELDS = frozenset({"model", "format", "token_ids", "token_ids_b64", "cache_salt", "lora", "mm", "tiers"})


try:  # msgspec parses a list of 2,048 token ids ~2.5x faster than the json module
    import msgspec

    _decode: Callable[[bytes], object] = msgspec.json.Decoder().decode
except ImportError:  # pragma: no cover - the standard library's parser, same results
    _decode = json.loads


class BadRequest(Exception):
    """A request the endpoint refuses; ``status`` 400 (fix the request) or 404 (unknown model)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- formats


class FormatInfo(TypedDict):
    """One format in ``GET /v1/models`` (``Format.describe``)."""

    model: str
    format: str
    chunk_size: int
    world_size: int
    groups: list[dict[str, str | int]]  # {"kind": ...}, with "window_tokens" for swa groups
    last_registered: str


class Answer(TypedDict):
    """The usable-prefix answer's fields (``UsablePrefix.answer``); ``tiers``: tokens per tier, None when not
    asked."""

    model: str
    format: str
    chunk_size: int
    prompt_tokens: int
    usable_tokens: int
    prefix_tokens: int
    tiers: dict[str, int | None]


@dataclass(slots=True)
class Format:
    """One engine layout as routers see it."""

    model: str
    label: str
    chunk_size: int
    world_size: int
    rank_fingerprints: tuple[bytes, ...]
    rules: tuple[GroupRule, ...]
    kinds: dict[int, str]
    entry_bytes: dict[int, int]
    registered: float  # wall-clock time of the last registration
    json_head: str = ""  # the answer's first fields, JSON-encoded once
    full_groups: tuple[int, ...] = ()  # the full-attention groups' ids

    def __post_init__(self) -> None:
        self.full_groups = tuple(r.group_id for r in self.rules if r.kind == "full")
        self.json_head = (f'{{"model":{json.dumps(self.model)},"format":{json.dumps(self.label)},'
                          f'"chunk_size":{self.chunk_size}')

    def describe(self) -> FormatInfo:
        return {"model": self.model, "format": self.label, "chunk_size": self.chunk_size,
                "world_size": self.world_size,
                "groups": [{"kind": r.kind, **({"window_tokens": r.window_tokens} if r.kind == "swa" else {})}
                           for r in self.rules],
                "last_registered": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.registered))}


def format_label(chunk_size: int, fingerprint: bytes) -> str:
    """``c<chunk size>-<8 hex digits>``: a hash of the fingerprint, so the label reveals none of it."""
    digest = hashlib.blake2b(fingerprint, digest_size=8, person=b"hkvd-format").hexdigest()
    return f"c{chunk_size}-{digest[:LABEL_HEX]}"


class FormatBook:
    """The routing view of the cache's record of engine formats (``hkvd.daemon.cache.Formats``): each
    world under its model name and label, kept (within the record's bound, ``MAX_FORMATS`` worlds)
    after its engines leave."""

    def __init__(self, formats: Formats | None = None) -> None:
        self.formats = formats if formats is not None else Formats()
        self._known: dict[tuple[bytes, ...], Format] = {}  # the record's worlds with their labels
        self._version = -1

    def add(self, engine: EngineState) -> None:
        """Record a registration of ``engine`` (the registry does so for a daemon's engines)."""
        fps = engine.world_fingerprints
        self.formats.add(fps, fps.index(engine.fingerprint), model=engine.spec.model,
                         chunk_size=engine.chunk_size, rules=engine.rules, kinds=engine.kinds,
                         entry_bytes=engine.entry_bytes)

    def _views(self) -> dict[tuple[bytes, ...], Format]:
        """The record's worlds as routers see them, labels made once per world."""
        if self._version != self.formats.version:
            known = {}
            for w in self.formats.worlds():
                fmt = self._known.get(w.fingerprints)
                if fmt is None:
                    fmt = Format(w.model, format_label(w.chunk_size, w.fingerprints[0]), w.chunk_size,
                                 len(w.fingerprints), w.fingerprints, w.rules, w.kinds, w.entry_bytes, 0.0)
                fmt.registered = w.registered
                known[w.fingerprints] = fmt
            self._known, self._version = known, self.formats.version
        return self._known

    def __len__(self) -> int:
        return len(self._views())

    def listing(self) -> list[FormatInfo]:
        return [f.describe() for f in sorted(self._views().values(), key=lambda f: (f.model, f.label))]

    def find(self, model: str, label: str | None) -> Format:
        """The format a request names; ``BadRequest`` (404 for an unknown model) naming what is known."""
        known = self._views().values()
        found = [f for f in known if f.model == model]
        if not found:
            found = [f for f in known if PurePath(f.model).name == model]
        if not found:
            raise BadRequest(f"no engine of model {model!r} registered with this daemon (or its format was "
                             "forgotten); GET /v1/models lists the models and formats it knows", 404)
        if label is not None:
            for f in found:
                if f.label == label:
                    return f
            raise BadRequest(f"model {model!r} has no format {label!r} here; its formats: "
                             f"{', '.join(sorted(f.label for f in found))} (GET /v1/models)", 404)
        if len({(f.model, f.label) for f in found}) > 1:
            raise BadRequest(f"model {model!r} matches {len(found)} formats here "
                             f"({', '.join(sorted(f'{f.model} {f.label}' for f in found))}); name one in "
                             "\"format\" (GET /v1/models)")
        return found[0]


# --------------------------------------------------------------------------- the request


@dataclass(slots=True)
class Query:
    fmt: Format
    tokens: bytes  # little-endian uint32
    n_tokens: int
    salt: str | None
    lora: tuple[str, str] | None
    lora_digest: str | None  # None: read it from lora[1]
    mm: list[MMItem]
    tiers: frozenset[str]


def parse_tokens(body: Mapping[str, object]) -> tuple[bytes, int]:
    """The prompt's token ids as little-endian uint32 bytes, and their count."""
    has_list, has_b64 = "token_ids" in body, "token_ids_b64" in body
    if has_list == has_b64:
        raise BadRequest("give the prompt as \"token_ids\" (a list of integers) or \"token_ids_b64\" (base64 of "
                         "little-endian uint32), one of them")
    if has_list and isinstance(body["token_ids"], bytes):  # msgpack bodies: bin of little-endian uint32
        data = body["token_ids"]
        if len(data) > MAX_TOKENS * 4 or len(data) % 4:
            raise BadRequest(f"\"token_ids\" as bin must be little-endian uint32, at most {MAX_TOKENS} of them "
                             f"(got {len(data)} bytes)")
    elif has_list:
        ids = body["token_ids"]
        if not isinstance(ids, list):
            raise BadRequest(f"\"token_ids\" must be a list of integers, got {type(ids).__name__}")
        if len(ids) > MAX_TOKENS:
            raise BadRequest(f"\"token_ids\" has {len(ids)} tokens; at most {MAX_TOKENS} are taken (ask about a "
                             "prefix of the prompt)")
        try:
            packed = array.array(_U32, ids)
        except (TypeError, OverflowError):
            bad = next((i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < 1 << 32), -1)
            raise BadRequest(f"\"token_ids\" must hold integers in [0, 2**32); index {bad} holds "
                             f"{ids[bad]!r}") from None
        if _SWAP:
            packed.byteswap()
        data = packed.tobytes()
    else:
        raw = body["token_ids_b64"]
        if not isinstance(raw, str):
            raise BadRequest("\"token_ids_b64\" must be a base64 string")
        if len(raw) > (MAX_TOKENS * 4 + 2) // 3 * 4:
            raise BadRequest(f"\"token_ids_b64\" holds more than {MAX_TOKENS} tokens; ask about a prefix")
        try:
            data = binascii.a2b_base64(raw.encode("ascii"), strict_mode=True)
        except (binascii.Error, ValueError):
            raise BadRequest("\"token_ids_b64\" is not valid base64 (standard alphabet, padded)") from None
        if len(data) % 4:
            raise BadRequest(f"\"token_ids_b64\" decodes to {len(data)} bytes, not a whole number of uint32")
    n = len(data) // 4
    if n == 0:
        raise BadRequest("the prompt has no tokens")
    return data, n


def _name(body: Mapping[str, object], key: str, what: str, *, required: bool = False) -> str | None:
    v = body.get(key)
    if v is None:
        if required:
            raise BadRequest(f"\"{key}\" is missing: {what}")
        return None
    if not isinstance(v, str) or len(v) > MAX_NAME:
        raise BadRequest(f"\"{key}\" must be a string of at most {MAX_NAME} characters: {what}")
    return v


def parse_query(raw: bytes, book: FormatBook, content_type: str = JSON) -> Query:
    """Validate a ``POST /v1/usable_prefix`` body (docs/routing.md); ``BadRequest`` names the fix."""
    return query_from(decode_body(raw, content_type), book)


def decode_body(raw: bytes, content_type: str = JSON) -> dict[str, object]:
    """A JSON or msgpack body's object; ``BadRequest`` for anything else."""
    kind = content_type.split(";", 1)[0].strip().lower() if content_type else JSON
    if kind in MSGPACK:
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise BadRequest(f"the body is not msgpack: {e}") from None
    elif kind in (JSON, "text/json", ""):
        try:
            body = _decode(raw)
        except (ValueError, UnicodeDecodeError) as e:  # msgspec.DecodeError is a ValueError
            raise BadRequest(f"the body is not JSON: {e}") from None
    else:
        raise BadRequest(f"send the body as {JSON} or {MSGPACK[0]} (got {content_type})")
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object (a msgpack map)")
    return body


def query_from(body: Mapping[str, object], book: FormatBook, others: frozenset[str] = frozenset()) -> Query:
    """The query a decoded body names (its prefix: model, format, tokens, extras); fields in ``others`` are the
    caller's (a hint's payload), any other unknown field is a ``BadRequest``."""
    unknown = set(body) - _FIELDS - others
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)}; known: {sorted(_FIELDS | others)}")
    model = _name(body, "model", "the model name its engines registered (GET /v1/models)", required=True)
    assert model is not None
    fmt = book.find(model, _name(body, "format", "a format label of GET /v1/models"))
    tokens, n = parse_tokens(body)
    salt = _name(body, "cache_salt", "vLLM's cache_salt of the request") or None
    lora = body.get("lora")
    lora_key: tuple[str, str] | None = None
    digest: str | None = None
    if lora is not None:
        if not isinstance(lora, dict) or set(lora) - {"name", "path", "digest"}:
            raise BadRequest("\"lora\" must be an object {\"name\", \"path\"[, \"digest\"]}: the adapter's name "
                             "and path as the engine's LoRARequest has them")
        name = _name(lora, "name", "the adapter's lora_name", required=True)
        path = _name(lora, "path", "the adapter's lora_path as the engine was given it", required=True)
        assert name is not None and path is not None
        lora_key = (name, path)
        digest = _name(lora, "digest", "hkvd.transport.extras.read_adapter_digest of the adapter's folder")
    mm = _parse_mm(body.get("mm"))
    tiers = body.get("tiers")
    if tiers is None:
        wanted = frozenset(TIERS)
    elif not isinstance(tiers, list) or not all(isinstance(t, str) and t in TIERS for t in tiers):
        raise BadRequest(f"\"tiers\" must be a list of some of {list(TIERS)}")
    else:
        wanted = frozenset(tiers)
    return Query(fmt, tokens, n, salt, lora_key, digest, mm, wanted)


def _parse_mm(items: object) -> list[MMItem]:
    if items is None:
        return []
    if not isinstance(items, list) or len(items) > MAX_MM_ITEMS:
        raise BadRequest(f"\"mm\" must be a list of at most {MAX_MM_ITEMS} items")
    out = []
    last = -1
    for i, it in enumerate(items):
        if (not isinstance(it, dict) or set(it) != {"identifier", "offset", "length"}
                or not isinstance(it["identifier"], str) or len(it["identifier"]) > MAX_NAME
                or type(it["offset"]) is not int or type(it["length"]) is not int
                or it["offset"] < 0 or it["length"] < 1):
            raise BadRequest(f"\"mm\"[{i}] must be {{\"identifier\": str, \"offset\": int >= 0, \"length\": int "
                             ">= 1}: vLLM's MultiModalFeatureSpec identifier and placeholder range")
        if it["offset"] < last:
            raise BadRequest("\"mm\" items must be sorted by offset, as vLLM orders a prompt's items")
        last = it["offset"]
        out.append(MMItem(it["identifier"], it["offset"], it["length"]))
    return out


# --------------------------------------------------------------------------- the answer


class _ClusterChecks:
    """One batched existence check in flight at a time; requests that arrive meanwhile share the next."""

    def __init__(self, tier: Tier[object]) -> None:
        self.tier = tier
        self._waiting: list[tuple[list[EntryKey], asyncio.Future[set[EntryKey] | None]]] = []
        self._running = False

    async def holds(self, keys: list[EntryKey]) -> set[EntryKey] | None:
        """The keys the cluster holds; None when it did not answer within its lookup timeout."""
        fut: asyncio.Future[set[EntryKey] | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((keys, fut))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                asked = list(dict.fromkeys(k for keys, _ in batch for k in keys))
                got: set[EntryKey] | None
                try:
                    async with asyncio.timeout(self.tier.budget_s):
                        got = await self.tier.holds(asked)
                except TimeoutError:
                    got = None
                except Exception as e:  # the tier counts and logs its own errors
                    log.debug("cluster existence check failed: %s", e)
                    got = None
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(got)
        finally:
            self._running = False


class LazyKeys:
    """A prompt's chunk keys, hashed in order only as far as they are needed: a prompt whose first chunk
    is nowhere costs one hash, not one per chunk. The rolling key of chunk i needs every key before it,
    and no hit passes the first chunk whose full-attention entry no tier holds (``while_``)."""

    __slots__ = ("_C", "_extras", "_keys", "_n", "_tokens")
    STEP = 4  # keys hashed per extension

    def __init__(self, tokens: bytes, chunk_size: int, extras: list[bytes] | None) -> None:
        self._tokens = memoryview(tokens)
        self._C = chunk_size
        self._extras = extras
        self._n = len(tokens) // (4 * chunk_size)
        self._keys: list[bytes] = []

    def __len__(self) -> int:
        return self._n

    def all(self) -> list[bytes]:
        self._extend(self._n)
        return self._keys

    def while_(self, pred: Callable[[bytes], bool]) -> list[bytes]:
        """The keys before the first one ``pred`` refuses (hashing at most ``max(STEP, i)`` past it, the
        i-th)."""
        keys = self._keys
        i = 0
        while i < self._n:
            if i == len(keys):  # hash ahead, doubling: few calls for a long run, little waste for a short one
                self._extend(min(self._n, max(i + self.STEP, 2 * i)))
            if not pred(keys[i]):
                return keys[:i]
            i += 1
        return keys

    def _extend(self, n: int) -> None:
        keys, C = self._keys, self._C
        lo = len(keys)
        if n <= lo:
            return
        extras = self._extras[lo:n] if self._extras is not None else None
        keys += chunk_keys_le32(self._tokens[lo * C * 4:n * C * 4], C, parent=keys[-1] if keys else ROOT_KEY,
                                extras=extras)


class UsablePrefix:
    """The endpoint's logic. ``service`` is the daemon's ``KVService`` (index and tiers)."""

    def __init__(self, service: KVService, metrics: Metrics, book: FormatBook | None = None) -> None:
        self.service = service
        self.metrics = metrics
        self.book = book if book is not None else FormatBook()
        self._cluster = _ClusterChecks(service.cluster) if service.cluster is not None else None
        self._digests: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    # ---- HTTP ----------------------------------------------------------------------------------------
    def get_models(self, req: Request) -> Response:
        del req
        return Response(200, JSON, _dump({"models": self.book.listing()}))

    def post(self, req: Request) -> Response | Awaitable[Response]:
        """``POST /v1/usable_prefix``: answered now, or (a long prompt, the cluster, an adapter digest
        to read) by the returned awaitable."""
        try:
            q = parse_query(req.body, self.book, req.headers.get("content-type", JSON))
            digest = self._digest(q)
            n_keys = q.n_tokens // q.fmt.chunk_size
            if digest is None or n_keys > SLICE_CHUNKS or ("cluster" in q.tiers and self._cluster_usable()):
                return self._answer_later(q, digest)
            return self._respond(q, self.answer(q, self.keys(q, digest), None))
        except BadRequest as e:
            return self._refuse(e)

    async def _answer_later(self, q: Query, digest: str | None) -> Response:
        try:
            if digest is None:
                assert q.lora is not None
                digest = await self._read_digest(q.lora[1])
            ask_cluster = "cluster" in q.tiers and self._cluster is not None and self._cluster_usable()
            keys: LazyKeys | list[bytes]
            if ask_cluster or q.n_tokens // q.fmt.chunk_size > SLICE_CHUNKS:
                keys = await self.keys_sliced(q, digest)  # every key: the cluster is asked about all at once
            else:
                keys = self.keys(q, digest)
            held = None
            if ask_cluster:
                assert self._cluster is not None and isinstance(keys, list)
                held = await self._cluster.holds(self._entry_keys(q.fmt, keys))
            if len(keys) > SLICE_CHUNKS:
                await asyncio.sleep(0)
            return self._respond(q, self.answer(q, keys, held))
        except BadRequest as e:
            return self._refuse(e)

    def _respond(self, q: Query, answer: Answer) -> Response:
        self.metrics.inc("usable_prefix_requests", outcome="ok")
        t = answer["tiers"]
        # By hand: a third of json.dumps' time, and the same bytes (tests/unit/test_usable_prefix.py).
        body = (f'{q.fmt.json_head},"prompt_tokens":{answer["prompt_tokens"]},'
                f'"usable_tokens":{answer["usable_tokens"]},"prefix_tokens":{answer["prefix_tokens"]},'
                f'"tiers":{{"pool":{_num(t["pool"])},'
                f'"disk":{_num(t["disk"])},"cluster":{_num(t["cluster"])}}}}}')
        return Response(200, JSON, body.encode())

    def _refuse(self, e: BadRequest) -> Response:
        self.metrics.inc("usable_prefix_requests", outcome="unknown_model" if e.status == 404 else "bad_request")
        return Response(e.status, JSON, _dump({"error": str(e)}))

    # ---- keys ----------------------------------------------------------------------------------------
    async def chunk_keys(self, q: Query) -> list[bytes]:
        """Every chunk key of ``q``'s whole chunks, as the shim computes them (an adapter's digest read first
        where needed; long prompts hashed in slices). For other features that name a prefix (hints)."""
        digest = self._digest(q)
        if digest is None:
            assert q.lora is not None
            digest = await self._read_digest(q.lora[1])
        return await self.keys_sliced(q, digest)

    def _digest(self, q: Query) -> str | None:
        """The adapter digest for the keys: "" without an adapter; None when it must be read first."""
        if q.lora is None:
            return ""
        if q.lora_digest is not None:
            return q.lora_digest
        hit = self._digests.get(q.lora[1])
        if hit is not None and time.monotonic() - hit[1] < ADAPTER_TTL_S:
            return hit[0]
        return None

    async def _read_digest(self, path: str) -> str:
        loop = asyncio.get_running_loop()
        try:
            digest = await loop.run_in_executor(None, read_adapter_digest, path)
        except OSError as e:
            log.info("LoRA adapter %s: its files could not be read (%s); keyed by name and path only", path, e)
            digest = ""
        self._digests[path] = (digest, time.monotonic())
        self._digests.move_to_end(path)
        while len(self._digests) > ADAPTER_CACHE:
            self._digests.popitem(last=False)
        return digest

    def _extras(self, q: Query, digest: str, n_keys: int) -> list[bytes] | None:
        try:
            return chunk_extras(n_keys, q.fmt.chunk_size, lora=q.lora, lora_digest=digest, mm=q.mm,
                                cache_salt=q.salt)
        except Uncacheable as e:  # cannot happen for what parse_query lets through; never a token-only key
            raise BadRequest(f"these extras have no canonical encoding: {e.detail}") from None

    def keys(self, q: Query, digest: str) -> LazyKeys:
        """The chunk keys of the prompt's full chunks, as the shim computes them (hashed when first used)."""
        n_keys = q.n_tokens // q.fmt.chunk_size
        return LazyKeys(q.tokens, q.fmt.chunk_size, self._extras(q, digest, n_keys))

    async def keys_sliced(self, q: Query, digest: str) -> list[bytes]:
        """``keys``, ``SLICE_CHUNKS`` at a time, giving the loop back between slices."""
        C = q.fmt.chunk_size
        n_keys = q.n_tokens // C
        extras = self._extras(q, digest, n_keys)
        keys: list[bytes] = []
        view = memoryview(q.tokens)
        for lo in range(0, n_keys, SLICE_CHUNKS):
            hi = min(n_keys, lo + SLICE_CHUNKS)
            keys += chunk_keys_le32(view[lo * C * 4:hi * C * 4], C, parent=keys[-1] if keys else ROOT_KEY,
                                    extras=extras[lo:hi] if extras is not None else None)
            if hi < n_keys:
                await asyncio.sleep(0)
        return keys

    # ---- planning ------------------------------------------------------------------------------------
    def _cluster_usable(self) -> bool:
        tier = self.service.cluster
        return tier is not None and tier.usable()

    @staticmethod
    def _entry_keys(fmt: Format, keys: Sequence[bytes]) -> list[EntryKey]:
        return [(fp, r.group_id, k) for k in keys for r in fmt.rules for fp in fmt.rank_fingerprints]

    def answer(self, q: Query, keys: LazyKeys | list[bytes], cluster_held: set[EntryKey] | None) -> Answer:
        """The answer for ``q`` whose chunk keys are ``keys`` (see the module docstring); ``cluster_held``:
        what the cluster's existence check found (None: not asked, or no answer in time). Every length is
        what ``Cache.plan_lookup`` plans over the tiers named, as for an engine's lookup."""
        fmt = q.fmt
        C = fmt.chunk_size
        n_keys = len(keys)
        cap = min(n_keys, (q.n_tokens - 1) // C)
        disk, cache = self.service.disk, self.service.index
        sizes, kinds = fmt.entry_bytes, fmt.kinds

        def on_disk(k: EntryKey) -> bool:
            st = cast("DiskTier", disk).get(k)  # asked only when there is a disk tier (below)
            return st is not None and st.nbytes == sizes[k[1]] and st.kind == kinds[k[1]]

        pool = "pool" in q.tiers
        lower = [(name, has) for name, has in (
            ("disk", on_disk if "disk" in q.tiers and disk is not None else None),
            ("cluster", cluster_held.__contains__ if cluster_held is not None and "cluster" in q.tiers else None))
            if has is not None]
        below = _any_of([has for _, has in lower]) if lower else None
        tiers: dict[str, int | None] = dict.fromkeys(TIERS)
        if not pool and below is None:
            return {"model": fmt.model, "format": fmt.label, "chunk_size": C, "prompt_tokens": q.n_tokens,
                    "usable_tokens": 0, "prefix_tokens": 0, "tiers": tiers}
        # Other TP sizes' worlds of the model whose pool entries this format's engines read re-sharded, as their
        # lookups do (daemon/engines/reshards.py: the pool only).
        reshards = getattr(self.service, "reshards", None)
        others = [w.fingerprints for w in reshards.readable(fmt.rank_fingerprints)] if pool and reshards else []
        if isinstance(keys, LazyKeys):
            # Only the keys before the first chunk whose full-attention entries no tier holds can be in a hit.
            anywhere = _any_of([cache.is_ready] if below is None else [cache.is_ready, below]) if pool else below
            held = [_full_held(fmt, cast("HasFn", anywhere))]
            held += [_full_held(fmt, cache.is_ready, fps) for fps in others]
            keys = keys.while_(held[0] if len(held) == 1 else lambda k: any(h(k) for h in held)) \
                if fmt.full_groups else keys.all()
        pkeys = None
        if partial_prefix.servable(fmt) and q.lora is None and not q.mm and not q.salt:
            pkeys = partial_prefix.PartialKeys(q.tokens, C)  # past the last whole chunk: a partial chunk

        def one(fps: Sequence[bytes], in_pool: bool, has: HasFn | None, chunks: int, limit: int) -> int:
            if pkeys is None:
                return cache.plan_lookup(fmt, keys, fps, tiers=has, pool=in_pool, max_chunks=chunks).hit_chunks * C
            tails = partial_prefix.PartialTails(keys, pkeys, C, limit)
            return tails.tokens(cache.plan_lookup(fmt, keys, fps, tails=tails, tiers=has, pool=in_pool,
                                                  max_chunks=chunks))

        def tokens(in_pool: bool, has: HasFn | None, chunks: int, limit: int) -> int:
            got = one(fmt.rank_fingerprints, in_pool, has, chunks, limit)
            for fps in others if in_pool else ():
                got = max(got, one(fps, True, None, chunks, limit))
            return got

        if pool:
            tiers["pool"] = tokens(True, None, cap, q.n_tokens - 1)
        for name, has in lower:
            tiers[name] = tokens(False, has, cap, q.n_tokens - 1)
        usable = max(t or 0 for t in tiers.values())
        if pool + len(lower) > 1:  # the tiers together may serve more than each alone
            usable = max(usable, tokens(pool, below, cap, q.n_tokens - 1))
        prefix = max(usable, tokens(pool, below, n_keys, q.n_tokens))
        return {"model": fmt.model, "format": fmt.label, "chunk_size": C, "prompt_tokens": q.n_tokens,
                "usable_tokens": usable, "prefix_tokens": prefix, "tiers": tiers}


def _any_of(fns: list[Callable[[EntryKey], bool]]) -> Callable[[EntryKey], bool]:
    """Whether any of ``fns`` holds an entry (an entry may come from any tier)."""
    if len(fns) == 1:
        return fns[0]
    if len(fns) == 2:
        a, b = fns
        return lambda k: a(k) or b(k)
    return lambda k: any(f(k) for f in fns)


def _full_held(fmt: Format, has: Callable[[EntryKey], bool],
               world: Sequence[bytes] | None = None) -> Callable[[bytes], bool]:
    """Whether some tier holds a chunk's full-attention entries, of every full group and rank (of ``world``, a
    world of another TP size, where given)."""
    groups, fps = fmt.full_groups, tuple(world) if world is not None else fmt.rank_fingerprints
    if len(groups) == 1 and len(fps) == 1:
        g, fp = groups[0], fps[0]
        return lambda key: has((fp, g, key))
    return lambda key: all(has((fp, g, key)) for g in groups for fp in fps)


def _num(v: int | None) -> str:
    return "null" if v is None else str(v)


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
