"""systemd's notify protocol (sd_notify(3)) in its few documented lines, no libsystemd needed.

Protocol
    The service manager passes ``$NOTIFY_SOCKET``: a path (``/run/systemd/notify``) or an abstract
    address (``@...``, the ``@`` standing for a leading NUL byte). The service sends newline-separated
    ``KEY=VALUE`` assignments in one AF_UNIX datagram: ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``,
    ``STOPPING=1``, ``RELOADING=1``, ``EXTEND_TIMEOUT_USEC=N`` (the start may take N µs more from
    now). Without ``$NOTIFY_SOCKET`` every call is a no-op.

Watchdog
    With ``WatchdogSec=`` the manager sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, which must be ours
    when set). The daemon pings ``WATCHDOG=1`` at half that interval from a task on its event loop, so a
    hung loop stops the pings and systemd restarts the service.

Threading
    ``send`` may be called from any thread (the disk tier's scan progress runs on its thread); each
    call opens its own datagram socket, so no state is shared.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("hkvd.notify")


def _address(raw: str) -> str | None:
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # vsock: and other forms are not used on a GPU node


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = _address(raw) if raw else None
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or an abstract address; not notifying", raw)
        self.watchdog_usec = 0
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_usec = int(usec)
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float:
        """Seconds between WATCHDOG=1 pings (half the manager's timeout), 0 when there is no watchdog."""
        return self.watchdog_usec / 2e6

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; True when it was sent. Never raises."""
        if self.address is None:
            return False
        data = "\n".join(a.replace("\n", " ") if a.startswith("STATUS=") else a for a in assignments)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(self.address)
                s.sendall(data.encode())
            return True
        except OSError as e:
            if not self._warned:  # the manager went away: say so once, keep serving
                self._warned = True
                log.warning("cannot notify the service manager at %r: %s", self.address, e)
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def extend(self, seconds: float, status: str) -> bool:
        """Move the start (or stop) deadline to ``seconds`` from now, with a STATUS= line."""
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def reloading(self, status: str) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")
