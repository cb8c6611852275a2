"""What the daemon does for the engines registered with it.

``service`` is what each engine message means (``KVService``); ``registry`` the registered engines
and their formats' fingerprints; ``client_process`` the engine process behind a connection;
``snapshots`` when a copied Mamba state may become visible; ``validation`` the registration checks
for hybrid engines; ``host_engine`` and ``engine_factory`` the copy engines; ``engine_traffic``,
``latency`` and ``service_stats`` what ``KVService.statistics()`` reports.
"""
