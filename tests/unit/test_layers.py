"""The floor plan: each layer imports only the layers below it, and nothing imports in a circle.

    transport/   the model that crosses a process boundary (wire, layout, copy-engine interface,
                 errors, keys); imports nothing of ours
    cuda/        GPU side; imports transport/
    shim/        the vLLM connector; imports transport/ (and cuda/ for the engine-side export)
    daemon/      imports transport/ and cuda/, never shim/

Every ``import`` is read from the source (inside functions too), so the plan cannot drift.
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


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported hkvd module, line, at module level) for every import of ours in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    top |= {id(n) for b in tree.body if isinstance(b, ast.If) for n in b.body}  # if TYPE_CHECKING:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]  # a name, or a submodule: trimmed below
        else:
            continue
        found += [(n, node.lineno, id(node) in top) for n in names if n.startswith("hkvd.")]
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
        for target, _, at_top in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # Importing a.b.c runs the package a.b's __init__ first: that is an edge too.
            for dep in (target, *(p for p in _parents(target) if p in modules)):
                if at_top and dep and dep != mod and not mod.startswith(dep + "."):
                    deps.add(dep)
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


def test_each_layer_imports_only_the_layers_below_it():
    assert forbidden_edges(_sources()) == []


def test_no_module_imports_in_a_circle():
    assert cycles(_sources()) == []


# Imports of our own modules inside functions hide the plan (optional third-party packages, such as
# CuPy, NIXL, Mooncake and prometheus_client, are still imported where they are needed).
NO_INNER_IMPORTS = LAYERS


def test_no_import_of_ours_inside_a_function():
    inner = [f"{p.relative_to(REPO)}:{line} imports {target}" for p in _sources()
             if p.relative_to(REPO).parts[0] in NO_INNER_IMPORTS for target, line, at_top in _imports(p) if not at_top]
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


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_has_sources(layer):
    assert list((REPO / layer).rglob("*.py")), f"{layer}/ has no modules: the plan above is stale"
