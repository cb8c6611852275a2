"""examples/prefix_router.py against two real daemons: each holds other prefixes of a hybrid model (full
attention and Mamba states), and the router sends each prompt to the node whose hkvd can serve the
longer usable prefix, which is not always the node that holds more full-attention chunks."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

C = 16
SHAPES = [GroupShape("full", 2, 4096), GroupShape("mamba", 2, 4096)]
MODEL = "/models/tiny-gdn"


def _router() -> Any:
    path = Path(__file__).resolve().parents[2] / "examples" / "prefix_router.py"
    spec = importlib.util.spec_from_file_location("hkvd_prefix_router", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(socket_path: str, tokens: list[int], full: range, mamba: list[int]) -> None:
    eng = SyntheticEngine(socket_path, SHAPES, num_blocks=32, tokens_per_block=C, chunk_size=C, model=MODEL)
    try:
        keys = chunk_keys(tokens, C)
        eng.store([Item(0, i, keys[i], [1 + i]) for i in full])
        req = eng.client.submit_step_event(0, 0, [Item(1, i, keys[i], [1 + i]) for i in mamba])
        eng.run(req)
        eng.run(eng.client.submit_step_event(1, 1, [], [req]))
    finally:
        eng.close()


async def test_router_sends_each_prompt_to_the_node_with_the_longer_usable_prefix(daemon_factory) -> None:
    web = pytest.importorskip("aiohttp.web")
    import aiohttp

    mod = _router()
    ports = {"a": _port(), "b": _port()}
    daemons = {name: daemon_factory("--chunk-size", str(C), "--l1-size-gb", "0.0625", "--metrics-port", str(port),
                                    name=name) for name, port in ports.items()}
    p_a, p_b, p_both = (prompt_tokens(10 * C + 3, seed=s) for s in (1, 2, 3))
    _store(daemons["a"].socket_path, p_a, range(8), [7])  # a: 128 tokens of p_a
    _store(daemons["b"].socket_path, p_b, range(6), [5])  # b: 96 tokens of p_b
    # p_both: a holds 8 full-attention chunks but a Mamba state only after chunk 1 (a usable 32 tokens);
    # b holds 4 chunks with the state after chunk 3 (64 tokens): b serves more.
    _store(daemons["a"].socket_path, p_both, range(8), [1])
    _store(daemons["b"].socket_path, p_both, range(4), [3])

    seen: list[tuple[str, dict[str, Any]]] = []
    runners = []

    async def serve(app: Any) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def fake_vllm(name: str) -> Any:
        async def completions(request: Any) -> Any:
            body = await request.json()
            seen.append((name, body))
            return web.json_response({"node": name})

        async def tokenize(request: Any) -> Any:
            body = await request.json()
            return web.json_response({"tokens": [int(t) for t in body["prompt"].split()]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/tokenize", tokenize)
        return app

    nodes = [mod.Node(await serve(fake_vllm(n)), f"http://127.0.0.1:{ports[n]}") for n in ("a", "b")]
    router = await serve(mod.make_app(nodes, lookup_timeout_s=5.0, timeout_s=30.0))
    try:
        async with aiohttp.ClientSession() as s:
            node, answers = await mod.pick(s, nodes, MODEL, p_both, timeout_s=5.0)
            assert answers == [32, 64] and node is nodes[1]

            async def route(prompt: Any, **extra: Any) -> str:
                async with s.post(router + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                     "max_tokens": 4, **extra}) as r:
                    assert r.status == 200
                    return str((await r.json())["node"])

            assert await route(p_a) == "a"
            assert await route(p_b) == "b"
            assert await route(p_both) == "b"
            assert await route(" ".join(map(str, p_a))) == "a"  # a text prompt, tokenized by the first node
            assert await route(p_a, cache_salt="other-tenant") == "a"  # nobody holds it salted: a tie, the first
            assert await route(p_b, cache_salt="other-tenant") == "a"
            assert [body["prompt"] for _, body in seen][:3] == [p_a, p_b, p_both]  # forwarded unchanged
            # A node that does not know the model, or does not answer, counts as 0.
            node, answers = await mod.pick(s, nodes, "/models/other", p_b, timeout_s=5.0)
            assert answers == [0, 0] and node is nodes[0]
            daemons["b"].stop()
            node, answers = await mod.pick(s, nodes, MODEL, p_b, timeout_s=1.0)
            assert answers == [0, 0] and node is nodes[0]
    finally:
        for r in runners:
            await r.cleanup()
