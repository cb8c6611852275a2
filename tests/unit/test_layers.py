"""The floor plan: each layer imports only the layers below it, and nothing imports in a circle.

    transport/   the model that crosses a process boundary (wire, layout, copy-engine interface,
                 errors, keys); imports nothing of ours
    cuda/        GPU side; imports transport/
    shim/        the vLLM connector; imports transport/ (and cuda/ for the engine-side export)
    daemon/      imports transport/ and cuda/, never shim/

Every ``import`` is read from the source (inside functions too), so the plan cannot drift. An import
under ``if TYPE_CHECKING:`` never runs: it obeys the layer rule but is no edge of a cycle. Importing a
name from a package runs its ``__init__``: that is an edge to the package, also from inside it.

No two product modules share a file name (package ``__init__.py`` and ``__main__.py`` aside), so a
file's name says which module it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("transport", "cuda", "shim", "daemon")
ALLOWED = {
    "transport": {"transport"},
    "cuda": {"cuda", "transport"},
    "shim": {"shim", "transport", "cuda"},
    "daemon": {"daemon", "transport", "cuda"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "hkvd." + ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> list[tuple[str, int, str]]:
    """(imported hkvd module, line, where) for every import of ours in ``path``; where is "top" (runs
    at import time), "typing" (under ``if TYPE_CHECKING:``, never runs) or "inner" (in a function)."""
    tree = ast.parse(path.read_text(), str(path))
    where = {id(n): "top" for n in tree.body}
    for b in tree.body:
        if isinstance(b, ast.If):
            where |= {id(n): "typing" if _type_checking(b) else "top" for n in b.body}
            where |= {id(n): "top" for n in b.orelse}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]  # a name, or a submodule: trimmed below
        else:
            continue
        found += [(n, node.lineno, where.get(id(node), "inner")) for n in names if n.startswith("hkvd.")]
    return found


def _sources() -> list[Path]:
    return [p for layer in LAYERS for p in sorted((REPO / layer).rglob("*.py"))]


def _layer(module: str) -> str:
    return module.split(".")[1]


def forbidden_edges(sources: list[Path]) -> list[str]:
    bad = []
    for path in sources:
        layer = path.relative_to(REPO).parts[0]
        for target, line, _ in _imports(path):
            if _layer(target) not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target} ({layer}/ may import "
                           f"{', '.join(sorted(ALLOWED[layer]))})")
    return bad


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def cycles(sources: list[Path]) -> list[list[str]]:
    """Circles of module-level imports between our modules (Tarjan's strongly connected components)."""
    modules = {_module(p): p for p in sources}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps = set()
        for target, _, where in _imports(path):
            if where != "top":
                continue
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != mod:
                # A name taken from a package (``from a.b import X``) needs a.b's __init__ to have run
                # that far: an edge, from a module inside a.b too.
                deps.add(target)
            # Importing a.b.c runs the package a.b's __init__ first: an edge too, except to the packages
            # around the importer (Python imports them before it).
            deps |= {p for p in _parents(target) if p in modules and p != mod and not mod.startswith(p + ".")}
        graph[mod] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def same_names(sources: list[Path]) -> list[str]:
    """Product modules that share a file name (package ``__init__.py`` and ``__main__.py`` aside)."""
    by_name: dict[str, list[str]] = {}
    for p in sources:
        if p.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(p.name, []).append(str(p.relative_to(REPO)))
    return [f"{name}: {', '.join(paths)}" for name, paths in sorted(by_name.items()) if len(paths) > 1]


def test_each_layer_imports_only_the_layers_below_it():
    assert forbidden_edges(_sources()) == []


def test_no_module_imports_in_a_circle():
    assert cycles(_sources()) == []


def test_no_two_modules_share_a_file_name():
    assert same_names(_sources()) == []


# Imports of our own modules inside functions hide the plan (optional third-party packages, such as
# CuPy, NIXL, Mooncake and prometheus_client, are still imported where they are needed).
NO_INNER_IMPORTS = LAYERS


def test_no_import_of_ours_inside_a_function():
    inner = [f"{p.relative_to(REPO)}:{line} imports {target}" for p in _sources()
             if p.relative_to(REPO).parts[0] in NO_INNER_IMPORTS for target, line, where in _imports(p)
             if where == "inner"]
    assert inner == []


def test_the_checks_see_a_forbidden_edge_and_a_cycle(tmp_path, monkeypatch):
    # The checks themselves can fail: a transport module that imports the daemon, and two that import each other.
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "transport" / "a.py").write_text("from hkvd.transport import b\nimport hkvd.daemon.x\n")
    (tmp_path / "transport" / "b.py").write_text("from hkvd.transport.a import thing\n")
    (tmp_path / "daemon" / "x.py").write_text("def f():\n    from hkvd.shim import client\n")
    srcs = _sources()
    bad = forbidden_edges(srcs)
    assert len(bad) == 2 and any("transport/a.py:2 imports hkvd.daemon.x" in b for b in bad)
    assert any("daemon/x.py:2 imports hkvd.shim.client" in b for b in bad)
    assert cycles(srcs) == [["hkvd.transport.a", "hkvd.transport.b"]]


