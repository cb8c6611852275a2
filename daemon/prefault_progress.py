"""The pool's pre-fault as systemd and the log see it: the first slice before ready, the rest behind serving.

Before ready, each second with progress sends ``EXTEND_TIMEOUT_USEC`` (``EXTEND_TIMEOUT_S`` ahead) and
``STATUS=``, so a start that progresses is never killed by ``TimeoutStartSec`` and a stuck one is.
While serving, ``STATUS=`` carries the faulted share every second until the pool is all in.

Event loop only: the waits for the pre-fault threads run on a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hkvd.daemon.cache import HugePagePool, Prefaulter
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.notify import Notifier
from hkvd.transport.errors import PoolError

log = logging.getLogger("hkvd")

PROGRESS_EVERY_S = 1.0
# Each report of start-up progress moves systemd's start deadline to this far ahead: a start that
# progresses is never killed, whatever the pool size; one stuck this long is (TimeoutStartSec rules).
EXTEND_TIMEOUT_S = 60.0


class PrefaultProgress:
    """Waits for ``prefault`` and reports it; ``summary`` is the daemon's one-line ``STATUS=``, and the
    log gets the faulted share every ``log_every_s`` while serving."""

    def __init__(self, pool: HugePagePool, prefault: Prefaulter, notifier: Notifier, metrics: Metrics, *,
                 summary: Callable[[], str], log_every_s: float) -> None:
        self.pool = pool
        self.prefault = prefault
        self.notifier = notifier
        self.metrics = metrics
        self.summary = summary
        self.log_every_s = log_every_s

    def share(self) -> str:
        """The faulted share, for STATUS= and the log."""
        p = self.prefault.progress()
        share = p.faulted_bytes / p.total_bytes
        return f"{p.faulted_bytes >> 20} / {p.total_bytes >> 20} MiB pre-faulted ({share:.0%})"

    async def first_slice(self, first: int) -> None:
        """Wait until ``first`` bytes of the pool are faulted in (the rest follows while serving).

        Each second with progress tells systemd STATUS= and EXTEND_TIMEOUT_USEC=, so however slow the
        machine, a start that makes progress is never killed by TimeoutStartSec and a stuck one is,
        EXTEND_TIMEOUT_S after its last progress. A populate error here fails the start.
        """
        prefault, pool = self.prefault, self.pool
        reported = 0
        self.notifier.extend(EXTEND_TIMEOUT_S, f"pre-faulting the first {first >> 20} MiB of the pool")
        while True:
            p = await asyncio.to_thread(prefault.wait_for, first, PROGRESS_EVERY_S)
            if p.error:
                raise PoolError(p.error)
            if p.faulted_bytes >= first:
                break
            if p.faulted_bytes > reported:
                reported = p.faulted_bytes
                self.notifier.extend(EXTEND_TIMEOUT_S, f"pre-faulting the first {first >> 20} MiB of the pool: "
                                     f"{self.share()}")
        pool.backing(refresh=True)  # what the kernel gave the first slice: status reports it
        log.info("pool: first %d MiB faulted in %.2f s (%s pages); serving while the rest follows",
                 p.faulted_bytes >> 20, p.elapsed_s, pool.backing().kind)

    async def finish(self) -> None:
        """While serving: STATUS= pre-fault progress every second; when done, the rate and the backing."""
        prefault = self.prefault
        logged = time.monotonic()
        while not (p := await asyncio.to_thread(prefault.wait_for, prefault.total_bytes, PROGRESS_EVERY_S)).done:
            self.notifier.status(f"{self.summary()}; {self.share()}")
            if time.monotonic() - logged >= self.log_every_s:
                logged = time.monotonic()
                log.info("pre-faulting pool: %s", self.share())
        if p.error:
            self.metrics.inc("prefault_errors")
            log.error("%s", p.error)
        else:
            self.metrics.inc("prefault_gbps", p.gbps)
        backing = self.pool.backing()  # re-read by the last pre-fault worker, before it reported done
        log.info("pool pre-faulted: %d MiB in %.1f s (%.2f GB/s, %d threads); backed by %s pages of %d KiB "
                 "(%d MiB huge)", p.faulted_bytes >> 20, p.elapsed_s, p.gbps, p.threads, backing.kind,
                 backing.page_size >> 10, backing.huge_bytes >> 20)
        self.notifier.status(f"{self.summary()}; " + (f"pool pre-fault failed at {p.faulted_bytes >> 20} MiB" if p.error
                             else f"pool pre-faulted ({backing.kind} pages)"))
