"""The engine process behind a connection, pinned so the daemon's copy authority cannot be borrowed.

Role
    The host copy engine reads and writes an engine's memory with process_vm_readv/writev. A
    daemon that may do so (same user, or root) must only ever touch the process that connected,
    as it was when it connected. A pid alone does not say that: the process may fork, hand the
    socket to a child and exec a setuid program under the same pid, or exit and have its pid
    reused. ``ClientProcess`` pins the connecting process and ``PinnedMemory`` pins its address
    space, so each copy can prove it still talks to the same program.

How
    - At accept: pid, uid and gid come from ``SO_PEERCRED``; a pidfd from ``SO_PEERPIDFD``
      (Linux >= 6.5: the kernel's reference to the very process that connected), else
      ``pidfd_open(pid)``. The process's start time is recorded.
    - ``check()``: the pidfd is not readable (``poll()``, never ``select()``, whose sets end at
      descriptor 1023: the process has not exited), the start time is
      unchanged (the pid was not reused), every uid and gid of ``/proc/PID/status`` (real,
      effective, saved, filesystem) equals the connection's, and ``/proc/PID`` is owned by that uid
      (the kernel hands a process's /proc files to root when it is not dumpable, for example after
      a setuid exec or ``PR_SET_DUMPABLE 0``).
    - At registration, ``pin_memory()`` opens ``/proc/PID/mem`` and then runs ``check()``. The
      open file holds the address space the process had at that moment. An exec replaces the
      address space, and an exit ends it; either way, reading through the old file returns
      nothing. ``PinnedMemory.check()`` reads one byte through it before and after every copy, so
      bytes copied across an exec are never stored (``CopyFailedError`` once the process has
      exited, ``PermissionDenied`` while another program runs under its pid).

Contracts
    - Every refusal raises ``PermissionDenied`` (``CopyFailedError`` for a process that exited
      after registering, ``RegistrationError`` for one gone before it was pinned) whose message
      says what changed and what to do. Out of descriptors (EMFILE, ENFILE) while pinning is
      ``ResourceExhausted`` naming the limit to raise, never mistaken for a process that exited.
      None of them says anything about the target's memory (no address-probing oracle).
    - ``close()`` is idempotent and closes the pidfd and the memory file.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from dataclasses import dataclass, field

from hkvd.daemon.fd_budget import exhausted, exhausted_error
from hkvd.transport.errors import CopyFailedError, PermissionDenied, RegistrationError

SO_PEERPIDFD = 77  # Linux >= 6.5; not in Python 3.11's socket module

_RESTART = ("restart the engine; an engine's process must keep the connection it registered on, "
            "and must not exec or change user while registered")


def _status_ids(pid: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                uids = tuple(int(x) for x in line.split()[1:])
            elif line.startswith(b"Gid:"):
                gids = tuple(int(x) for x in line.split()[1:])
    return uids, gids


def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # Field 22 (starttime); the command name (field 2) may hold spaces and parentheses: split after it.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _pidfd_from_socket(sock: socket.socket) -> int | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4)
    except OSError:
        return None  # older kernel: pidfd_open below
    return struct.unpack("i", raw)[0]


@dataclass(slots=True)
class ClientProcess:
    """The process that connected: see the module docstring."""

    pid: int
    uid: int
    gid: int
    pidfd: int
    start_ticks: int
    _memory: PinnedMemory | None = field(default=None, repr=False)

    @classmethod
    def from_socket(cls, sock: socket.socket) -> ClientProcess:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        return cls.open(pid, uid, gid, pidfd=_pidfd_from_socket(sock))

    @classmethod
    def open(cls, pid: int, uid: int | None = None, gid: int | None = None, *,
             pidfd: int | None = None) -> ClientProcess:
        """Pin ``pid``; ``uid``/``gid`` default to its real ids now (the socket path passes SO_PEERCRED's)."""
        try:
            if pidfd is None:
                pidfd = os.pidfd_open(pid)
            start = _start_ticks(pid)
            if uid is None or gid is None:
                uids, gids = _status_ids(pid)
                uid, gid = uids[0], gids[0]
        except OSError as e:
            if pidfd is not None:
                os.close(pidfd)
            if exhausted(e):
                raise exhausted_error(f"pinning engine process {pid}", e) from None
            raise RegistrationError(f"engine process {pid} does not exist (it exited before it could be pinned); "
                                    f"{_RESTART}") from None
        proc = cls(pid, uid, gid, pidfd, start)
        return proc

    def exited(self) -> bool:
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def check(self) -> None:
        """Raise ``PermissionDenied`` unless this is still the process that connected, unchanged."""
        why = self._changed()
        if why:
            raise PermissionDenied(f"engine process {self.pid} {why}; {_RESTART}")

    def _changed(self) -> str:
        if self.pidfd < 0 or self.exited():
            return "has exited"
        try:
            start = _start_ticks(self.pid)
            uids, gids = _status_ids(self.pid)
            owner = os.stat(f"/proc/{self.pid}").st_uid
        except OSError as e:
            if exhausted(e):
                raise exhausted_error(f"checking engine process {self.pid}", e) from None
            return "has exited"
        except (ValueError, IndexError):
            return "has exited"
        if self.exited() or start != self.start_ticks:
            return "has exited (its pid now names another process)"
        if set(uids) != {self.uid} or set(gids) != {self.gid}:
            return (f"changed credentials since it connected (uids {'/'.join(map(str, uids))}, "
                    f"gids {'/'.join(map(str, gids))}; it connected as uid {self.uid} gid {self.gid})")
        if owner != self.uid:
            return "is no longer dumpable (a setuid exec or PR_SET_DUMPABLE 0), so the daemon may not copy its memory"
        return ""

    def pin_memory(self) -> PinnedMemory:
        """Open the process's address space as it is now, then prove it still is the connected process."""
        if self._memory is None:
            try:
                fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                if exhausted(e):
                    raise exhausted_error(f"pinning the memory of engine process {self.pid}", e) from None
                self.check()  # names what changed, if something did
                raise PermissionDenied(f"the daemon may not open the memory of engine process {self.pid} "
                                       f"({os.strerror(e.errno or 0)}); run hkvd serve as the engine's user "
                                       "and let the engine call allow_ptracer") from None
            memory = PinnedMemory(self, fd)
            try:
                self.check()
            except PermissionDenied:
                memory.close()
                raise
            self._memory = memory
        return self._memory

    def close(self) -> None:
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass(slots=True)
class PinnedMemory:
    """The address space ``pin_memory`` saw; ``probe`` is an address known mapped in it."""

    process: ClientProcess
    fd: int
    probe: int = 0

    def check(self) -> None:
        """Raise ``PermissionDenied`` if the pinned address space is gone (exec or exit) or the process changed."""
        try:
            alive = len(os.pread(self.fd, 1, self.probe)) == 1 if self.fd >= 0 else False
        except OSError:
            alive = False
        if not alive and self.process.exited():
            raise CopyFailedError(f"engine process {self.process.pid} has exited; nothing was copied or kept")
        if not alive:
            raise PermissionDenied(f"engine process {self.process.pid} is no longer the program that registered "
                                   f"(it exec'd or exited); nothing was copied or kept; {_RESTART}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
