"""Prefill/decode pieces that need neither vLLM nor NIXL: the kv_transfer_params contract, the
worker's pull-then-load state machine (against a scripted daemon client: the real boundary), and
the example proxy's request rewriting against two fake upstream servers."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hkvd.shim import pd
from hkvd.shim.jobs import PullSpec
from hkvd.shim.loads import Loads
from hkvd.shim.results import Completion
from hkvd.shim.testing.fake_daemon import FakeDaemon
from hkvd.transport.errors import Aborted, DaemonUnavailable
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import RetrieveResult
from hkvd.transport.wire.peer import PullResult

KEYS = chunk_keys(list(range(1000)), 128)  # 7 full chunks


def test_params_round_trip_and_checks() -> None:
    params = pd.producer_params("10.0.0.5:7470", KEYS, 4, 128, 17)
    assert json.loads(json.dumps(params)) == params  # travels through the OpenAI API as JSON
    n, spec = pd.consumer_plan(params, KEYS, 7, 128)  # type: ignore[misc]
    assert (n, spec.peer, spec.keys, spec.release_lease) == (4, "10.0.0.5:7470", KEYS[:4], 17)
    # capped by what this request may load (at least its last token is computed)
    assert pd.consumer_plan(params, KEYS, 3, 128)[0] == 3  # type: ignore[index]
    other = chunk_keys(list(range(1, 1001)), 128)
    assert pd.consumer_plan(params, other, 7, 128) is None  # another prompt: the last key differs
    assert pd.consumer_plan(params, KEYS, 7, 256) is None  # another chunk size
    assert pd.consumer_plan({**params, "hkvd_chunks": "x"}, KEYS, 7, 128) is None
    assert pd.consumer_plan({**params, "hkvd_chunks": 99}, KEYS, 7, 128) is None
    assert pd.consumer_plan({"do_remote_decode": True}, KEYS, 7, 128) is None
    assert pd.consumer_plan(None, KEYS, 7, 128) is None
    assert pd.wants_params("kv_producer", None) and not pd.wants_params("kv_consumer", {"do_remote_decode": True})
    assert pd.wants_params("kv_both", {"do_remote_decode": True}) and not pd.wants_params("kv_both", {})


def _producer(client: FakeDaemon, peer_address: str = "") -> pd.ProducerSide:
    link = SimpleNamespace(client=client, cfg=SimpleNamespace(socket_path="/run/hkvd.sock"), lost=lambda e: None)
    return pd.ProducerSide(link, "kv_producer", peer_address, lambda: client)  # type: ignore[arg-type]


def test_a_producer_hands_out_its_daemons_peer_address_and_a_hold_lease_on_the_prefix() -> None:
    client = FakeDaemon(hit=len(KEYS), lease_id=33, advertise="10.0.0.5:7470")
    side = _producer(client)
    assert side.params(KEYS, 0, 128) is None and client.statuses == 0  # nothing to hand: nothing asked
    assert side.params(KEYS, 3, 128) == pd.producer_params("10.0.0.5:7470", KEYS, 3, 128, 33)
    # The lease holds the three chunks until the decode side pulls.
    assert [s[2] for s in client.kinds("lookup")] == [KEYS[:3]]
    side.params(KEYS, 3, 128)
    assert client.statuses == 1  # the address is kept
    assert _producer(client, "192.0.2.1:7000").params(KEYS, 2, 128)[pd.PEER] == "192.0.2.1:7000"  # type: ignore[index]


def test_a_producer_whose_daemon_serves_no_peers_hands_out_nothing_and_asks_again_later(
        caplog: pytest.LogCaptureFixture) -> None:
    client = FakeDaemon(hit=len(KEYS), lease_id=33)
    side = _producer(client)
    assert side.params(KEYS, 3, 128) is None and side.params(KEYS, 3, 128) is None
    assert client.statuses == 1 and client.kinds("lookup") == []  # asked at most every PEER_ASK_INTERVAL_S
    assert "--peer-listen" in caplog.text


def _job(req: str = "r1", n: int = 4) -> SimpleNamespace:
    return SimpleNamespace(req_id=req, items=[[0, 0, KEYS[0], [1]]], block_ids=[1],
                           pull=PullSpec("p:1", KEYS[:n], 9))


class Worker:
    """The worker's two halves of a pd load, fed completions in the worker's order (pulls first)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.client = FakeDaemon(first_id=101)
        self.loads = Loads(60.0)
        self.pulls = pd.PullLoads(timeout_s, self.loads)

    def feed(self, c: Completion) -> bool:
        return self.pulls.absorb(c, self.client) or self.loads.absorb(c)

    @property
    def in_flight(self) -> int:
        return self.pulls.in_flight + self.loads.in_flight


