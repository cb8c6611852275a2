"""What the daemon does for the engines registered with it.

``service`` dispatches each engine message (``KVService``) to the part that serves its family:
``lookup_replies``, ``stores``, ``retrieves``, ``step_events`` (Mamba boundary states) and
``verification`` (sampled hits), with ``copies`` moving the bytes and ``connection`` the connection's
state. ``registry`` holds the registered engines and their formats' fingerprints; ``client_process``
the engine process behind a connection; ``snapshots`` when a copied Mamba state may become visible;
``validation`` the registration checks for hybrid engines; ``host_engine`` and ``engine_factory`` the
copy engines; ``engine_traffic``, ``latency`` and ``service_stats`` what ``KVService.statistics()`` reports.
"""
