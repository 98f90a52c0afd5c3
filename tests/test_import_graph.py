"""Imports run one way (docs/architecture.md, "Layers").

No circle among megatron-flat's modules, lazy (in-function) imports included, so no module
can see another half-initialised; the glue's shared state is a leaf; every import points down
the layers (techniques < Megatron glue < CPU backend < rehearse < testing); no private name
crosses a module; every module a string names (a ``-m`` worker, a command table) exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

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


# ------------------------------------------------------------------------------ layers
# Lowest first. A module may import its own layer and the ones below, never above. The root
# package is the public face (``megatron_flat.install``) and sits with the glue it exports.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("techniques", ("megatron_flat.dispatch", "megatron_flat.vocab", "megatron_flat.checkpoint",
                    "megatron_flat.optim", "megatron_flat.attention", "megatron_flat.params",
                    "megatron_flat.runtime",
                    "megatron_flat.plan", "megatron_flat.config", "megatron_flat.patch")),
    ("megatron glue", ("megatron_flat.megatron", "megatron_flat")),
    ("CPU backend", ("megatron_flat.cpu",)),
    ("rehearse", ("megatron_flat.rehearse",)),
    ("testing", ("megatron_flat.testing",)),
    ("entry point", ("megatron_flat.__main__",)),
]


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``: its longest matching prefix."""
    best, depth = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                  for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_every_module_is_in_a_layer_and_imports_point_down():
    graph = import_graph()
    assert "megatron_flat.cpu.backend" in graph and "megatron_flat.rehearse.worker" in graph
    assert upward_imports(graph) == []


def test_only_the_harness_imports_the_harness():
    graph = import_graph()
    outside = {m: sorted(t for t in targets if t.startswith("megatron_flat.testing"))
               for m, targets in graph.items() if not m.startswith("megatron_flat.testing")}
    assert {m: t for m, t in outside.items() if t} == {}


def test_the_layer_check_finds_an_upward_import():
    graph = {"megatron_flat.plan.cli": {"megatron_flat.cpu.backend"},
             "megatron_flat.cpu.backend": {"megatron_flat.megatron.compat"},
             "megatron_flat.megatron.compat": set()}
    assert upward_imports(graph) == [
        "megatron_flat.plan.cli (techniques) imports megatron_flat.cpu.backend (CPU backend)"]


# ------------------------------------------------------------------------- private names
def _private_uses(name: str, path: Path, modules: Dict[str, Path]) -> Iterator[str]:
    """``from M import _x`` and ``M._x`` (M a package module bound by an import) in ``path``,
    where M is not ``name`` itself."""
    tree = ast.parse(path.read_text())
    bound: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif node.module in modules and node.module != name and _private(alias.name):
                    yield f"{name} imports {node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and bound[node.value.id] != name
                and _private(node.attr)):
            yield f"{name} uses {bound[node.value.id]}.{node.attr}"


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def test_no_private_name_crosses_a_module():
    modules = _modules()
    found = sorted(use for name, path in modules.items()
                   for use in _private_uses(name, path, modules))
    assert found == []


# ------------------------------------------------------------------ modules named in strings
_NAMED = re.compile(r"^megatron_flat(\.[a-z_][a-z0-9_]*)+$")


def named_modules(path: Path) -> Iterator[str]:
    """String constants in ``path`` that are a dotted megatron_flat module path."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAMED.match(
                node.value):
            yield node.value


def test_every_module_named_in_a_string_exists():
    modules = _modules()
    named = {(name, target) for name, path in modules.items() for target in named_modules(path)}
    assert ("megatron_flat.rehearse.command", "megatron_flat.rehearse.worker") in named
    assert sorted(f"{name} names {target}" for name, target in named
                  if target not in modules) == []