def test_the_checks_see_a_package_cycle_a_shared_name_and_skip_type_checking(tmp_path, monkeypatch):
    # A package whose __init__ imports its submodule, which takes a name from the package: a cycle.
    # A circle closed only under ``if TYPE_CHECKING:`` is none. Two modules named events.py clash.
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    wire = tmp_path / "transport" / "wire"
    wire.mkdir()
    (wire / "__init__.py").write_text("class Message: ...\nfrom hkvd.transport.wire import kv\n")
    (wire / "kv.py").write_text("from hkvd.transport.wire import Message\n")
    (wire / "events.py").write_text("from hkvd.transport.wire.kv import thing\n")
    (tmp_path / "transport" / "c.py").write_text("from hkvd.transport import d\n")
    (tmp_path / "transport" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hkvd.transport.c import thing\n")
    (tmp_path / "cuda" / "events.py").write_text("")
    srcs = _sources()
    assert cycles(srcs) == [["hkvd.transport.wire", "hkvd.transport.wire.kv"]]
    assert same_names(srcs) == ["events.py: transport/wire/events.py, cuda/events.py"]
    assert forbidden_edges(srcs) == []
    # The submodule that takes its base from a module of its own (not the package) closes no circle.
    (wire / "message.py").write_text("class Message: ...\n")
    (wire / "__init__.py").write_text(
        "from hkvd.transport.wire import kv\nfrom hkvd.transport.wire.message import Message\n")
    (wire / "kv.py").write_text("from hkvd.transport.wire.message import Message\n")
    assert cycles(_sources()) == []


# The shim's own plan: a shim module imports only shim modules of a lower tier, with every kind of
# import counted (under ``if TYPE_CHECKING:`` too: a type-only circle still knots the modules together
# for a reader and for go-to-definition). Every shim module has a place here; a new one must be given one.
SHIM_TIERS: tuple[frozenset[str], ...] = (
    # 0. Data and leaf helpers: settings, the jobs pickled to the workers, the daemon's typed results,
    #    chunk identity, KV views, KV event notes, GPU ordering, ptrace, sampled verification,
    #    session pins asked for, the KV hints a request carries, tenant labels, the per-request timeline and the
    #    page tables of a pool map.
    frozenset({"shim_config", "jobs", "results", "identity", "kv_views", "kv_event_notes", "gpu", "ptrace",
               "verify", "sessions", "hints", "tenants", "timeline", "map_populator"}),
    # 1. What the shim asks of its daemon (the port the client implements and the tests' fake stands in for);
    #    the client's framed socket; whether decode chunks are stored (beside the session pins' fields).
    frozenset({"daemon_port", "client_socket", "decode_stores"}),
    # 2. The daemon client, the engine spec, the step metadata, a request's states, the connector's stats (they
    #    name decode_stores' counters).
    frozenset({"client", "spec", "metadata", "request_state", "connector_stats"}),
    # 3. What drives the client (the link, the worker's loads, the KV event feed); block tables into items;
    #    partial chunks (keys and probes of hits inside a block); a request's chunk keys; the worker's map of
    #    the daemon's pool and its in-step copies.
    frozenset({"link", "loads", "kv_event_feed", "plans", "partial", "request_keys", "pool_reads"}),
    # 4. Prefill/decode pulls (they end in loads); what the scheduler side's parts share.
    frozenset({"pd", "scheduler_context"}),
    # 5. The scheduler side's three parts: lookups, stores, loads.
    frozenset({"lookups", "store_planner", "load_planner"}),
    # 6. The connector's two halves.
    frozenset({"scheduler", "worker"}),
    # 7. The connector vLLM loads.
    frozenset({"connector"}),
    # 8. The package of tools for tests and benchmarks (shim/testing/): nothing of the product imports it.
    frozenset({"testing"}),
)


def _shim_tier(name: str) -> int | None:
    return next((i for i, tier in enumerate(SHIM_TIERS) if name in tier), None)


def shim_plan_breaks(sources: list[Path]) -> list[str]:
    """Shim imports against ``SHIM_TIERS`` (type-only and in-function imports included), and shim
    modules the plan does not place."""
    bad = []
    for path in sources:
        rel = path.relative_to(REPO)
        if rel.parts[0] != "shim" or rel.parts[1:] == ("__init__.py",):
            continue
        name = rel.parts[1].removesuffix(".py")  # a module of shim/, or a package in it (shim/testing/)
        mine = _shim_tier(name)
        if mine is None:
            bad.append(f"{rel} has no tier in SHIM_TIERS: give it one")
            continue
        for target, line, where in _imports(path):
            parts = target.split(".")
            if parts[:2] != ["hkvd", "shim"] or len(parts) < 3:
                continue
            theirs = _shim_tier(parts[2])
            if theirs is None or theirs >= mine:
                bad.append(f"{rel}:{line} imports {target} ({where}): shim/{name} (tier {mine}) may import "
                           f"only shim modules of a lower tier, not tier {theirs}")
    return bad


def test_the_shim_follows_its_plan():
    assert shim_plan_breaks(_sources()) == []


def test_the_shim_plan_sees_a_type_only_import_upward(tmp_path, monkeypatch):
    # A leaf that imports the scheduler only for annotations breaks the plan; so does an unplaced module.
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "shim" / "jobs.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hkvd.shim.scheduler import SchedulerSide\n")
    (tmp_path / "shim" / "scheduler.py").write_text("from hkvd.shim.jobs import LoadJob\n")
    (tmp_path / "shim" / "stray.py").write_text("")
    bad = shim_plan_breaks(_sources())
    assert len(bad) == 2
    assert "shim/jobs.py:3 imports hkvd.shim.scheduler.SchedulerSide (typing)" in bad[0]
    assert "shim/stray.py has no tier" in bad[1]


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_has_sources(layer):
    assert list((REPO / layer).rglob("*.py")), f"{layer}/ has no modules: the plan above is stale"


