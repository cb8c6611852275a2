"""Peer links: daemons serving each other's cached entries.

``links`` starts and stops the link (``PeerService``), ``serving`` answers other daemons,
``pulling`` fetches from them, ``auth`` holds the token and handshake proofs, and ``layout_book``
the engine layouts that peers are asked about.
"""
