"""Empty a vLLM engine's own prefix cache for real, so that later hits can only come from hkvd.

``LLM.reset_prefix_cache()`` returns False, and leaves every cached block in place, while a finished
request still holds blocks: the connector delays the free of a request whose stores are in flight until a
worker reports them done. vLLM's engine loop keeps stepping for that (``Scheduler.has_finished_requests``
counts such a request), so an engine core in a process of its own frees them by itself within milliseconds;
``reset_prefix_cache(llm)`` retries until the reset succeeds, and raises if it has not within ``timeout_s``.

An engine whose core runs in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's
``InprocClient``) takes a step only when the caller asks for output: ``generate`` returns once its request
is done, and nothing steps the core for the stores still in flight. There ``settle`` steps the core itself
while its scheduler has work (``Scheduler.has_requests``), as the engine core's own loop does in a process
of its own.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's types, for annotations only
    from vllm import LLM
    from vllm.v1.engine.core_client import InprocClient


def reset_prefix_cache(llm: LLM, timeout_s: float = 60.0) -> None:
    """Reset ``llm``'s prefix cache (a ``vllm.LLM``); raise ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's prefix cache could not be reset within {timeout_s:.0f} s: finished "
                               "requests still hold blocks (stores the daemon never finished?)")
        settle(llm, deadline - time.monotonic())
        time.sleep(0.01)


def settle(llm: LLM, timeout_s: float = 60.0) -> None:
    """Step an engine whose core runs in this process until no finished request waits for its stores or
    checks (vLLM frees its blocks then), as the core's own loop does in a process of its own; raise
    ``RuntimeError`` after ``timeout_s``. Through ``LLMEngine.step``, so that each step's statistics (the
    connector's among them) reach vLLM's metrics. Nothing to do for a core in a process of its own."""
    inproc = _inproc_client(llm)
    deadline = time.monotonic() + timeout_s
    while inproc is not None and inproc.engine_core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's engine core still held finished requests after {timeout_s:.0f} s "
                               "(stores the daemon never finished?)")
        llm.llm_engine.step()
        time.sleep(0.001)


def _inproc_client(llm: LLM) -> InprocClient | None:
    """The client of an engine whose core runs in this process (``InprocClient``), or None."""
    from vllm.v1.engine.core_client import InprocClient

    client = getattr(llm.llm_engine, "engine_core", None)
    return client if isinstance(client, InprocClient) else None


def core_in_own_process(args: dict[str, object]) -> bool:
    """Whether a test engine's core needs processes of its own: it asks for vLLM's own process topology
    (``"processes": true``), or it is tensor-parallel (its workers need processes)."""
    llm = args.get("llm")
    tp = int(llm.get("tensor_parallel_size", 1)) if isinstance(llm, dict) else 1
    return bool(args.get("processes")) or tp > 1


def place_engine_core(args: dict[str, object]) -> None:
    """Before vLLM starts an engine: run a test engine's core in this process unless
    ``core_in_own_process(args)``.

    In this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's in-process client drives the core and its
    one-process executor holds the worker, as a single-GPU engine core does: the connector's scheduler and
    worker sides share the process, and the engine starts without importing vLLM twice more (~25 s on two
    cores)."""
    own = core_in_own_process(args)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own else "0"
    if own and forks_engine_processes():
        _fork_engine_processes()


def forks_engine_processes() -> bool:
    """Whether a test engine with processes of its own starts its engine core and workers by ``fork``
    (``HKVD_TEST_FORK_PROCESSES``, default 1), vLLM's own default where no GPU context exists yet, rather
    than by the ``spawn`` its CPU platform sets, in which each process imports vLLM again (~11 s on two
    cores). Forked, they start from the imports of the process that forks them."""
    return os.environ.get("HKVD_TEST_FORK_PROCESSES", "1") == "1"


def _fork_engine_processes() -> None:
    """Keep ``fork`` as vLLM's start method past its CPU platform's configuration, which sets ``spawn`` before
    vLLM starts any process (see ``forks_engine_processes``)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls, vllm_config):  # type: ignore[no-untyped-def]
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