# The daemon's plan: the cache (daemon/cache/) is the one place that decides what counts as a hit and
# what gets leased. It imports no daemon module outside itself, and the rest of the daemon reaches it
# only through the names ``hkvd.daemon.cache`` exports, never through a module under it. Every kind of
# import counts (under ``if TYPE_CHECKING:`` and inside functions too). The daemon's top level keeps
# only process plumbing; everything else lives in a package (cache, engines, peers, routing, tiers).
DAEMON_CACHE = "hkvd.daemon.cache"
DAEMON_TOP_LEVEL = frozenset({"__init__", "__main__", "app", "cli", "config", "options", "server", "http", "metrics",
                              "heap", "notify", "fd_budget", "secret_files", "startup_errors", "reload",
                              "prefault_progress"})


def _names_a_module(package_dir: Path, target: str, package: str) -> bool:
    """Whether ``target``, an import under ``package``, names a module or package in it (not an exported name)."""
    part = target[len(package) + 1:].split(".")[0]
    return (package_dir / f"{part}.py").exists() or (package_dir / part).is_dir()


def daemon_plan_breaks(sources: list[Path]) -> list[str]:
    """Daemon imports against the cache's boundary, and modules at the daemon's top level that are not
    process plumbing."""
    bad = []
    cache_dir = REPO / "daemon" / "cache"
    for path in sources:
        rel = path.relative_to(REPO)
        if rel.parts[0] != "daemon":
            continue
        inside = rel.parts[1] == "cache"
        if len(rel.parts) == 2 and path.stem not in DAEMON_TOP_LEVEL:
            bad.append(f"{rel} sits at the daemon's top level, which keeps only process plumbing: move it into the "
                       "package it belongs to (or name it in DAEMON_TOP_LEVEL if it is plumbing)")
        for target, line, where in _imports(path):
            if not target.startswith("hkvd.daemon."):
                continue
            in_cache = target == DAEMON_CACHE or target.startswith(DAEMON_CACHE + ".")
            if inside and not in_cache:
                bad.append(f"{rel}:{line} imports {target} ({where}): daemon/cache/ imports no daemon module "
                           "outside it")
            elif not inside and in_cache and target != DAEMON_CACHE and _names_a_module(cache_dir, target,
                                                                                       DAEMON_CACHE):
                bad.append(f"{rel}:{line} imports {target} ({where}): outside daemon/cache/, import the names "
                           f"{DAEMON_CACHE} exports, never a module under it")
    return bad


