"""Block notes: what a KV event needs to name a stored chunk the way vLLM names its own blocks.

hkvd keys entries by its own chunk keys (``hkvd.transport.keys``), which no router knows. A router
(llm-d's KV indexer, Dynamo's KV router) knows vLLM's block hashes, so the engine's scheduler side
sends, with the items of a ``Store`` or a ``StepEvent``, one *note* per chunk key it stores::

    [key, hashes, parent, tokens, extra_keys, lora_id, lora_name]

- ``key``: the chunk key (16 bytes) the items of the same message name;
- a partial chunk's note (``is_partial``) holds one hash and the tokens of one block of vLLM's hash
  unit, ending where the partial chunk ends: vLLM's own partial entry there;
- ``hashes``: vLLM's hash of each of the chunk's blocks (``chunk_size / block_size`` of them), as
  vLLM publishes them (bytes, or the 64-bit integers of ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
- ``parent``: the hash of the block before the chunk, or nil for chunk 0;
- ``tokens``: the chunk's token ids, little-endian uint32;
- ``extra_keys``: nil, or one entry per block: nil or the block's extra keys as vLLM publishes them
  (never a ``cache_salt``: events name no tenant);
- ``lora_id``, ``lora_name``: the adapter, or nil.

The daemon keeps a note while any tier holds the chunk and publishes ``BlockStored`` and
``BlockRemoved`` events from it (``hkvd.daemon.routing``). The sizes here bound one note; the
daemon checks the counts against the engine's registration (``check_against``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hkvd.transport.errors import OutOfRange, ProtocolViolation
from hkvd.transport.wire.message import KEY_BYTES, MAX_ITEMS

# One chunk: far above a real chunk (vLLM blocks are 16-2048 tokens; chunks a few blocks).
MAX_NOTE_BLOCKS = 1024
MAX_NOTE_TOKENS = 1 << 17
MAX_HASH_BYTES = 64  # vLLM's are 32 (sha256) or 16 (xxhash)
MAX_EXTRA_PER_BLOCK = 64
MAX_EXTRA_STR = 1024
MAX_EXTRA_BYTES = 64
MAX_EXTRA_TUPLE = 4  # a multimodal item: (identifier, offset)
MAX_LORA_NAME = 1024
_U64 = 1 << 64

ExternalHash = bytes | int
ExtraScalar = str | bytes | int
# One of a block's extra keys as vLLM publishes it (a tuple, such as a multimodal item's, as a list).
ExtraKey = ExtraScalar | list[ExtraScalar]


class BlockNote(NamedTuple):
    key: bytes
    hashes: list[ExternalHash]
    parent: ExternalHash | None
    tokens: bytes  # little-endian uint32 token ids
    extra_keys: list[list[ExtraKey] | None] | None  # per block: its extra keys, or None
    lora_id: int | None
    lora_name: str | None

    def to_wire(self) -> list[object]:
        return list(self)


def _hash_ok(h: object) -> bool:
    if type(h) is bytes:
        return 0 < len(h) <= MAX_HASH_BYTES
    return type(h) is int and 0 <= h < _U64


def _scalar_ok(v: Any) -> bool:
    t = type(v)
    if t is str:
        return len(v) <= MAX_EXTRA_STR
    if t is bytes:
        return len(v) <= MAX_EXTRA_BYTES
    return t is int and -_U64 < v < _U64


def _extra_ok(v: object) -> bool:
    if type(v) is list:
        return len(v) <= MAX_EXTRA_TUPLE and all(_scalar_ok(x) for x in v)
    return _scalar_ok(v)


def _check_note(n: object, where: str) -> None:
    if type(n) is not list or len(n) != 7:
        raise ProtocolViolation(f"{where}: a note is [key, hashes, parent, tokens, extra_keys, lora_id, lora_name]")
    key, hashes, parent, tokens, extra, lora_id, lora_name = n
    if type(key) is not bytes or len(key) != KEY_BYTES:
        raise ProtocolViolation(f"{where}: key must be {KEY_BYTES} bytes")
    if (type(hashes) is not list or not 0 < len(hashes) <= MAX_NOTE_BLOCKS
            or not all(_hash_ok(h) for h in hashes)):
        raise ProtocolViolation(f"{where}: hashes must be 1..{MAX_NOTE_BLOCKS} block hashes (bytes of at most "
                                f"{MAX_HASH_BYTES}, or unsigned 64-bit integers)")
    if parent is not None and not _hash_ok(parent):
        raise ProtocolViolation(f"{where}: parent must be a block hash or nil")
    if type(tokens) is not bytes or not 0 < len(tokens) <= 4 * MAX_NOTE_TOKENS or len(tokens) % 4:
        raise ProtocolViolation(f"{where}: tokens must be 1..{MAX_NOTE_TOKENS} little-endian uint32 token ids")
    if extra is not None:
        if type(extra) is not list or len(extra) != len(hashes):
            raise ProtocolViolation(f"{where}: extra_keys must be nil or one entry per block hash")
        for block in extra:
            if block is None:
                continue
            if type(block) is not list or len(block) > MAX_EXTRA_PER_BLOCK or not all(_extra_ok(v) for v in block):
                raise ProtocolViolation(f"{where}: a block's extra keys are nil or at most {MAX_EXTRA_PER_BLOCK} "
                                        f"strings, byte strings, integers or short lists of them")
    if lora_id is not None and (type(lora_id) is not int or not 0 <= lora_id < _U64):
        raise ProtocolViolation(f"{where}: lora_id must be an unsigned integer or nil")
    if lora_name is not None and (type(lora_name) is not str or len(lora_name) > MAX_LORA_NAME):
        raise ProtocolViolation(f"{where}: lora_name must be a string of at most {MAX_LORA_NAME} characters or nil")


def check_notes(raw: object, where: str) -> None:
    """Raise ``ProtocolViolation`` naming the first bad note of ``raw`` (nil: none); build nothing."""
    if raw is None:
        return
    if type(raw) is not list or len(raw) > MAX_ITEMS:
        raise ProtocolViolation(f"{where}: nil or a list of at most {MAX_ITEMS} notes")
    for i, n in enumerate(raw):
        _check_note(n, f"{where}[{i}]")


def checked_notes(raw: Any) -> list[BlockNote]:
    """The notes of a message whose ``validate`` already ran ``check_notes``."""
    return [BlockNote(*n) for n in raw] if raw else []


def is_partial(note: BlockNote, block_size: int) -> bool:
    """Whether ``note`` names a partial chunk: one block of fewer tokens than vLLM's block size (its hash unit),
    ending where the partial chunk ends, as vLLM names its own partial entries."""
    return len(note.hashes) == 1 and len(note.tokens) < 4 * block_size


def check_against(note: BlockNote, chunk_size: int, block_size: int) -> None:
    """A note's counts against the engine's registration; raise ``OutOfRange``."""
    if is_partial(note, block_size):
        unit = len(note.tokens) // 4
        if block_size % unit or chunk_size % block_size:
            raise OutOfRange(f"note for partial chunk key {note.key.hex()[:12]} holds a block of {unit} tokens, "
                             f"which does not divide this engine's block size {block_size}")
        return
    if len(note.tokens) != 4 * chunk_size:
        raise OutOfRange(f"note for chunk key {note.key.hex()[:12]} holds {len(note.tokens) // 4} tokens; this "
                         f"engine's chunks are {chunk_size}")
    if block_size <= 0 or chunk_size % block_size or len(note.hashes) != chunk_size // block_size:
        raise OutOfRange(f"note for chunk key {note.key.hex()[:12]} holds {len(note.hashes)} block hashes; this "
                         f"engine's chunks are {chunk_size // max(block_size, 1)} blocks of {block_size} tokens")
