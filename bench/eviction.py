"""eviction: what each eviction policy and admission keeps of a mixed trace, at the same pool size.

In-process, against the daemon's own ``Cache`` (its index, eviction policies, admission and hit rule) over a
``HugePagePool`` that is mapped but never written: no engine, no copies. Every request does what an engine does
through the shim: a lookup of its prompt's chunk keys (``plan_lookup(seen=True)``, leased and released, as a
load's retrieve would), then a store of the chunks past the hit (``begin_store(offered=True)`` with their chunk
indexes, READY at once).

The trace (from a seed):

- ``SESSIONS`` agent sessions of ``TURNS`` turns (shaped as ``bench agents``' sessions), interleaved: turn 1 is
  a system prompt shared by every session (``SYSTEM_CHUNKS``, 384 tokens) and a task of 1 chunk; every later
  turn sends the session so far, the model's answer (1 chunk, stored at the turn's end, as the shim stores
  decode chunks) and a tool result of 1 to 6 chunks;
- ``ONESHOT_RATIO`` (5) times as many one-shot prompts as agent turns, shuffled among them: 8 to 12 chunks
  (1,024 to 1,536 tokens) of their own, never seen again.

Two formats, chunks of 128 tokens: ``dense`` (one full-attention group) and ``hybrid`` (full attention and a
Mamba/GDN state at every chunk boundary, twice a chunk's bytes: a hit needs a state where it ends). Pool sizes
(``POOL_SHARES``) are in units of every session's chunks at their longest, all sessions together: the one-shots
between two turns of one session write about as much as the 1x pool holds.

Reported per format, pool size, policy (lru: today's, hybrid, cost) and admission (none: store everything, tinylfu), as
ratios against lru + none on the same trace and seed, over ``SEEDS`` seeds (mean, min, max): **recompute
saved** (the prefill not recomputed, each hit chunk weighted by the recompute-cost model of
``daemon/cache/recompute_cost.py``: ``C * (i*C + C/2 + k)`` for chunk i, a model, not a measurement), hit
tokens (unweighted), and bytes stored (store bandwidth). The issue's target: recompute saved >= 1.3x lru at
the same pool size.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hkvd.daemon.cache import Cache, GroupRule, HugePagePool, NotAdmitted, make_policy
from hkvd.daemon.cache.recompute_cost import attention_cost
from hkvd.transport.errors import PoolFull

CHUNK = 128
ATTN_BYTES = 128 << 10
STATE_BYTES = 256 << 10
SYSTEM_CHUNKS = 3  # 384 tokens, as bench agents' system prompt
SESSIONS = 16
TURNS = 10
TOOL_CHUNKS = (1, 6)  # a tool result of 128 to 768 tokens after each answer
ONESHOT_CHUNKS = (8, 12)  # one-shot prompts of 1,024 to 1,536 tokens
ONESHOT_RATIO = 5
POOL_SHARES = (0.5, 1.0, 2.0)  # the pool, in units of the sessions' chunks at their longest (all sessions together)
SEEDS = (1, 2, 3)
POLICIES = ("lru", "hybrid", "cost")
ADMISSIONS = ("none", "tinylfu")
FORMATS = ("dense", "hybrid")
FULL, MAMBA = 0, 1


@dataclass(frozen=True, slots=True)
class Model:
    """An engine format (a ``Shape``: rules and chunk size)."""

    name: str
    rules: tuple[GroupRule, ...]
    chunk_size: int = CHUNK

    @property
    def kinds(self) -> dict[int, str]:
        return {r.group_id: r.kind for r in self.rules}

    @property
    def sizes(self) -> dict[int, int]:
        return {r.group_id: STATE_BYTES if r.kind == "mamba" else ATTN_BYTES for r in self.rules}


MODELS = {"dense": Model("dense", (GroupRule(FULL, "full"),)),
          "hybrid": Model("hybrid", (GroupRule(FULL, "full"), GroupRule(MAMBA, "mamba")))}


#: A request: its prompt's chunk keys, and the key of its answer's chunk (an agent turn's, stored at the turn's
#: end and part of the next turn's prompt) or None (a one-shot).
Request = tuple[list[bytes], bytes | None]


def trace(seed: int, sessions: int, turns: int) -> list[Request]:
    """The mixed trace of ``seed`` (module docstring): agent turns in session order, one-shots among them."""
    rng = random.Random(seed)
    counter = iter(range(1 << 40))

    def fresh(n: int) -> list[bytes]:
        return [next(counter).to_bytes(8, "little") + seed.to_bytes(8, "little") for _ in range(n)]

    system = fresh(SYSTEM_CHUNKS)
    agent_turns: list[list[Request]] = []
    for _ in range(sessions):
        prompt, session = system + fresh(1), []  # the shared system prompt and a task of its own
        for _ in range(turns):
            answer = fresh(1)[0]
            session.append((prompt, answer))
            prompt = [*prompt, answer, *fresh(rng.randint(*TOOL_CHUNKS))]
        agent_turns.append(session)
    order: list[Request] = []  # each next agent turn from a random session with turns left
    nexts = dict.fromkeys(range(sessions), 0)
    while nexts:
        s = rng.choice(list(nexts))
        order.append(agent_turns[s][nexts[s]])
        nexts[s] += 1
        if nexts[s] == turns:
            del nexts[s]
    oneshots: list[Request] = [(fresh(rng.randint(*ONESHOT_CHUNKS)), None) for _ in range(ONESHOT_RATIO * len(order))]
    slots = [True] * len(order) + [False] * len(oneshots)
    rng.shuffle(slots)
    agents, others = iter(order), iter(oneshots)
    return [next(agents) if agent else next(others) for agent in slots]


def play(model: Model, requests: list[Request], policy: str, admission: str, pool_bytes: int) -> dict[str, Any]:
    """Serve ``requests`` from a fresh cache of ``pool_bytes`` (mapped, never written) under ``policy`` and
    ``admission``; what it saved and stored."""
    pool = HugePagePool(pool_bytes, "off")
    try:
        cache = Cache(pool, make_policy(policy), admission=admission)
        world = (b"bench-eviction-" + model.name.encode()[:1],)
        cache.formats.add(world, 0, model=model.name, chunk_size=model.chunk_size, rules=model.rules,
                          kinds=model.kinds, entry_bytes=model.sizes)
        cache.add_format(world, model.kinds)
        fp = world[0]
        sizes, kinds = model.sizes, model.kinds
        cost = [attention_cost(i, model.chunk_size) for i in range(256)]
        saved = wanted = 0.0
        hit_tokens = prompt_tokens = 0
        stored = refused = 0
        for prompt, answer in requests:
            plan = cache.plan_lookup(model, prompt, world, seen=True)
            n = plan.hit_chunks
            if n:
                cache.release(cache.lease(plan, 1, 60.0))
            saved += sum(cost[:n])
            wanted += sum(cost[:len(prompt)])
            hit_tokens += n * CHUNK
            prompt_tokens += len(prompt) * CHUNK
            keys = prompt if answer is None else [*prompt, answer]  # an agent stores its answer's chunk too
            wants = [((fp, g, keys[i]), sizes[g], kinds[g], keys[i - 1] if i else b"")
                     for i in range(n, len(keys)) for g in kinds]
            chunks = [i for i in range(n, len(keys)) for _ in kinds]
            got = cache.begin_store(wants, 1, chunks=chunks, offered=True)
            placed = [e for e in got if e is not None and not isinstance(e, PoolFull)]
            stored += sum(e.nbytes for e in placed)
            refused += sum(isinstance(e, NotAdmitted) for e in got)
            cache.complete_store(placed, pending=False)
        st = cache.statistics()
        return {"saved": saved, "wanted": wanted, "hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
                "stored_bytes": stored, "refused": refused, "evictions": st.evictions,
                "evictions_by_reason": dict(st.evictions_by_reason)}
    finally:
        pool.close()


def _pool_bytes(model: Model, requests: list[Request], share: float) -> int:
    """``share`` of the bytes of every session's chunks at their longest (its last turn's prompt and answer),
    in 2 MiB superblocks: the one-shots between a session's turns write more than that."""
    longest: dict[bytes, int] = {}  # a session's task key -> its longest prompt and answer
    for prompt, answer in requests:
        if answer is not None:
            longest[prompt[SYSTEM_CHUNKS]] = max(longest.get(prompt[SYSTEM_CHUNKS], 0), len(prompt) + 1)
    chunks = sum(longest.values()) + SYSTEM_CHUNKS
    sb = 2 << 20
    return max(int(chunks * sum(model.sizes.values()) * share) // sb, 4 + len(model.sizes)) * sb


def run(quick: bool = False, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    """Every format, pool size, policy and admission over the seeds (``hugepages`` is unused: the pool is
    mapped, never written)."""
    seeds = SEEDS[:1] if quick else SEEDS
    shares = POOL_SHARES[1:2] if quick else POOL_SHARES
    sessions, turns = (6, 6) if quick else (SESSIONS, TURNS)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for fmt in FORMATS:
        model = MODELS[fmt]
        for share in shares:
            per: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for seed in seeds:
                requests = trace(seed, sessions, turns)
                pool_bytes = _pool_bytes(model, requests, share)
                base: dict[str, Any] | None = None
                for policy in POLICIES:
                    for admission in ADMISSIONS:
                        r = play(model, requests, policy, admission, pool_bytes)
                        if base is None:
                            base = r
                        r = {**r, "pool_mib": pool_bytes >> 20,
                             "saved_ratio": r["saved"] / max(base["saved"], 1e-9),
                             "hit_ratio": r["hit_tokens"] / max(base["hit_tokens"], 1),
                             "stored_ratio": r["stored_bytes"] / max(base["stored_bytes"], 1)}
                        per.setdefault((policy, admission), []).append(r)
            for (policy, admission), rs in per.items():
                row = {"format": fmt, "pool_share": share, "policy": policy, "admission": admission,
                       "seeds": len(rs), "pool_mib": statistics.fmean(r["pool_mib"] for r in rs)}
                for name in ("saved_ratio", "hit_ratio", "stored_ratio"):
                    xs = [r[name] for r in rs]
                    row[name] = statistics.fmean(xs)
                    row[name + "_min"] = min(xs)
                    row[name + "_max"] = max(xs)
                row["saved_share"] = statistics.fmean(r["saved"] / r["wanted"] for r in rs)
                row["refused"] = statistics.fmean(r["refused"] for r in rs)
                row["evictions"] = statistics.fmean(r["evictions"] for r in rs)
                rows.append(row)
                log(f"  {fmt:6} pool {share:g}x {policy:6} {admission:7}: recompute saved {row['saved_ratio']:.2f}x "
                    f"lru [{row['saved_ratio_min']:.2f}, {row['saved_ratio_max']:.2f}], hit tokens "
                    f"{row['hit_ratio']:.2f}x, bytes stored {row['stored_ratio']:.2f}x, {row['saved_share']:.1%} "
                    "of the trace's prefill saved")
    requests = trace(seeds[0], sessions, turns)
    agents = sum(answer is not None for _, answer in requests)
    return {"config": {"seeds": list(seeds), "sessions": sessions, "turns": turns, "oneshot_ratio": ONESHOT_RATIO,
                       "system_chunks": SYSTEM_CHUNKS, "chunk_tokens": CHUNK, "attention_entry_bytes": ATTN_BYTES,
                       "state_entry_bytes": STATE_BYTES, "pool_shares": list(shares), "agent_turns": agents,
                       "oneshots": len(requests) - agents, "target_saved_ratio": 1.3},
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["format", "pool", "policy", "admission", "recompute saved vs lru [min, max]", "hit tokens vs lru",
               "bytes stored vs lru", "share of prefill saved"]
    rows = []
    for r in result["rows"]:
        rows.append([r["format"], f"{r['pool_share']:g}x ({r['pool_mib']:.0f} MiB)", r["policy"], r["admission"],
                     f"{r['saved_ratio']:.2f} [{r['saved_ratio_min']:.2f}, {r['saved_ratio_max']:.2f}]",
                     f"{r['hit_ratio']:.2f}", f"{r['stored_ratio']:.2f}", f"{r['saved_share']:.1%}"])
    return headers, rows


def notes(result: dict[str, Any]) -> str:
    c = result["config"]
    best: dict[tuple[str, float], dict[str, Any]] = {}
    for r in result["rows"]:
        at = (r["format"], r["pool_share"])
        if at not in best or r["saved_ratio"] > best[at]["saved_ratio"]:
            best[at] = r
    parts = [f"{fmt} at {share:g}x: {r['policy']} + {r['admission']}, {r['saved_ratio']:.2f}x"
             for (fmt, share), r in best.items()]
    return (f"{c['agent_turns']} agent turns ({c['sessions']} sessions of {c['turns']}, a {c['system_chunks']}-chunk "
            f"system prompt shared by the sessions) among {c['oneshots']} one-shot prompts; chunks of "
            f"{c['chunk_tokens']} tokens; pool sizes in units of the sessions' chunks at their longest; "
            f"{len(c['seeds'])} seeds. Recompute saved is weighted by the cost model (a formula, docs/design.md "
            f"\"What is kept\"). Best recompute saved against lru + none: {'; '.join(parts)} (target "
            f"{c['target_saved_ratio']}x).")


def plot(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    return []


if __name__ == "__main__":
    res = run(quick="--quick" in sys.argv)
    from bench.common import md_table

    print(md_table(*table(res)))
    print(notes(res))
