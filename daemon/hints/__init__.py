"""KV hints (docs/hints.md): share, prefetch, demote, pin, retain, each answered with its outcome.

``effects``: what each action does to the cache, for a prefix already resolved to chunk keys (both paths).
``endpoint``: ``POST /v1/kv/hints`` on the metrics port (routers name a prefix by its token ids).
The engine path (a request's ``kv_transfer_params``) arrives as ``kv.Hints`` and is served by ``effects``
from ``hkvd.daemon.engines.service``.
"""
