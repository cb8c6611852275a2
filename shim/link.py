# SPDX-License-Identifier: Apache-2.0
"""The connector's link to the daemon: one ``DaemonClient`` and the "daemon is down" policy.

Role
    ``DaemonLink`` keeps a registered client, or none: while the daemon is down the engine
    recomputes, one warning is logged per outage, the connection is retried every
    ``reconnect_interval_s``, and the engine registers again on its own.

Threading model
    Called from vLLM's own threads (scheduler loop, worker execute loop). Not thread-safe; each
    connector half owns one. ``ensure()`` blocks (connect + register, bounded by
    ``connect_timeout_s``) at most once per ``reconnect_interval_s`` while the daemon is down.

Errors
    A ``RegistrationError`` at start-up propagates, so vLLM's startup fails with the fix; so does
    an unreachable daemon when ``require_daemon`` is set. Connectivity problems otherwise never
    propagate: the link goes down and the engine recomputes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hkvd.shim.client import DaemonClient
from hkvd.shim.shim_config import ShimConfig
from hkvd.transport.errors import KVError, RegistrationError
from hkvd.transport.wire.control import EngineSpec, RegisterAck

logger = logging.getLogger("hkvd.shim")


class DaemonLink:
    """A ``DaemonClient`` that is either up (registered) or down (recompute, retry later).

    ``ensure()`` returns the registered client or None; it reconnects at most once per
    ``reconnect_interval_s``. ``lost(exc)`` marks the link down after a transport error. One
    WARNING per outage, one INFO when it comes back; ``generation`` increases on every
    registration so callers can drop state (leases, job ids, step seq) tied to a dead one.
    """

    def __init__(self, cfg: ShimConfig, role: str, name: str, spec_fn: Callable[[], EngineSpec],
                 on_connected: Callable[[DaemonClient], None] | None = None) -> None:
        self.cfg = cfg
        self.role = role
        self.name = name
        self._spec_fn = spec_fn
        self._on_connected = on_connected
        self.client: DaemonClient | None = None
        self.ack: RegisterAck | None = None  # set with client
        self.generation = 0
        self._next_try = 0.0
        self._warned = False

    @property
    def up(self) -> bool:
        return self.client is not None

    def ensure(self, *, startup: bool = False) -> DaemonClient | None:
        if self.client is not None:
            return self.client
        now = time.monotonic()
        if now < self._next_try and not startup:
            return None
        self._next_try = now + self.cfg.reconnect_interval_s

        client = DaemonClient(self.cfg.socket_path, client_name=self.name, role=self.role,
                              timeout_s=self.cfg.connect_timeout_s)
        try:
            client.connect()
            if self._on_connected is not None:
                self._on_connected(client)
            ack = client.register(self._spec_fn())
        except RegistrationError as e:
            _close_quietly(client)
            if startup:
                raise  # a configuration problem: vLLM's startup must fail with the fix
            # A daemon restarted with other settings: keep serving (recompute), say why once.
            if not self._warned:
                logger.error("hkvd %s: the daemon at %s refused registration: %s", self.role,
                             self.cfg.socket_path, e)
            self._warned = True
            return None
        except (KVError, OSError, TimeoutError) as e:
            _close_quietly(client)
            if startup and self.cfg.require_daemon:
                raise RuntimeError(
                    f"hkvd: daemon unreachable at {self.cfg.socket_path} ({e}); start it with "
                    f"`hkvd serve --socket {self.cfg.socket_path}` or set require_daemon=false"
                ) from e
            self._warn_down(e)
            return None
        self.client, self.ack = client, ack
        self.generation += 1
        if self._warned:
            logger.info("hkvd %s: daemon back at %s (engine %s); caching resumes", self.role,
                        self.cfg.socket_path, ack.engine_id)
        else:
            logger.info("hkvd %s: registered with daemon at %s (engine %s, chunk %s tokens)", self.role,
                        self.cfg.socket_path, ack.engine_id, ack.chunk_size)
        self._warned = False
        return client

    def lost(self, exc: BaseException) -> None:
        if self.client is None:
            return
        _close_quietly(self.client)
        self.client = None
        self.ack = None
        # Try again at the next call: a restarted daemon is usually listening already. Only a
        # failed attempt backs off for reconnect_interval_s.
        self._next_try = 0.0
        self._warn_down(exc)

    def close(self) -> None:
        if self.client is not None:
            _close_quietly(self.client)
            self.client = None

    def _warn_down(self, exc: BaseException) -> None:
        if self._warned:
            logger.debug("hkvd %s: daemon still unreachable: %s", self.role, exc)
            return
        self._warned = True
        logger.warning(
            "hkvd %s: daemon at %s unavailable (%s); serving without the external cache (recompute), "
            "retrying every %.1f s", self.role, self.cfg.socket_path, exc, self.cfg.reconnect_interval_s)


def _close_quietly(client: DaemonClient) -> None:
    try:
        client.close()
    except Exception:  # close() must never turn an outage into a crash
        logger.debug("hkvd: client close failed", exc_info=True)
