"""The tiers below the pool.

``contract`` is what a tier offers the service (``Tier``), ``promotion`` the read-through path that
lookups share, ``write_queue`` a tier's write-behind queue; ``disk`` and ``cluster`` are the two
tiers (``disk_format`` is the disk tier's file format, ``disk_scan`` its start-up scan; ``cluster_value``
is the cluster tier's value format).
"""