def test_the_daemon_follows_its_plan():
    assert daemon_plan_breaks(_sources()) == []


def test_the_daemon_plan_sees_type_only_imports_across_the_cache_boundary(tmp_path, monkeypatch):
    # The cache importing the registry for annotations breaks the plan, so does a peer module that takes
    # Entry from the index module for annotations, and a module at the top level; the package's own
    # exports are what the rest of the daemon imports.
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    for pkg in ("cache", "peers"):
        (tmp_path / "daemon" / pkg).mkdir()
    (tmp_path / "daemon" / "cache" / "__init__.py").write_text("from hkvd.daemon.cache.index import Entry\n")
    (tmp_path / "daemon" / "cache" / "index.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from hkvd.daemon.engines.registry import EngineState\n")
    (tmp_path / "daemon" / "peers" / "serving.py").write_text(
        "from typing import TYPE_CHECKING\nfrom hkvd.daemon.cache import Cache\nfrom hkvd.daemon import config\n"
        "if TYPE_CHECKING:\n    from hkvd.daemon.cache.index import Entry\n")
    (tmp_path / "daemon" / "config.py").write_text("")
    (tmp_path / "daemon" / "stray.py").write_text("")
    bad = daemon_plan_breaks(_sources())
    assert len(bad) == 3, bad
    assert "daemon/cache/index.py:3 imports hkvd.daemon.engines.registry.EngineState (typing)" in bad[0]
    assert "daemon/peers/serving.py:5 imports hkvd.daemon.cache.index.Entry (typing)" in bad[1]
    assert "daemon/stray.py sits at the daemon's top level" in bad[2]


# One place decides a hit: ``Cache.plan_lookup`` (daemon/cache/lookup_plan.py) is the only caller of the hit
# rules. The package exports none of them, and no module outside daemon/cache/ imports one, by any path.
HIT_RULES = frozenset({"plan_hit", "plan_ranks", "plan_keys", "required_chunks", "plan"})


def hit_rule_breaks(sources: list[Path]) -> list[str]:
    """Imports of the hit rules from outside daemon/cache/."""
    bad = []
    for path in sources:
        rel = path.relative_to(REPO)
        if rel.parts[:2] == ("daemon", "cache"):
            continue
        for target, line, where in _imports(path):
            if target.startswith(DAEMON_CACHE + ".") and target.rsplit(".", 1)[1] in HIT_RULES:
                bad.append(f"{rel}:{line} imports {target} ({where}): ask Cache.plan_lookup what a lookup gets")
    return bad


