"""Peer authentication: the shared token, HMAC challenge proofs, the address allowlist, admission.

Role
    Pure helpers for ``serving`` and ``pulling``. Two daemons pair only when both know the
    same token (``--peer-token-file``, ``HKVD_PEER_TOKEN`` or ``--peer-token``), proved by
    HMAC-SHA256 over fresh nonces from both sides (the token never crosses the wire), and only
    when the connecting address is in the serving daemon's ``--peer-allow`` list.
    ``PeerGate`` decides at accept, before a byte is read, whether a connection may stay: its
    address is allowed, and neither its address nor the daemon holds as many peer connections as
    allowed (``--peer-max-connections-per-address``, ``--peer-max-connections``).

Trust model
    An authenticated peer receives the NIXL metadata of the serving pool: with it the transport can
    read (and, at the RDMA level, write) any byte of that registered pool, not only the entries it
    leased. Give the token only to daemons you trust with the cache's contents.

Threading
    Pure functions; safe anywhere. ``PeerGate`` is plain state for the event loop's thread.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from hkvd.daemon.secret_files import MIN_SECRET_BYTES, read_secret
from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.errors import Busy, KVError, PermissionDenied
from hkvd.transport.stat_fields import status_only
from hkvd.transport.wire.peer import PEER_VERSION

MIN_TOKEN_BYTES = MIN_SECRET_BYTES
TOKEN_ENV = "HKVD_PEER_TOKEN"
DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128")
_LABEL = f"hkvd-peer-{PEER_VERSION}".encode()
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class PeerConfigError(StartupError, ValueError):
    """A peer flag is wrong; the message names the fix."""

    exit_code = 2


def read_token(token: str, token_file: str) -> bytes:
    """The shared token from ``--peer-token-file`` (first), ``--peer-token``, or ``$HKVD_PEER_TOKEN``.

    Returns b"" when none is set. The token file follows ``hkvd.daemon.secret_files``: owned by the
    daemon's user, mode 0600 (like ssh keys), else refused with the fix.
    """
    if token_file:
        try:
            value = read_secret(token_file, "--peer-token-file")
        except ValueError as e:
            raise PeerConfigError(str(e)) from None
    else:
        value = (token or os.environ.get(TOKEN_ENV, "")).strip().encode()
    if value and len(value) < MIN_TOKEN_BYTES:
        raise PeerConfigError(f"the peer token has {len(value)} bytes; use at least {MIN_TOKEN_BYTES} random "
                              "bytes, e.g. `openssl rand -hex 32 > /etc/hkvd/peer.token`")
    return value


def parse_allow(entries: Iterable[str]) -> tuple[IPNetwork, ...]:
    """``--peer-allow`` entries (addresses or CIDRs) -> networks; empty -> loopback only."""
    nets = []
    for raw in entries:
        item = raw.strip()
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise PeerConfigError(f"--peer-allow {item!r}: not an IP address or CIDR (e.g. 10.0.0.0/24, "
                                  "192.168.1.7, fd00::/8)") from None
    return tuple(nets) or tuple(ipaddress.ip_network(a) for a in DEFAULT_ALLOW)


def allowed(address: str, nets: Iterable[IPNetwork]) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == n.version and ip in n for n in nets)


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _LABEL + b" server" + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _LABEL + b" client" + server_nonce + client_nonce, hashlib.sha256).digest()


def check_proof(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def split_address(address: str, what: str = "peer address") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port_s = address.strip().rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise PeerConfigError(f"{what} {address!r}: expected HOST:PORT, e.g. 10.0.0.5:7470 or [fd00::5]:7470")
    return host.strip("[]"), int(port_s)


class Refusal(NamedTuple):
    why: str  # the ``peer_refused`` metric's label: address, address_cap or total_cap
    error: KVError  # what the connection is told before it is closed


@dataclass(frozen=True, slots=True)
class GateStats:
    """The peer gate's admitted connections and its caps (``hkvd status``: ``peer.serving.connections``)."""

    connections: int = status_only()
    addresses: int = status_only()
    max_connections: int = status_only()
    max_per_address: int = status_only()


class PeerGate:
    """Which peer connections may stay open, decided when they are accepted.

    ``admit`` counts an admitted connection against its address and the total; every admitted
    connection must be ``release``d exactly once when it closes. Refusals hold nothing.
    """

    def __init__(self, allow: tuple[IPNetwork, ...], max_connections: int, max_per_address: int) -> None:
        self.allow = allow
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self._per_address: Counter[str] = Counter()
        self._total = 0

    def admit(self, address: str) -> Refusal | None:
        if not allowed(address, self.allow):
            return Refusal("address", PermissionDenied(
                f"{address} may not connect to this hkvd; add it to the serving daemon's --peer-allow"))
        if self._per_address[address] >= self.max_per_address:
            return Refusal("address_cap", Busy(
                f"{address} already holds {self.max_per_address} peer connections to this hkvd; close idle "
                "ones, or raise the serving daemon's --peer-max-connections-per-address"))
        if self._total >= self.max_connections:
            return Refusal("total_cap", Busy(
                f"this hkvd already serves {self.max_connections} peer connections; retry later, or raise "
                "its --peer-max-connections (and its open-file limit, LimitNOFILE)"))
        self._per_address[address] += 1
        self._total += 1
        return None

    def release(self, address: str) -> None:
        left = self._per_address[address] - 1
        if left < 0:
            raise AssertionError(f"peer connection from {address} released twice")
        if left:
            self._per_address[address] = left
        else:
            del self._per_address[address]
        self._total -= 1

    def statistics(self) -> GateStats:
        return GateStats(self._total, len(self._per_address), self.max_connections, self.max_per_address)
