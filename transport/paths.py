"""Where the daemon's control socket lives by default; shared by ``hkvd serve`` and the shim."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/hkvd/hkvd.sock``; ``/run/hkvd/hkvd.sock`` as root or without XDG_RUNTIME_DIR."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if os.geteuid() != 0 and xdg:
        return str(Path(xdg) / "hkvd" / "hkvd.sock")
    return "/run/hkvd/hkvd.sock"
