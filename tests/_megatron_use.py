"""Which test files involve megatron-core, so CI's second megatron-core version runs only those.

A test whose code never reaches megatron-core cannot change with its version. CI therefore
runs every test with the first version and, with the second, only the files this module
classifies as *involved*. The classification is static and leans to "involved"; what it
calls *megatron-free* is then proved so in the first version's run, which executes those
files with megatron-core unimportable (:func:`block_megatron`): a file that reaches
megatron-core after all fails loudly there instead of silently losing its second version.

A test file is involved when any of these holds:
  - it uses the ``megatron_cpu`` fixture;
  - it starts a process (``subprocess``, ``torchrun``, ``os.system``): what a child process
    imports cannot be blocked from here;
  - an import anywhere in it (module level or inside a function), followed through the
    project's own modules (``megatron_flat``, ``benchmarks``, sibling helpers loaded by
    name or by path, ``benchmark_script("name")``), reaches ``megatron`` (megatron-core or
    Megatron-LM's ``megatron.training``).

``python tests/_megatron_use.py [--world N] (--involved | --free)`` prints the files, one
per line (scripts/test.sh's multi-rank loop reads them).
"""

from __future__ import annotations

import ast
import importlib.abc
import re
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
_PROJECT_PACKAGES = ("megatron_flat", "benchmarks", "tests")
_STARTS_PROCESS = re.compile(r"\bsubprocess\b|\btorchrun\b|\bos\.system\b|\bPopen\b")
_SIBLING_FILE = re.compile(r"[\"']([A-Za-z_][A-Za-z0-9_]*)\.py[\"']")


def _module_file(name: str, here: Path) -> Optional[Path]:
    """The project file a module name refers to (package ``__init__`` included), else None.
    Bare names are looked up beside the importing file first (test helpers)."""
    parts = name.split(".")
    if parts[0] in _PROJECT_PACKAGES:
        base = ROOT
    elif len(parts) == 1:
        base = here.parent
    else:
        return None
    path = base.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _imported_names(path: Path, tree: ast.AST, text: str) -> List[str]:
    names: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = path.parent
                for _ in range(node.level - 1):
                    package = package.parent
                base = ".".join(package.relative_to(ROOT).parts + (
                    (node.module,) if node.module else ()))
            else:
                base = node.module or ""
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "benchmark_script"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(f"benchmarks.{node.args[0].value}")
    # Helpers loaded by path (importlib.util.spec_from_file_location(..., "x.py")).
    names += [m for m in _SIBLING_FILE.findall(text) if (path.parent / f"{m}.py").is_file()]
    if re.search(r"[\"']-m[\"'],\s*[\"']megatron_flat[\"']", text):
        names.append("megatron_flat.__main__")
    return names


def _reaches_megatron(path: Path, seen: Set[Path]) -> bool:
    if path in seen:
        return False
    seen.add(path)
    text = path.read_text()
    for name in _imported_names(path, ast.parse(text), text):
        if name == "megatron" or name.startswith("megatron."):
            return True
        target = _module_file(name, path)
        if target is not None and _reaches_megatron(target, seen):
            return True
    return False


def involves_megatron(test_file: Path) -> bool:
    """Whether the test file may run megatron-core code (see the module docstring)."""
    path = Path(test_file).resolve()
    text = path.read_text()
    if "megatron_cpu" in text or _STARTS_PROCESS.search(text):
        return True
    return _reaches_megatron(path, set())


class MegatronBlocked(RuntimeError):
    """Raised by an import of megatron-core in a run that proves files megatron-free. Not an
    ImportError on purpose: ``importorskip`` and ``try/except ImportError`` must not turn it
    into a skip or a fallback."""


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "megatron" or fullname.startswith("megatron."):
            raise MegatronBlocked(
                f"import of {fullname!r} in a test file classified megatron-free; "
                "tests/_megatron_use.py's rules missed how it reaches megatron-core: make "
                "the file's use visible to them (e.g. the megatron_cpu fixture)")
        return None


def block_megatron() -> None:
    """Make every later import of megatron-core raise :class:`MegatronBlocked`."""
    if not any(isinstance(f, _Blocker) for f in sys.meta_path):
        already = [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]
        if already:
            raise MegatronBlocked(f"megatron-core was imported before the block: {already[:3]}")
        sys.meta_path.insert(0, _Blocker())


_MULTI_RANK = re.compile(r"_world(\d+|s)\.py$")
WORLD_SIZES = (2, 4)  # the sizes tests/_worlds.py marks (tests/test_megatron_use.py checks)


def test_files(world: Optional[int]) -> Iterable[Path]:
    """The single-process test files (``world`` None) or those of one world size, in
    ``tests/`` and its folders. Multi-rank files end in ``_world<N>.py`` (one world size) or
    ``_worlds.py`` (tests parametrised over the sizes of ``tests/_worlds.py``, each case
    marked with its own: listed for each of those sizes)."""
    tests = ROOT / "tests"
    for path in sorted([*tests.glob("test_*.py"), *tests.glob("*/test_*.py")]):
        multi = _MULTI_RANK.search(path.name)
        if world is None:
            if not multi:
                yield path
        elif multi and multi.group(1) == str(world):
            yield path
        elif multi and multi.group(1) == "s" and world in WORLD_SIZES:
            yield path


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, help="the multi-rank files of this world size")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--involved", action="store_true")
    which.add_argument("--free", action="store_true")
    args = p.parse_args(argv)
    for path in test_files(args.world):
        if involves_megatron(path) == args.involved:
            print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
