"""What a request to the daemon completes with: the reply the daemon sent, and the shim's own wrapper.

Role
    ``DaemonClient`` completes each request it sent with a ``Completion`` holding that request's
    result, which is the reply message the daemon sent, declared once in ``hkvd.transport.wire``
    (``hkvd.transport.wire.replies.REPLIES`` tells which: ``StoreResult``, ``RetrieveResult``,
    ``StepResult``, ``PullResult``, ``VerifyResult``, ``LookupReply``, ``RegisterAck``, ``KVEvents``, ...).
    Only ``Completion`` is the shim's own. A caller reads ``result.hit_chunks``: a misspelt or missing
    field is an error, never a 0.

Contracts
    - ``Completion.get(cls)`` returns the result if it is a ``cls``, else raises ``TypeError``: the
      caller asked for the wrong kind of result.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias, TypeVar

from hkvd.transport.errors import KVError
from hkvd.transport.wire.message import Message

Result: TypeAlias = Message  # the reply message of the request (hkvd.transport.wire.replies.REPLIES)
R = TypeVar("R")


class Completion(NamedTuple):
    req_id: int
    ok: bool
    result: Result | None  # None when the request failed
    error: KVError | None

    def get(self, cls: type[R]) -> R:
        """The result as a ``cls``; raises the request's error if it failed."""
        if self.error is not None:
            raise self.error
        if not isinstance(self.result, cls):
            raise TypeError(f"request {self.req_id} returned a {type(self.result).__name__}, not a {cls.__name__}")
        return self.result