def test_only_the_cache_plans_a_hit():
    assert hit_rule_breaks(_sources()) == []
    import hkvd.daemon.cache as cache

    assert HIT_RULES.isdisjoint(cache.__all__) and not any(hasattr(cache, name) for name in HIT_RULES)


def test_the_hit_rule_check_sees_an_import_of_a_rule(tmp_path, monkeypatch):
    # A router module that plans by itself, through the package or the module under it, breaks the plan.
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    for pkg in ("cache", "routing"):
        (tmp_path / "daemon" / pkg).mkdir()
    (tmp_path / "daemon" / "cache" / "hybrid.py").write_text("from hkvd.daemon.cache.lookup_plan import plan\n")
    (tmp_path / "daemon" / "routing" / "a.py").write_text(
        "from hkvd.daemon.cache import Cache, plan_ranks\nfrom hkvd.daemon.cache.hybrid import required_chunks\n")
    bad = hit_rule_breaks(_sources())
    assert len(bad) == 2 and "routing/a.py:1 imports hkvd.daemon.cache.plan_ranks" in bad[0]
    assert "routing/a.py:2 imports hkvd.daemon.cache.hybrid.required_chunks" in bad[1]


# The cache as a boundary: ``Cache`` composes a private index and offers a closed set of verbs. Outside
# daemon/cache/, a cache object (by the names the daemon gives one: ``index``, ``cache``) is used only through
# them: its public methods and the attributes its ``__init__`` sets (``pool``, ``formats``, ``tenants``,
# ``sessions``...). The index itself is no name the package exports (the module rule above keeps
# ``hkvd.daemon.cache.index`` out of reach).
CACHE_HOLDERS = frozenset({"index", "cache", "_index", "_cache"})


def cache_verbs() -> frozenset[str]:
    """Cache's public methods and properties, and the public attributes its ``__init__`` sets."""
    tree = ast.parse((REPO / "daemon" / "cache" / "core.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Cache"]
    verbs = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    [init] = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    for node in ast.walk(init):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and isinstance(node.ctx, ast.Store) and not node.attr.startswith("_")):
            verbs.add(node.attr)
    return frozenset(verbs)


def _holder(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Name) and node.id in CACHE_HOLDERS)
            or (isinstance(node, ast.Attribute) and node.attr in CACHE_HOLDERS))


def index_touches(sources: list[Path], verbs: frozenset[str]) -> list[str]:
    """Outside daemon/cache/: imports of ``Index``, and names used on a cache object that are no verb of it."""
    bad = []
    for path in sources:
        rel = path.relative_to(REPO)
        if rel.parts[0] != "daemon" or rel.parts[1] == "cache":
            continue
        bad += [f"{rel}:{line} imports {target}: the index is the cache's own" for target, line, _ in _imports(path)
                if target.startswith(DAEMON_CACHE + ".") and target.rsplit(".", 1)[1] == "Index"]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and _holder(node.value) and node.attr not in verbs:
                bad.append(f"{rel}:{node.lineno} uses .{node.attr} of a cache: not one of Cache's verbs "
                           f"({', '.join(sorted(verbs))})")
    return bad


def test_outside_the_cache_nothing_touches_its_index():
    assert index_touches(_sources(), cache_verbs()) == []


def test_the_boundary_check_sees_an_index_name_and_an_import_of_the_index(tmp_path, monkeypatch):
    # Promotion writing through the index's own names, and a module taking Index from the package, break it.
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    for pkg in ("cache", "tiers"):
        (tmp_path / "daemon" / pkg).mkdir()
    (tmp_path / "daemon" / "tiers" / "promotion.py").write_text(
        "from hkvd.daemon.cache import Index\n\n\ndef read(self, k):\n"
        "    e = self.index.begin_write(k, 1, 'full', 0)\n    self.index.complete_store([e], pending=False)\n")
    bad = index_touches(_sources(), frozenset({"complete_store", "plan_lookup"}))
    assert len(bad) == 2, bad
    assert "daemon/tiers/promotion.py:1 imports hkvd.daemon.cache.Index" in bad[0]
    assert "daemon/tiers/promotion.py:5 uses .begin_write of a cache" in bad[1]
