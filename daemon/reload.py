"""SIGHUP's config reload: re-read ``--config`` and apply the keys that can change while serving.

``RELOADABLE`` names them: ``log_level``, ``lease_ttl_s`` (new leases only), the verification
bounds and the quarantine's trigger, and the cluster tier's fleet keys (both key files are read
again, even under unchanged names, and apply only once they pass their checks). Every other
changed key is logged as "needs a restart" and ignored. A config that fails to parse or validate
is logged and ignored. The applied keys go into the running ``ConfigCell`` in one swap.

Event loop only (a signal handler); the fleet key files are read on the loop, as at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from hkvd.daemon.config import ConfigCell, DaemonConfig
from hkvd.daemon.notify import Notifier
from hkvd.daemon.tiers.cluster import ClusterTier
from hkvd.daemon.tiers.cluster_value import ClusterKeyError, FleetKeys

log = logging.getLogger("hkvd")

CLUSTER_KEYS = ("cluster_key_file", "cluster_accept_key_file")  # reloadable, once the files pass their checks
RELOADABLE = ("log_level", "lease_ttl_s", "verify_tolerance", "verify_mamba_tolerance", "quarantine_after",
              "quarantine_window_s", *CLUSTER_KEYS)


def reload_config(config: ConfigCell, read: Callable[[], DaemonConfig] | None, *, cluster: ClusterTier | None,
                  notifier: Notifier, summary: Callable[[], str]) -> None:
    """Re-read the config with ``read`` and swap the reloadable changes into ``config``; tell systemd
    RELOADING=1, then READY=1 with ``summary()``. Never raises for a bad config."""
    if read is None:
        log.info("SIGHUP: started without --config; nothing to reload")
        return
    notifier.reloading("reloading configuration")
    try:
        new = read()
    except Exception as e:  # ConfigError, OSError: keep serving with the running config
        log.error("SIGHUP: config not reloaded, keeping the running one: %s", e)
        notifier.ready(f"config reload failed: {e}; {summary()}")
        return
    cfg = config.current
    names = [f.name for f in dataclasses.fields(DaemonConfig)]
    changed = {f: (getattr(cfg, f), getattr(new, f)) for f in names if getattr(cfg, f) != getattr(new, f)}
    # The key files are read again even under unchanged names; they apply only if they pass their checks.
    keys_ok = cluster is not None and reload_fleet_keys(cluster, new)
    applied = {f: v for f, v in changed.items() if f in RELOADABLE and (keys_ok or f not in CLUSTER_KEYS)}
    ignored = sorted(f for f in changed if f not in RELOADABLE)
    if applied:  # one swap: the service (and anything else holding the cell) reads the new values
        config.swap(cfg.replace(**{f: v[1] for f, v in applied.items()}))
        if "log_level" in applied:
            logging.getLogger().setLevel(config.current.log_level.upper())
            log.debug("SIGHUP: log level is now %s", config.current.log_level)
    log.info("SIGHUP: config reloaded; applied %s; needs a restart (ignored): %s",
             ", ".join(f"{f} {a!r} -> {b!r}" for f, (a, b) in applied.items()) or "nothing",
             ", ".join(ignored) or "nothing")
    notifier.ready(summary())


def reload_fleet_keys(cluster: ClusterTier, cfg: DaemonConfig) -> bool:
    """Read the fleet keys again (a key change, docs/cluster.md); keep the old ones on an error."""
    if not cfg.cluster_key_file and cluster.keys.public:
        return True  # --cluster-insecure, still without a key file: nothing to read
    if not cfg.cluster_key_file:
        log.error("SIGHUP: the reloaded config has no --cluster-key-file; keeping the running fleet keys "
                  "(running without one needs a restart with --cluster-insecure)")
        return False
    try:
        keys = FleetKeys.load(cfg.cluster_key_file, cfg.cluster_accept_key_file)
    except ClusterKeyError as e:
        log.error("SIGHUP: fleet keys not reloaded, keeping the running ones: %s", e)
        return False
    cluster.set_keys(keys)
    log_fleet_keys(keys)
    return True


def log_fleet_keys(keys: FleetKeys) -> None:
    """Log which fleet key seals values and which are accepted; warn when the key is public."""
    if keys.public:
        log.warning("cluster tier: --cluster-insecure: values are sealed with a public key, so any host that "
                    "reaches the Mooncake master can write values this node serves as KV; set "
                    "--cluster-key-file (docs/cluster.md)")
        return
    ids = [f"{i:08x}" for i in keys.ids()]
    log.info("cluster tier: sealing values with fleet key %s; accepting %s", ids[0], ", ".join(ids))
