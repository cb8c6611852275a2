# SPDX-License-Identifier: Apache-2.0
"""Whether a request's decode chunks are stored: the engine's ``store_decode``, the chat template, the request.

Role
    A decode chunk is one that fills while the engine generates (it holds output tokens). It can only ever hit
    when a later prompt repeats those tokens, as a chat's next turn repeats the answer. A reasoning model's
    chat template usually drops the thinking part of an earlier answer (``<think>...</think>``) from the next
    turn's prompt: the thinking, most of what such a model writes, can then never hit.

    ``DecodeStores`` decides once, when the engine starts, from the shim's ``store_decode`` setting:
    ``true`` stores decode chunks, ``false`` does not (reason ``config``), and ``"auto"`` renders the model's
    chat template (``template_drops_thinking``) for a conversation whose earlier answer holds
    ``<think>MARKER</think>answer``: when MARKER is not in the rendered prompt, decode chunks are not stored
    (reason ``template``). A model without a chat template, or one whose render fails, stores them. The
    decision is logged once.

    A request may decide for itself: ``kv_transfer_params={"hkvd": {"store_decode": false}}`` (reason
    ``request``) or ``true``. ``parse`` reads it beside the session pin's fields (``hkvd.shim.sessions``); a
    value that is not a bool is one warning and the engine's decision applies.

    Decode chunks not stored are counted by reason, in chunks and in the bytes their entries would have held
    (every group and rank): the scheduler side's ``decode_chunks_not_stored_<reason>`` and
    ``decode_bytes_not_stored_<reason>``, on vLLM's metrics as ``vllm:hkvd_decode_chunks_not_stored_total`` and
    ``vllm:hkvd_decode_bytes_not_stored_total`` with a ``reason`` label (``hkvd.shim.connector_stats``).

Contracts
    - ``parse`` and ``template_drops_thinking`` never raise.
    - Only chunks past the prompt's whole chunks are affected: a prompt's chunks are always stored.

Threading
    vLLM's scheduler thread only (the engine's decision is made in the scheduler side's constructor).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hkvd.shim.sessions import KEY

if TYPE_CHECKING:  # vLLM's type, for annotations only
    from vllm.config import ModelConfig

logger = logging.getLogger("hkvd.shim")

FIELD = "store_decode"  # the key under kv_transfer_params["hkvd"]
REASONS = ("template", "request", "config")
STAT_NAMES = tuple(f"decode_{what}_not_stored_{reason}" for what in ("chunks", "bytes") for reason in REASONS)

MARKER = "hkvd-thinking-marker-7f3a"  # a string no template writes by itself
PROBE = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": f"<think>{MARKER}</think>Hi."},
    {"role": "user", "content": "Again."},
]


def parse(params: object) -> tuple[bool | None, str]:
    """(the request's ``store_decode``: True, False, or None when it says nothing; a warning line, or "") from its
    ``kv_transfer_params``."""
    if not isinstance(params, Mapping):
        return None, ""
    ours = params.get(KEY)
    if not isinstance(ours, Mapping) or FIELD not in ours:
        return None, ""
    value = ours[FIELD]
    if isinstance(value, bool):
        return value, ""
    return None, (f"hkvd: kv_transfer_params[{KEY!r}][{FIELD!r}]={repr(value)[:40]} is not a bool; send true (store "
                  "the chunks this request generates) or false (do not: its answer is not repeated in a later "
                  "prompt); the engine's store_decode applies")


def _vllm_tokenizer(model_config: ModelConfig) -> Any:
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


def template_drops_thinking(model_config: ModelConfig | None, load: Callable[[ModelConfig], Any] = _vllm_tokenizer
                            ) -> tuple[bool | None, str]:
    """(whether the model's chat template drops an earlier answer's thinking part, or None when that cannot be told;
    why). Renders ``PROBE`` with the model's tokenizer (``load``: vLLM's own, cached in this process)."""
    if model_config is None:
        return None, "no model config"
    if getattr(model_config, "skip_tokenizer_init", False):
        return None, "the engine runs without a tokenizer (skip_tokenizer_init)"
    try:
        tokenizer = load(model_config)
    except Exception as e:
        return None, f"its tokenizer could not be loaded ({type(e).__name__}: {str(e)[:200]})"
    if tokenizer is None:
        return None, "the engine runs without a tokenizer"
    if not getattr(tokenizer, "chat_template", None):
        return None, "its tokenizer has no chat template"
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        return None, f"its chat template could not be rendered ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(text, str) or "Again." not in text:
        return None, "its chat template does not render the conversation's messages"
    if MARKER in text:
        return False, "its chat template keeps an earlier answer's thinking part in the next prompt"
    return True, "its chat template drops an earlier answer's thinking part from the next prompt"


class DecodeStores:
    """The engine's decision (``store``, ``reason`` when False), a request's (``for_request``), and the counts of the
    decode chunks not stored, in ``stats`` (the scheduler side's counters)."""

    def __init__(self, setting: bool | str, model_config: ModelConfig | None, stats: dict[str, int],
                 detect: Callable[[ModelConfig | None], tuple[bool | None, str]] = template_drops_thinking) -> None:
        self.stats = stats
        for name in STAT_NAMES:
            stats.setdefault(name, 0)
        if setting == "auto":
            drops, why = detect(model_config)
            self.store, self.reason = not drops, "template" if drops else ""
            if drops is None:
                logger.info("hkvd: store_decode auto: %s; the chunks a request generates are stored", why)
            elif drops:
                logger.info("hkvd: store_decode auto: %s; the chunks a request generates are not stored (a request "
                            'stores them with kv_transfer_params={"hkvd": {"store_decode": true}})', why)
            else:
                logger.info("hkvd: store_decode auto: %s; the chunks a request generates are stored", why)
        else:
            self.store, self.reason = bool(setting), "" if setting else "config"

    def for_request(self, asked: bool | None) -> tuple[bool, str]:
        """(whether a request that asked ``asked`` stores its decode chunks; the reason when not)."""
        if asked is None:
            return self.store, self.reason
        return asked, "" if asked else "request"

    def not_stored(self, reason: str, chunks: int, chunk_bytes: int) -> None:
        """Count ``chunks`` decode chunks of ``chunk_bytes`` bytes each not stored for ``reason``."""
        if chunks <= 0 or reason not in REASONS:
            return
        self.stats[f"decode_chunks_not_stored_{reason}"] += chunks
        self.stats[f"decode_bytes_not_stored_{reason}"] += chunks * chunk_bytes
