"""Secret files: one rule for every key hkvd reads from disk.

Role
    The peer token (``--peer-token-file``), the fleet key of the cluster tier (``--cluster-key-file``)
    and the disk tier's directory key are read the same way: a regular file, owned by the daemon's
    user, that neither its group nor other users may read or write (like ssh keys). Anything else
    is refused at start-up with the command that fixes it. A symbolic link is followed; the file it
    names is what is checked.

Threading
    Pure functions; start-up and SIGHUP only (a few system calls).
"""

from __future__ import annotations

import os
import stat

MAX_SECRET_BYTES = 4096  # a token or key is tens of bytes; more is the wrong file
MIN_SECRET_BYTES = 16  # 128 bits


def not_private(st: os.stat_result) -> str:
    """Why a file with this ``stat`` may not hold a secret of the daemon's, or "" when it may."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by the daemon's user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"is open to its group or to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def private_fix(path: str) -> str:
    return f"`chown {os.geteuid()} {path} && chmod 600 {path}`"


def read_secret(path: str, flag: str) -> bytes:
    """The stripped contents of the secret file ``path`` (given as ``flag``).

    Raises ``ValueError`` whose message names the flag, what is wrong and the fix: the file cannot
    be read, is not private to the daemon's user, or holds more than ``MAX_SECRET_BYTES``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not hang the start
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        why = not_private(st)
        data = b"" if why else os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if why:
        raise ValueError(f"{flag} {path} {why}; {private_fix(path)}")
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"{flag} {path} holds more than {MAX_SECRET_BYTES} bytes: not a key (e.g. "
                         f"`openssl rand -hex 32 > {path}`)")
    return data.strip()
