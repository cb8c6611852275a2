"""The cache: the one place that decides what counts as a hit and what gets leased.

``index`` keeps entry keys -> pool pages with their states and pins; ``leases`` the lookup leases;
``hybrid`` the hybrid hit rule; ``chains`` which entries can serve no hit any more; ``eviction``
the eviction policies; ``pool`` (with ``backing`` and ``prefault``) the huge-page pool and its
accounting.
"""
