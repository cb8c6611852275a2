"""One client connection as the service sees it (``Conn``), and what every message handler asks of it.

Event loop only: ``daemon/server.py`` builds a ``Conn`` at accept and the service's handlers change it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Required, TypedDict

from hkvd.transport.errors import KVError, NotRegistered

if TYPE_CHECKING:
    from hkvd.daemon.cache import Entry
    from hkvd.daemon.engines.client_process import ClientProcess
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.engines.snapshots import SnapshotOrdering
    from hkvd.daemon.engines.verification import Scratch
    from hkvd.transport.wire import Message


@dataclass(slots=True)
class Conn:
    """One client connection as the service sees it."""

    conn_id: int
    pid: int
    uid: int
    send: Callable[[Message], None]
    process: ClientProcess | None = None  # pinned at accept (None only in tests that drive the service directly)
    role: str = ""
    engine: EngineState | None = None
    snapshots: SnapshotOrdering | None = None
    # step-event job id -> entries it wrote that await the engine's confirmation
    pending: dict[int, list[Entry]] = field(default_factory=dict)
    # step-event job id -> boundary states it copied for a sampled hit (scratch), compared once confirmed
    verifying: dict[int, list[Scratch]] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    jobs: set[int] = field(default_factory=set)  # job ids (store, retrieve, step event) not finished yet
    inflight: int = 0
    closed: bool = False
    # Set for a connection served from the descriptor reserve (daemon/server.py): it may not register.
    register_refusal: KVError | None = None
    # Stops the adapter watching ``process``'s pidfd (daemon/server.py); run before the pidfd is closed.
    unwatch: Callable[[], None] | None = None
    gone: bool = False  # the engine process exited or its connection ended: its copies were abandoned


def registered_engine(conn: Conn, *, copy: bool) -> EngineState:
    """The engine ``conn`` registered; ``copy``: one that registered regions (a worker connection).
    ``NotRegistered`` otherwise."""
    if conn.engine is None:
        raise NotRegistered("register the engine (Register) before this request")
    if copy and conn.engine.attachment is None:
        raise NotRegistered("this connection registered no regions (lookup only); stores and "
                            "retrieves go through the worker connection")
    return conn.engine


class RequestLog(TypedDict, total=False):
    """``extra=`` fields of a per-request log line (``request_log``)."""

    peer_pid: Required[int]
    req_id: Required[int]
    engine: int  # the registered engine's id, or
    conn: int  # the connection's, before Register


def request_log(conn: Conn, req_id: int) -> RequestLog:
    """``extra=`` fields for a per-request log line: ``engine`` (or ``conn``), ``peer_pid``, ``req_id``."""
    fields: RequestLog = {"peer_pid": conn.pid, "req_id": req_id}
    if conn.engine is not None:
        fields["engine"] = conn.engine.engine_id
    else:
        fields["conn"] = conn.conn_id
    return fields
