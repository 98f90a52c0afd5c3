"""Imports run one way: no circle among megatron-flat's modules, lazy (in-function) imports
included, so no module can see another half-initialised; the glue's shared state is a leaf."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_flat"


def _modules() -> Dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> Dict[str, Set[str]]:
    """module -> the package modules it imports anywhere in its body."""
    modules = _modules()
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in modules else node.module
                    if target in modules:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "megatron_flat.megatron.install" in graph  # the walk sees the glue
    assert circles(graph) == []


def test_the_glue_state_and_compat_are_leaves():
    graph = import_graph()
    glue = {m for m in graph if m.startswith("megatron_flat.megatron.")}
    for leaf in ("megatron_flat.megatron.state", "megatron_flat.megatron.compat"):
        assert not graph[leaf] & glue, (leaf, graph[leaf] & glue)
    # install wires the techniques; none of them imports it back
    assert not [m for m in glue if "megatron_flat.megatron.install" in graph[m]]


def test_the_circle_finder_finds_circles():
    # The check above cannot pass vacuously: a two- and a three-module circle are found.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]
