# SPDX-License-Identifier: Apache-2.0
"""Which tenant a request's stored chunks count against: its cache_salt, else its LoRA adapter.

Role
    The daemon keeps a quota per tenant (docs/pins.md); the scheduler side labels each request once
    (``tenant``) and every ``kv.Store`` the worker sends for it, and every ``kv.Pin``, carries the label.

The rule
    - A request with a ``cache_salt``: ``"salt:"`` and the first 16 hex digits of the salt's digest,
      ``hashlib.blake2b(salt.encode(), digest_size=8).hexdigest()``. The salt itself never leaves the
      engine (it is a secret of its tenant: whoever knows it shares that tenant's cache).
    - Else a request with a LoRA adapter: ``"lora:"`` and the adapter's name. A name that is not
      printable ASCII without spaces becomes ``"lora:#"`` and the name's digest (16 hex digits); one too
      long for a label (``control.MAX_TENANT``, 64 characters) keeps its first characters, then ``"~"``
      and the digest, so two long names never share a label.
    - Else ``""``: the unsalted share, every request without either.

Threading
    Pure functions; no state.
"""

from __future__ import annotations

import hashlib

from hkvd.transport.wire.control import MAX_TENANT

SALT = "salt:"
LORA = "lora:"


def digest(text: str) -> str:
    """16 hex digits of ``text``'s BLAKE2b digest."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _printable(text: str) -> bool:
    return bool(text) and all("!" <= c <= "~" for c in text)


def lora_label(name: str) -> str:
    """The tenant label of LoRA adapter ``name`` (see the module's rule)."""
    if not _printable(name):
        return f"{LORA}#{digest(name)}"
    label = LORA + name
    if len(label) <= MAX_TENANT:
        return label
    tail = "~" + digest(name)
    return label[:MAX_TENANT - len(tail)] + tail


def tenant(request: object) -> str:
    """The tenant label of a vLLM ``Request`` (or anything with ``cache_salt`` and ``lora_request``)."""
    salt = getattr(request, "cache_salt", None)
    if salt:
        return SALT + digest(str(salt))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        return lora_label(str(getattr(lora, "lora_name", "") or ""))
    return ""
