# SPDX-License-Identifier: Apache-2.0
"""A tiny prefill/decode router for two vLLM OpenAI servers that use hkvd's connector.

    # prefill node: its daemon serves peers, its engine is a kv_producer
    hkvd serve --chunk-size N --peer-listen 10.0.0.5:7470 --peer-token-file /etc/hkvd/peer.token \\
        --peer-allow 10.0.0.6
    vllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "HkvdConnector",
        "kv_connector_module_path": "hkvd.shim.connector", "kv_role": "kv_producer"}'
    # decode node: its daemon pulls (same token), its engine is a kv_consumer
    hkvd serve --chunk-size N --peer-token-file /etc/hkvd/peer.token
    vllm serve MODEL --port 8200 --kv-transfer-config '{..., "kv_role": "kv_consumer"}'
    # anywhere
    python examples/pd_proxy.py --prefill http://10.0.0.5:8100 --decode http://10.0.0.6:8200 --port 8000

For each ``POST /v1/completions`` or ``/v1/chat/completions`` the proxy:
1. sends the request to the prefill server with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params={"do_remote_decode": true}``; the prefill engine computes the prompt, its
   daemon keeps the KV, and the response carries ``kv_transfer_params`` (daemon address, chunks, key);
2. sends the original request to the decode server with those ``kv_transfer_params``; the decode
   engine's daemon pulls the KV from the prefill daemon (NIXL READ), the engine loads it and
   generates; the proxy relays that response (streamed when the client asked for a stream).
If the prefill step fails, the decode server computes the prompt itself (the answer is the same,
only slower); a failed pull on the decode side is recomputed there too.

Needs aiohttp (installed with vLLM). Each upstream call has a timeout (``--timeout-s``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

log = logging.getLogger("pd_proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill step of ``body``: one token, no stream, and ask for kv_transfer_params."""
    out = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("n", None)
    return out


def decode_request(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(body)
    if params:
        out["kv_transfer_params"] = params
    return out


def make_app(prefill: str, decode: str, timeout_s: float = 600.0) -> Any:
    try:
        from aiohttp import ClientSession, ClientTimeout, web
    except ImportError:
        raise SystemExit("pd_proxy needs aiohttp (pip install aiohttp; vLLM installs it)") from None

    timeout = ClientTimeout(total=timeout_s)
    session_key = web.AppKey("session", ClientSession)

    async def on_startup(app: Any) -> None:
        app[session_key] = ClientSession(timeout=timeout)

    async def on_cleanup(app: Any) -> None:
        await app[session_key].close()

    async def route(request: Any) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON"}, status=400)
        session = request.app[session_key]
        params = None
        try:
            async with session.post(prefill + request.path, json=prefill_request(body)) as r:
                if r.status == 200:
                    params = (await r.json()).get("kv_transfer_params")
                else:
                    log.warning("prefill %s answered %d: %s; the decode server computes the prompt", prefill,
                                r.status, (await r.text())[:300])
        except Exception as e:  # the decode server can still answer on its own
            log.warning("prefill %s failed (%s); the decode server computes the prompt", prefill, e)
        async with session.post(decode + request.path, json=decode_request(body, params)) as r:
            if not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type or "application/json")
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: Any) -> Any:
        return web.json_response({"prefill": prefill, "decode": decode})

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for path in ROUTES:
        app.router.add_post(path, route)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill vLLM server")
    ap.add_argument("--decode", required=True, help="base URL of the decode vLLM server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per upstream request")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from aiohttp import web

    web.run_app(make_app(a.prefill.rstrip("/"), a.decode.rstrip("/"), a.timeout_s), host=a.host, port=a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
