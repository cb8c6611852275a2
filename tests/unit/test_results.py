"""Each request's reply becomes its own typed result; a reply that lacks a field is an error, not a 0."""

from __future__ import annotations

import pytest

from hkvd.shim.results import Completion, LookupResult, PullResult, RetrieveResult, StepResult, StoreResult
from hkvd.transport.errors import NotFound, ProtocolViolation


def test_done_infos_become_typed_results():
    assert StoreResult.from_done(10, {"stored": 2, "skipped": 1, "dropped": 0, "thinned": 3, "new": 1}) == \
        StoreResult(10, 2, 1, 0, 3)  # a key a newer daemon adds is ignored
    assert RetrieveResult.from_done(5, {"entries": 2}) == RetrieveResult(5, 2, b"")
    assert StepResult.from_done(0, {"outcome": "gap"}) == StepResult(0, "gap")
    assert PullResult.from_done(7, {"hit_chunks": 3, "lease_id": 9, "lease_ttl_s": 30, "pulled": 2, "local": 1,
                                    "seconds": 0.5}).lease_ttl_s == 30.0


@pytest.mark.parametrize(("cls", "info", "match"), [
    (StoreResult, {"stored": 1, "skipped": 0, "dropped": 0}, "lacks 'thinned'"),
    (RetrieveResult, {"entries": "2"}, "'entries' is str, not int"),
    (StepResult, {"outcome": "gap", "stored": True}, "'stored' is bool"),
    (PullResult, {}, "reply to a pull lacks 'hit_chunks'"),
])
def test_a_reply_missing_or_mistyping_a_field_is_a_protocol_violation(cls, info, match):
    with pytest.raises(ProtocolViolation, match=match):
        cls.from_done(0, info)


def test_completion_get_checks_the_kind_and_raises_the_error():
    ok = Completion(1, True, LookupResult(3, 4, 30.0), None)
    assert ok.get(LookupResult).hit_chunks == 3
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
    found = c.get(LookupResult)
    assert found.hit_chunks == len(keys) and found.lease_id != 0
    assert eng.retrieve(items, found.lease_id).get(RetrieveResult).entries == len(keys)
    eng.close()
