"""Open-file descriptors: the daemon's limit, what it uses, and the refusal when they run short.

Role
    Every engine connection holds three descriptors in the daemon for as long as it stays (its
    socket, the pidfd that pins its process, the pinned ``/proc/PID/mem``), and peers, disk-tier
    files, the cluster tier, NIXL and metrics scrapes take more. A daemon out of descriptors must
    refuse new engines in words that name the fix, and keep serving the ones it has.

    - ``raise_limit()``: at start-up the soft ``RLIMIT_NOFILE`` goes up to the hard limit (the
      kernel's default soft limit, 1024, is there for programs that use ``select()``; hkvd uses
      epoll and ``poll()`` only, so a descriptor's number never matters).
    - ``DescriptorBudget.short(fd)``: whether a newly accepted connection leaves fewer than
      ``reserve`` descriptors free. The kernel hands out the lowest free number, so a socket
      accepted as descriptor N means 0..N-1 are all open: the check costs nothing per accept.
      The reserve (``limit / RESERVE_SHARE``, at least ``MIN_RESERVE`` and at most a quarter of
      the limit) stays for the engines already served (disk and cluster reads, peer links,
      scrapes) and for ``hkvd status``.
    - ``exhausted_error()``: the ``ResourceExhausted`` a client gets, naming LimitNOFILE.

Threading
    Plain functions and a small object read on the event loop; ``in_use()`` lists
    ``/proc/self/fd`` (about 1 us per open descriptor), so it runs for status and scrapes only.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from dataclasses import dataclass
from typing import NamedTuple

from hkvd.transport.errors import ResourceExhausted
from hkvd.transport.stat_fields import metric, status_only

DESCRIPTORS_PER_ENGINE = 3  # socket, pidfd, /proc/PID/mem
# Kept free for what serving engines still open (disk and cluster reads, peer links, scrapes): at a
# 1024 limit that is 128, at 65536 it is 4096 (the accept backlog, 100, fits in either); a limit under
# 512 keeps a quarter (a toy limit still serves a few engines).
MIN_RESERVE = 128
RESERVE_SHARE = 16
MAX_RESERVE_SHARE = 4
LOW_ROOM_ENGINES = 256  # a limit that leaves room for fewer engines than this is logged as a warning
_FIX = ("raise the daemon's open-file limit: LimitNOFILE= in its systemd unit (packaging/hkvd.service sets "
        "65536), or `ulimit -n` before `hkvd serve`")


class NofileLimit(NamedTuple):
    before: int  # the soft limit the process started with
    soft: int  # the soft limit now
    hard: int


def raise_limit() -> NofileLimit:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return both, and what the soft one was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return NofileLimit(soft, now, hard)


def raise_and_log(log: logging.Logger) -> NofileLimit:
    """``raise_limit()``, logged with both limits and the room it leaves for engines (a warning when small)."""
    limit = raise_limit()
    budget = DescriptorBudget(limit.soft, limit.hard)
    room = budget.engines_room(in_use())
    raised = f"raised from {limit.before} to {limit.soft}" if limit.before != limit.soft else f"{limit.soft}"
    text = f"open files: soft limit {raised}, hard limit {limit.hard}"
    if room < 0:
        log.info("%s; no limit on engines", text)
    elif room < LOW_ROOM_ENGINES:
        log.warning("%s: room for about %d engine connections (%d descriptors each, %d kept in reserve); %s",
                    text, room, DESCRIPTORS_PER_ENGINE, budget.reserve, _FIX)
    else:
        log.info("%s: room for about %d engine connections", text, room)
    return limit


def in_use() -> int:
    """Descriptors this process has open now (the listing's own descriptor not counted)."""
    return len(os.listdir("/proc/self/fd")) - 1


def exhausted(e: OSError) -> bool:
    """Whether ``e`` says the process (EMFILE) or the system (ENFILE) has no descriptor left."""
    return e.errno in (errno.EMFILE, errno.ENFILE)


def exhausted_error(what: str, e: OSError | None = None, detail: str = "") -> ResourceExhausted:
    """The refusal a client gets when ``what`` needed a descriptor and there was none to spare."""
    if e is not None and e.errno == errno.ENFILE:
        return ResourceExhausted(f"{what}: the system is out of open files (ENFILE); raise fs.file-max "
                                 "(sysctl) or close files elsewhere on this host; engines already served keep "
                                 "working, this one runs without the cache and retries")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ResourceExhausted(f"{what}: hkvd is out of file descriptors ({detail or f'its open-file limit is {soft}'}"
                             f"; each engine takes {DESCRIPTORS_PER_ENGINE}); {_FIX}. Engines already served keep "
                             "working; this one runs without the cache and retries")


@dataclass(frozen=True, slots=True)
class DescriptorStats:
    """Open-file descriptors (``hkvd status``: ``descriptors``): used, the limit, the reserve kept for the
    engines served, about how many more engines fit (-1: no limit). /metrics has used and the limit as
    ``hkvd_process_open_fds`` and ``hkvd_process_max_fds`` (prometheus-client's process collector)."""

    used: int = status_only()
    limit: int = status_only()
    hard_limit: int = status_only()
    reserve: int = metric("hkvd_descriptor_reserve", "Descriptors kept free for the engines served: new engines "
                          "are refused once fewer are left")
    engines_room: int = status_only()


class DescriptorBudget:
    """The open-file limit as the control socket applies it. See the module docstring."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft = soft
        self.hard = hard
        unlimited = soft == resource.RLIM_INFINITY
        self.reserve = MIN_RESERVE if unlimited else min(max(MIN_RESERVE, soft // RESERVE_SHARE),
                                                         soft // MAX_RESERVE_SHARE)
        self._floor = -1 if unlimited else soft - self.reserve

    @classmethod
    def current(cls) -> DescriptorBudget:
        return cls(*resource.getrlimit(resource.RLIMIT_NOFILE))

    def short(self, fd: int) -> bool:
        """Whether a connection accepted as descriptor ``fd`` leaves fewer than ``reserve`` free."""
        return self._floor >= 0 and fd >= self._floor

    def refusal(self, what: str, fd: int) -> ResourceExhausted:
        """The refusal of a connection accepted as descriptor ``fd`` (so at least ``fd + 1`` are open)."""
        return exhausted_error(what, detail=f"{fd + 1} of its open-file limit {self.soft} in use, the last "
                                            f"{self.reserve} kept for the engines it serves")

    def engines_room(self, used: int) -> int:
        """About how many more engines fit, with ``used`` descriptors open now."""
        if self._floor < 0:
            return -1
        return max(self._floor - used, 0) // DESCRIPTORS_PER_ENGINE

    def statistics(self) -> DescriptorStats:
        used = in_use()
        return DescriptorStats(used=used, limit=self.soft, hard_limit=self.hard, reserve=self.reserve,
                               engines_room=self.engines_room(used))