def test_pull_then_load_then_done() -> None:
    w = Worker()
    c = w.client
    w.pulls.start(c, _job())
    assert [s[1:] for s in c.sent] == [("pull", "p:1", 4, 4, 9)]
    assert w.feed(Completion(101, True, PullResult(101, 0, 4, 55, 30.0, 4, 0, 0.1), None))
    assert (c.sent[-1][1], c.sent[-1][3]) == ("retrieve", 55)  # the load uses the pull's local lease
    assert w.loads.take() == (set(), set())  # pulled, not loaded yet: nothing to report
    assert not w.feed(Completion(7, True, RetrieveResult(7, 0, 0), None))  # not ours
    assert w.feed(Completion(102, True, RetrieveResult(102, 10, 4), None))
    assert w.loads.take() == ({"r1"}, set()) and w.in_flight == 0


@pytest.mark.parametrize("completion", [
    Completion(101, False, None, DaemonUnavailable("peer down")),
    Completion(101, True, PullResult(101, 0, 3, 55, 30.0, 3, 0, 0.0), None),  # partial: never loaded
])
def test_failed_or_partial_pull_fails_the_load(completion: Completion) -> None:
    w = Worker()
    w.pulls.start(w.client, _job())
    assert w.feed(completion)
    assert w.loads.take() == ({"r1"}, {"r1"})  # failed: in both sets, as vLLM wants it
    assert [s[1] for s in w.client.sent] == ["pull"]  # no load after it
    assert w.client.released == ([55] if completion.ok else [])


def test_a_load_past_the_pull_deadline_ends_only_with_the_daemons_reply() -> None:
    w = Worker()
    c = w.client
    w.pulls.start(c, _job())
    for p in w.pulls._pulls.values():
        p.deadline = time.monotonic() + 60.0
    w.feed(Completion(101, True, PullResult(101, 0, 4, 55, 30.0, 4, 0, 0.0), None))
    for p in w.loads._flying.values():
        assert p.budget == "pull_timeout_s"  # the load inherits what is left of the pull's budget
        p.deadline = time.monotonic() - 0.1  # forged: past the deadline
    w.pulls.expire(c)
    w.loads.expire(c)
    w.loads.expire(c)
    # Aborted once, but not reported: the daemon may still be writing into the request's blocks.
    assert c.aborted == [102] and w.loads.take() == (set(), set()) and w.in_flight == 1
    assert w.feed(Completion(102, False, None, Aborted("job 102 was aborted")))
    assert w.loads.take() == ({"r1"}, {"r1"}) and w.in_flight == 0


def test_timeout_fails_and_a_late_reply_gives_its_lease_back() -> None:
    w = Worker(timeout_s=0.0)
    c = w.client
    w.pulls.start(c, _job())
    w.pulls.expire(c)
    assert w.loads.take() == ({"r1"}, {"r1"}) and c.aborted == [101] and w.in_flight == 0
    assert w.feed(Completion(101, True, PullResult(101, 0, 4, 77, 30.0, 4, 0, 0.0), None))
    assert c.released == [77] and [s[1] for s in c.sent] == ["pull"]


def test_lost_connection_fails_everything_in_flight() -> None:
    w = Worker()
    w.pulls.start(w.client, _job("a"))
    w.pulls.start(w.client, _job("b"))
    w.feed(Completion(101, True, PullResult(101, 0, 4, 5, 30.0, 4, 0, 0.0), None))
    w.pulls.forget("gone")
    w.loads.forget("gone")
    assert w.loads.take() == ({"a", "b"}, {"a", "b"}) and w.in_flight == 0


# ---- the example proxy -------------------------------------------------------------------------
def _proxy() -> Any:
    path = Path(__file__).resolve().parents[2] / "examples" / "pd_proxy.py"
    spec = importlib.util.spec_from_file_location("hkvd_pd_proxy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_proxy_prefills_then_decodes_with_the_params() -> None:
    web = pytest.importorskip("aiohttp.web")
    import aiohttp

    seen: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    params = {"do_remote_prefill": True, "hkvd_peer": "10.0.0.5:7470", "hkvd_chunks": 4}

    async def prefill(request: Any) -> Any:
        seen["prefill"].append(await request.json())
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    async def decode(request: Any) -> Any:
        body = await request.json()
        seen["decode"].append(body)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for part in (b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"):
                await resp.write(part)
            await resp.write_eof()
            return resp
        return web.json_response({"choices": [{"text": "decoded"}]})

    runners = []

    async def serve(app: Any) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    up_p, up_d = web.Application(), web.Application()
    up_p.router.add_post("/v1/completions", prefill)
    up_d.router.add_post("/v1/completions", decode)
    proxy = await serve(_proxy().make_app(await serve(up_p), await serve(up_d), 30.0))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy + "/v1/completions", json={"prompt": "hi", "max_tokens": 16}) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["text"] == "decoded"
            async with s.post(proxy + "/v1/completions", json={"prompt": "hi", "max_tokens": 16, "stream": True}) as r:
                assert await r.read() == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
    finally:
        for runner in runners:
            await runner.cleanup()
    assert seen["prefill"][0] == {"prompt": "hi", "max_tokens": 1, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert seen["decode"][0] == {"prompt": "hi", "max_tokens": 16, "kv_transfer_params": params}
    assert seen["decode"][1]["stream"] is True and seen["decode"][1]["kv_transfer_params"] == params
