# SPDX-License-Identifier: Apache-2.0
"""Sampled verification, the engine's side: which hits are recomputed, and what their checks found.

Role
    ``sampled`` decides whether a request with an hkvd hit is computed by the engine instead of
    loaded (``ShimConfig.verify_fraction``). The scheduler side then reports no external tokens for
    it and sends the chunks it computes as ``Verify`` items (attention and sliding-window blocks)
    and ``StepEvent.verifies`` (Mamba boundary states) where it would have stored them; the daemon
    compares them with its entries (docs/verification.md). ``VerifyTally`` sums the daemon's
    ``VerifyResult`` replies on the worker side for vLLM's connector stats.

Contracts
    - ``sampled`` is a pure function of (seed, request id, fraction): the same request id is sampled
      in every process and every call, so a test can name the requests it expects to be checked.
      Fraction 0 samples none, 1 every request.
    - A check that fails (the daemon is down, or answers an error such as a daemon without
      verification) is counted and logged, never reported to vLLM: the request's answer never
      depends on the entries under test, so a failed check only means nothing was learnt.
    - Boundary states sent in a step event are compared by the daemon once confirmed; their outcome
      reaches the daemon's own counters, not these (the step event's reply carries none).

Threading
    ``sampled``: any thread. ``VerifyTally``: the worker's execute thread, like the worker side.
"""

from __future__ import annotations

import hashlib
import logging

from hkvd.transport.wire.kv import VerifyResult

logger = logging.getLogger("hkvd.shim")

_SCALE = float(1 << 64)


def sampled(req_id: str, fraction: float, seed: int = 0) -> bool:
    """Whether the request ``req_id`` is recomputed and checked instead of loaded."""
    if fraction <= 0.0:
        return False
    if fraction >= 1.0:
        return True
    h = hashlib.blake2b(f"{seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / _SCALE < fraction


class VerifyTally:
    """The worker's running totals of its checks (``hkvd.shim.connector_stats``: ``verify_*``)."""

    def __init__(self) -> None:
        # verifies: Verify requests answered; failed: answered with an error (nothing compared);
        # checks/matches/divergences/missing: entries, as the daemon counted them; max_error: the largest seen.
        self.totals: dict[str, float] = {"verifies": 0, "verifies_failed": 0, "verify_checks": 0,
                                         "verify_matches": 0, "verify_divergences": 0, "verify_missing": 0,
                                         "verify_max_error": 0.0, "verify_max_error_full": 0.0,
                                         "verify_max_error_swa": 0.0}
        self._failure_logged = False

    def result(self, req_id: str, r: VerifyResult, kind: str = "") -> None:
        """The daemon's reply to one Verify, whose items are all of group kind ``kind`` (full | swa)."""
        t = self.totals
        t["verifies"] += 1
        t["verify_checks"] += r.checked
        t["verify_matches"] += r.checked - r.diverged
        t["verify_divergences"] += r.diverged
        t["verify_missing"] += r.missing
        t["verify_max_error"] = max(t["verify_max_error"], float(r.max_error))
        if f"verify_max_error_{kind}" in t:
            t[f"verify_max_error_{kind}"] = max(t[f"verify_max_error_{kind}"], float(r.max_error))
        if r.diverged:
            logger.warning("hkvd: sampled check of %s: %d of %d entries diverged (max error %g)%s", req_id,
                           r.diverged, r.checked, r.max_error, "; the daemon quarantined them" if r.quarantined
                           else "")

    def failed(self, req_id: str, error: object) -> None:
        """A check that got no result: counted, logged once at WARNING (then DEBUG); the request is unaffected."""
        self.totals["verifies_failed"] += 1
        log = logger.debug if self._failure_logged else logger.warning
        self._failure_logged = True
        log("hkvd: sampled check of %s got no result (%s); the request was computed, not loaded, and is "
            "unaffected", req_id, error)
