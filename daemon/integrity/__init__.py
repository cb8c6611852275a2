"""Integrity: every entry is checked, against damage and against being wrong.

``checksums`` and ``scrub`` guard the bytes: each entry's checksum is taken when its bytes land in
the pool, re-checked at a bounded rate while it sits there and on every move between tiers.
``compare`` and ``quarantine`` guard the meaning: a sampled hit is recomputed by the engine and
compared with the entry it would have loaded; an engine layout (fingerprint) and group whose entries
diverge stop being served until an operator lifts the quarantine.
"""
