# SPDX-License-Identifier: Apache-2.0
"""A tiny cache-aware router: each completion goes to the node whose hkvd can serve the longer prefix.

    # each node: vLLM with hkvd's connector, and hkvd's metrics port where the router reaches it
    hkvd serve --metrics-port 9464 --metrics-host 10.0.0.5 ...
    vllm serve /models/qwen3-next --port 8000 --kv-transfer-config '{"kv_connector": "HkvdConnector",
        "kv_connector_module_path": "hkvd.shim.connector", "kv_role": "kv_both"}'
    # anywhere
    python examples/prefix_router.py --node http://10.0.0.5:8000,http://10.0.0.5:9464 \\
        --node http://10.0.0.6:8000,http://10.0.0.6:9464 --port 8080

For each ``POST /v1/completions`` the router needs the prompt's token ids: a ``prompt`` that is a list of
token ids is used as is; a string is tokenized by the first node's vLLM (``POST /tokenize``). It asks
every node's hkvd ``POST /v1/usable_prefix`` at once (the model as its engines registered it: the
request's ``model``, or ``--hkvd-model``; the request's ``cache_salt`` too), and forwards the request
unchanged to the node with the most ``usable_tokens``: the hybrid hit a fresh engine there would load
(full attention, sliding window and Mamba state at the same boundary). A tie (a new prompt, or both
hold it) goes to the node with fewer requests in flight here. A node whose hkvd does not answer within
``--lookup-timeout-s`` (or does not know the model: 404) counts as 0. hkvd answers lengths only.

``pick()`` is the choice alone, for a router of your own. Needs aiohttp (installed with vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("prefix_router")


@dataclass
class Node:
    """One node: its vLLM server and its hkvd metrics port (base URLs), and requests in flight."""

    vllm: str
    hkvd: str
    inflight: int = 0


async def usable_tokens(session: Any, node: Node, model: str, token_ids: list[int], cache_salt: str | None,
                        timeout_s: float) -> int:
    """``usable_tokens`` of ``node``'s hkvd for the prompt; 0 when it does not answer or know the model."""
    import aiohttp

    body: dict[str, Any] = {"model": model, "token_ids": token_ids}
    if cache_salt:
        body["cache_salt"] = cache_salt
    try:
        async with session.post(node.hkvd + "/v1/usable_prefix", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                log.debug("%s answered %d: %s", node.hkvd, r.status, (await r.text())[:200])
                return 0
            return int((await r.json())["usable_tokens"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
        log.debug("%s: no answer (%s)", node.hkvd, e)
        return 0


async def pick(session: Any, nodes: list[Node], model: str, token_ids: list[int], cache_salt: str | None = None,
               timeout_s: float = 0.05) -> tuple[Node, list[int]]:
    """The node with the longest usable prefix (fewest requests in flight among equals), and every answer."""
    answers = await asyncio.gather(*[usable_tokens(session, n, model, token_ids, cache_salt, timeout_s)
                                     for n in nodes])
    best = max(range(len(nodes)), key=lambda i: (answers[i], -nodes[i].inflight, -i))
    return nodes[best], list(answers)


def make_app(nodes: list[Node], hkvd_model: str | None = None, lookup_timeout_s: float = 0.05,
             timeout_s: float = 600.0) -> Any:
    try:
        from aiohttp import ClientSession, ClientTimeout, web
    except ImportError:
        raise SystemExit("prefix_router needs aiohttp (pip install aiohttp; vLLM installs it)") from None

    session_key = web.AppKey("session", ClientSession)

    async def on_startup(app: Any) -> None:
        app[session_key] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def on_cleanup(app: Any) -> None:
        await app[session_key].close()

    async def tokens_of(session: Any, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            return None  # a batch of prompts, or none: no preference
        async with session.post(nodes[0].vllm + "/tokenize", json={"model": body.get("model"), "prompt": prompt}) as r:
            return list((await r.json())["tokens"]) if r.status == 200 else None

    async def completions(request: Any) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON"}, status=400)
        session = request.app[session_key]
        node, answers = nodes[min(range(len(nodes)), key=lambda i: nodes[i].inflight)], []
        tokens = await tokens_of(session, body)
        if tokens:
            node, answers = await pick(session, nodes, hkvd_model or str(body.get("model", "")), tokens,
                                       body.get("cache_salt"), lookup_timeout_s)
        log.info("to %s (usable prefixes %s)", node.vllm, answers)
        node.inflight += 1
        try:
            async with session.post(node.vllm + request.path, json=body) as r:
                if not body.get("stream"):
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type=r.content_type or "application/json",
                                        headers={"X-Routed-To": node.vllm})
                out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream",
                                                                   "X-Routed-To": node.vllm})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        finally:
            node.inflight -= 1

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", action="append", required=True, metavar="VLLM_URL,HKVD_URL",
                    help="a node: its vLLM server's and its hkvd metrics port's base URLs (repeat per node)")
    ap.add_argument("--hkvd-model", default=None,
                    help="the model name the engines registered with hkvd (default: the request's model)")
    ap.add_argument("--lookup-timeout-s", type=float, default=0.05, help="per usable-prefix lookup")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per forwarded request")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    a = ap.parse_args(argv)
    nodes = []
    for spec in a.node:
        vllm, sep, hkvd = spec.partition(",")
        if not sep:
            ap.error(f"--node {spec}: give VLLM_URL,HKVD_URL")
        nodes.append(Node(vllm.rstrip("/"), hkvd.rstrip("/")))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from aiohttp import web

    web.run_app(make_app(nodes, a.hkvd_model, a.lookup_timeout_s, a.timeout_s), host=a.host, port=a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
