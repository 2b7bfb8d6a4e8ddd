"""The package's import structure: no import circles, and dependencies point downward (docs/ARCHITECTURE.md, "Layers").

Every module of ``specdec_ext`` is parsed with ``ast`` (nothing is imported), and every import of the package's own
modules, at module level or inside a function, is an edge. A function-level import still runs, only later: it can
hide a circle from ``python -c "import ..."`` but not from this graph. Importing ``a.b.c`` also runs ``a.b``'s
``__init__``, so that package is an edge too (unless the importer lives inside it: it is already being imported).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = "specdec_ext"
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ROOT)

# The layers each layer must not import (a layer: the first name below ``specdec_ext``; ``specdec_ext`` itself is the
# package's front door, which re-exports from the layers and so sits above them). ``ops`` stands on ``_C`` alone.
EVERY_LAYER = object()
# ``state`` (the decode state types) sits under the models, the drafters and the engine; the engine sits above the
# models and the drafters and under ``generate`` (a loop over it), the server, the CLI and the benchmarks; the server
# (``serve``) sits above the engine and under the CLI and the benchmarks (its load test starts it).
FORBIDDEN = {
    "ops": EVERY_LAYER,
    "state": {ROOT, "models", "drafters", "adaptive", "engine", "generate", "serve", "bench", "zoo", "train", "cli",
              "demo", "ops_tour"},
    "models": {ROOT, "drafters", "adaptive", "engine", "generate", "serve", "bench", "zoo", "train", "cli", "demo",
               "ops_tour"},
    "drafters": {ROOT, "adaptive", "engine", "generate", "serve", "bench", "zoo", "train", "cli", "demo", "ops_tour"},
    "engine": {ROOT, "generate", "serve", "bench", "zoo", "train", "cli", "demo", "ops_tour"},
    "serve": {"bench", "cli", "demo", "ops_tour", "train"},
    "train": {"zoo", "bench", "cli", "demo", "serve"},
    "zoo": {"bench", "cli", "demo", "serve"},
}
ALWAYS_ALLOWED = {"_C"}  # the compiled library: below everything


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every ``.py`` file of the package (a package is its ``__init__``)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(PACKAGE_DIR):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, os.path.dirname(PACKAGE_DIR)).split(os.sep)
        for name in sorted(filenames):
            if name.endswith(".py"):
                parts = rel if name == "__init__.py" else rel + [name[:-3]]
                found[".".join(parts)] = os.path.join(dirpath, name)
    return found


MODULES = _modules()
KNOWN = set(MODULES) | {f"{ROOT}._C"}


def _is_package(module: str) -> bool:
    return MODULES.get(module, "").endswith("__init__.py")


def _targets(module: str, node: ast.AST) -> list[str]:
    """The package's own modules an import statement names (``from a.b import c`` is ``a.b.c`` when that is a
    module, else ``a.b``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative: counted from the importer's package
            base = module.split(".") if _is_package(module) else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in KNOWN else prefix for a in node.names]
    out = []
    for name in names:
        if name != ROOT and not name.startswith(ROOT + "."):
            continue
        while name not in KNOWN:  # ``import a.b.attr``-style: the longest prefix that is a module
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def _import_graph() -> dict[str, dict[str, int]]:
    """``graph[importer][imported] = line`` of the first import, over the package's own modules."""
    graph: dict[str, dict[str, int]] = {m: {} for m in KNOWN}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(module, node):
                # Importing a.b.c first runs the packages a.b (and a), except those the importer is already inside.
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    inside = module == name or module.startswith(name + ".")
                    if name != module and (name == target or not inside):
                        graph[module].setdefault(name, node.lineno)
    return graph


def _where(graph, a: str, b: str) -> str:
    return f"{a} -> {b} ({os.path.relpath(MODULES[a], os.path.dirname(PACKAGE_DIR))}:{graph[a][b]})"


def _cycles(graph) -> list[tuple[list[str], list[str]]]:
    """For every strongly connected component of more than one module (Tarjan): one cycle through it, as a closed
    path, and all its modules."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # a shortest way back to the component's first module, found breadth-first inside it
        start = min(comp)
        came = {start: None}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in comp and w not in came:
                        came[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while came[path[-1]] is not None:
            path.append(came[path[-1]])
        cycles.append((path[::-1] + [start], sorted(comp)))
    return cycles


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def test_the_package_is_found():
    # (a wrong path would make both tests below pass on an empty graph)
    assert {f"{ROOT}.ops", f"{ROOT}.models.checkpoints", f"{ROOT}.drafters.medusa", f"{ROOT}.generate",
            f"{ROOT}.engine.engine", f"{ROOT}.state"} <= set(MODULES)
    graph = _import_graph()
    assert f"{ROOT}.ops" in graph[f"{ROOT}.models.attention"]  # `from specdec_ext import ops` is the module
    assert f"{ROOT}.models" in graph[f"{ROOT}.generate"]  # a package named by its __init__
    assert f"{ROOT}.engine" in graph[f"{ROOT}.generate"] and f"{ROOT}.state" in graph[f"{ROOT}.engine.engine"]


def test_no_import_cycles():
    graph = _import_graph()
    cycles = _cycles(graph)
    lines = ["import circle: " + " -> ".join(c) + "\n    " +
             "\n    ".join(_where(graph, a, b) for a, b in zip(c, c[1:])) +
             f"\n  (modules in circles with it: {', '.join(comp)})" for c, comp in cycles]
    assert not cycles, "\n".join(lines)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_dependencies_point_downward(layer):
    graph = _import_graph()
    forbidden = FORBIDDEN[layer]
    bad = []
    for module in sorted(graph):
        if _layer(module) != layer:
            continue
        for target in sorted(graph[module]):
            to = _layer(target)
            if to == layer or to in ALWAYS_ALLOWED:
                continue
            if forbidden is EVERY_LAYER or to in forbidden:
                bad.append(_where(graph, module, target))
    allowed = "only _C" if forbidden is EVERY_LAYER else "not " + ", ".join(sorted(forbidden))
    assert not bad, f"{layer} may import {allowed}; found:\n    " + "\n    ".join(bad)
