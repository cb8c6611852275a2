# SPDX-License-Identifier: Apache-2.0
"""What the shim asks of its daemon: the request and completion surface of one connection.

Role
    ``DaemonPort`` is the type the connector's parts hold the daemon by. ``hkvd.shim.client.DaemonClient``
    implements it over the socket; ``hkvd.shim.testing.fake_daemon.FakeDaemon`` implements it in memory
    for the shim's unit tests. Connecting and registering are not part of it: ``hkvd.shim.link`` does them
    with the real client, and hands the parts a connected port.

Contracts
    - Every ``submit_*`` writes one request and returns its id without waiting for the daemon; its
      reply arrives as a ``Completion`` with that id from ``poll`` or ``wait``. ``release``, ``pin``,
      ``uncacheable`` and ``abort`` send one message and expect no reply of their own.
    - A lost connection raises from a submit (``DaemonUnavailable``) and completes every request
      outstanding with that error; ``connected`` turns False.
    - A message the daemon's ``RegisterAck`` does not say it takes (tails, turn ends, pins, watches,
      tenants) is never sent: the callers check the ack first.

Threading
    One caller thread per port on the scheduler side (vLLM's scheduler thread); see the client for
    the worker side's polls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from hkvd.shim.results import Completion
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.kv import Item


class DaemonPort(Protocol):
    @property
    def connected(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def submit_lookup(self, keys: Sequence[bytes], lease: bool = True,
                      tails: Sequence[tuple[int, bytes]] = (), ends: bool = False, places: bool = False,
                      skip_tiers: int = 0) -> int: ...

    def submit_store(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"",
                     notes: Sequence[BlockNote] | None = None, tenant: str = "", turn_end: int = 0,
                     skip_tiers: int = 0) -> int: ...

    def submit_retrieve(self, items: Sequence[Item | Sequence[Any]], lease_id: int = 0) -> int: ...

    def submit_step_event(self, seq: int, step: int, offers: Sequence[Item | Sequence[Any]],
                          confirms: Iterable[int] = (), wait_event: bytes = b"",
                          notes: Sequence[BlockNote] | None = None,
                          verifies: Sequence[Item | Sequence[Any]] = (), tenants: Sequence[str] = (),
                          skip_tiers: Sequence[int] = ()) -> int: ...

    def submit_verify(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"") -> int: ...

    def submit_events_poll(self, since: int) -> int: ...

    def submit_pull(self, peer: str, keys: Sequence[bytes], max_chunks: int = 0, release_lease: int = 0) -> int: ...

    def submit_watch(self, lease_id: int) -> int: ...

    def release(self, lease_id: int) -> None: ...

    def pin(self, session: str, tenant: str, ttl_s: float, keys: Sequence[bytes],
            partial_keys: Sequence[bytes] = ()) -> None: ...

    def hints(self, tenant: str, keys: Sequence[bytes], actions: Sequence[tuple[str, float, str]],
              counted: Mapping[str, int]) -> None: ...

    def uncacheable(self, reason: str) -> None: ...

    def abort(self, req_id: int) -> None: ...

    def poll(self, timeout_s: float = 0.0) -> list[Completion]: ...

    def wait(self, req_ids: Iterable[int], timeout_s: float) -> dict[int, Completion]: ...
