"""Each request's reply becomes its own typed result (the reply messages' own checks: test_replies.py)."""

from __future__ import annotations

import pytest

from hkvd.shim.results import Completion
from hkvd.transport.errors import NotFound
from hkvd.transport.wire.kv import LookupReply, RetrieveResult, StoreResult


def test_completion_get_checks_the_kind_and_raises_the_error():
    ok = Completion(1, True, LookupReply(1, 3, 4, 30.0), None)
    assert ok.get(LookupReply).hit_chunks == 3
    with pytest.raises(TypeError, match="not a StoreResult"):
        ok.get(StoreResult)
    with pytest.raises(NotFound):
        Completion(2, False, None, NotFound("gone")).get(StoreResult)


def test_the_client_types_each_reply_by_its_request(daemon):
    from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
    from hkvd.transport.keys import chunk_keys

    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 1, 4096)])
    keys = chunk_keys(prompt_tokens(64, seed=3), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    assert eng.store(items).get(StoreResult).stored == len(keys) >= 1
    c = eng.run(eng.client.submit_lookup(keys))
    found = c.get(LookupReply)
    assert found.hit_chunks == len(keys) and found.lease_id != 0
    assert eng.retrieve(items, found.lease_id).get(RetrieveResult).entries == len(keys)
    eng.close()
