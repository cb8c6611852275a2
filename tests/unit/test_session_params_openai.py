"""The OpenAI server's path for session pins (docs/agents.md): a chat completion body with ``kv_transfer_params``
(an ``"hkvd"`` pin beside a prefill/decode key) and ``cache_salt`` becomes, through vLLM's own request models,
a ``Request`` whose ``kv_transfer_params`` still hold both, and whose tenant is the salt's digest label."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: make vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.v1.request import Request

from hkvd.shim import pd
from hkvd.shim.sessions import PinAsk, parse
from hkvd.shim.tenants import digest, tenant

pytestmark = pytest.mark.vllm

BODY = """{
  "model": "Qwen/Qwen3-8B",
  "messages": [{"role": "user", "content": "Plan the migration of the billing database."}],
  "max_tokens": 512,
  "cache_salt": "acme-prod-2f9c1e",
  "kv_transfer_params": {"hkvd": {"pin_s": 600, "session": "conv-7f3a9c"}, "do_remote_decode": true}
}"""


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_openai_servers_request_keeps_the_pin_beside_prefill_decode_keys(kind: str) -> None:
    body = json.loads(BODY)
    if kind == "chat":
        api = ChatCompletionRequest(**body)
    else:
        del body["messages"]
        api = CompletionRequest(**body, prompt="Plan the migration of the billing database.")
    sp = api.to_sampling_params(512, {})
    req = Request("r1", list(range(40)), sp, None, cache_salt=api.cache_salt)

    assert parse(req.kv_transfer_params) == (PinAsk("conv-7f3a9c", 600.0), "")
    assert pd.wants_params("kv_both", req.kv_transfer_params)  # the proxy's key is still there
    assert tenant(req) == "salt:" + digest("acme-prod-2f9c1e")
