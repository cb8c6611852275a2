"""Replies: which message answers each request, for the daemon that sends it and the shim that reads it.

Role
    Every reply is a message of its own, declared beside its request in its family's module
    (``control``, ``kv``, ``events``, ``peer``): a frozen ``Message`` whose typed fields travel as an
    array, checked by ``Message.from_wire`` like any other frame. ``REPLIES`` pairs each request the
    shim's client tracks with the one message type that answers it; the client completes the request
    with that message as sent, or with a ``ProtocolViolation`` when another type comes back. Callers
    read ``reply.hit_chunks``: a misspelt or missing field is an error, never a 0.

Contracts
    - One reply type per request, and one request per reply type (a test checks both): the type alone
      says what a reply answers.
    - A request outside ``REPLIES`` gets no reply of its own: ``Release``, ``Pin``, ``Uncacheable``
      (fire and forget), and ``Abort``, whose ``AbortAck`` only acknowledges the abort (the job it names
      still ends with its own reply or ``Error``). ``Hello`` and the peer messages are answered in their
      handshakes and peer links, not through this table.
    - An optional field is trailing and has a default (``Message.to_wire`` leaves it out at its default):
      a retrieve's ``event`` and ``seconds``, a step event's counts, a pull's READ timings.
    - No torch, no I/O: the shim imports this inside vLLM, the daemon on its event loop.
"""

from __future__ import annotations

from hkvd.transport.wire.control import (
    LiftQuarantine,
    Ping,
    Pong,
    QuarantineLifted,
    Register,
    RegisterAck,
    Status,
    StatusReply,
    Unpin,
    Unpinned,
    Unregister,
    Unregistered,
)
from hkvd.transport.wire.events import KVEvents, KVEventsPoll, StepEvent, StepResult
from hkvd.transport.wire.kv import (
    LeaseWritten,
    Lookup,
    LookupReply,
    Retrieve,
    RetrieveResult,
    Store,
    StoreResult,
    Verify,
    VerifyResult,
    WatchLease,
)
from hkvd.transport.wire.message import Message
from hkvd.transport.wire.peer import Pull, PullResult

# The message that answers each request: that message, as sent, is the request's result.
REPLIES: dict[type[Message], type[Message]] = {
    Register: RegisterAck, Unregister: Unregistered, Status: StatusReply, Ping: Pong,
    LiftQuarantine: QuarantineLifted, Unpin: Unpinned,
    Lookup: LookupReply, Store: StoreResult, Retrieve: RetrieveResult, Verify: VerifyResult,
    WatchLease: LeaseWritten,
    StepEvent: StepResult, KVEventsPoll: KVEvents,
    Pull: PullResult,
}

__all__ = ["REPLIES"]
