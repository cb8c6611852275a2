"""Empty a vLLM engine's own prefix cache for real, so that later hits can only come from hkvd.

``LLM.reset_prefix_cache()`` returns False, and leaves every cached block in place, while a finished
request still holds blocks. The connector delays the free of a request whose stores are in flight
until a later step reports them done, and an idle engine takes no step: right after ``generate``
returns, the reset usually fails. ``reset_prefix_cache(llm)`` drives steps with a three-token request
(shorter than any chunk, so nothing of it is stored or looked up) until the reset succeeds, and
raises if it has not within ``timeout_s``.
"""

from __future__ import annotations

import time
from typing import Any

# Token ids 0..3 are the tiny test models' special tokens; any three ordinary ids do.
_STEP_PROMPT = [5, 6, 7]


def reset_prefix_cache(llm: Any, timeout_s: float = 60.0) -> None:
    """Reset ``llm``'s prefix cache (a ``vllm.LLM``); raise ``RuntimeError`` after ``timeout_s``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's prefix cache could not be reset within {timeout_s:.0f} s: finished "
                               "requests still hold blocks (stores the daemon never finished?)")
        llm.generate([TokensPrompt(prompt_token_ids=_STEP_PROMPT)], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.01)
