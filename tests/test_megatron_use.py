"""tests/_megatron_use.py: which test files can reach megatron-core, and the block that proves
the others free of it (what lets CI's second megatron-core version skip them)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_megatron_use_under_test",
                                               ROOT / "tests" / "_megatron_use.py")
use = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(use)


def _write(folder: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_what_counts_as_involved(tmp_path):
    plain = _write(tmp_path, "test_plain.py", """
        import torch
        from megatron_flat.vocab import ring_dtp_cross_entropy
        def test_x():
            pass
        """)
    assert not use.involves_megatron(plain)
    fixture = _write(tmp_path, "test_fixture.py", "def test_x(megatron_cpu):\n    pass\n")
    assert use.involves_megatron(fixture)
    process = _write(tmp_path, "test_process.py", "import subprocess\n")
    assert use.involves_megatron(process)
    # A lazy import in a sibling helper loaded by path, two steps away.
    _write(tmp_path, "_inner.py", "def f():\n    from megatron.core import parallel_state\n")
    _write(tmp_path, "_outer.py", "import _inner\n")
    by_path = _write(tmp_path, "test_by_path.py", """
        import importlib.util, pathlib
        spec = importlib.util.spec_from_file_location(
            "_outer", pathlib.Path(__file__).with_name("_outer.py"))
        """)
    assert use.involves_megatron(by_path)
    # Through the project's own modules: the Megatron glue imports megatron-core.
    glue = _write(tmp_path, "test_glue.py", "from megatron_flat.megatron import spec\n")
    assert use.involves_megatron(glue)


def test_the_suite_splits_and_the_known_files_land_where_they_belong():
    involved = {p.relative_to(ROOT).as_posix() for p in use.test_files(None)
                if use.involves_megatron(p)}
    free = {p.relative_to(ROOT).as_posix() for p in use.test_files(None)} - involved
    assert "tests/megatron/test_install.py" in involved
    assert "tests/patches/test_rehearse.py" in involved
    assert "tests/plan/test_fit.py" in free and "tests/runtime/test_memory.py" in free
    assert "tests/test_megatron_use.py" in involved  # top-level files too (it starts a process)
    assert not any(p.endswith(("_world2.py", "_world4.py", "_worlds.py"))
                   for p in involved | free)
    worlds = {n: {p.relative_to(ROOT).as_posix() for p in use.test_files(n)} for n in (2, 3, 4)}
    assert "tests/dispatch/test_graph_only_world2.py" in worlds[2] - worlds[4]
    # a file of several world sizes is listed for each size it marks, and only those
    assert "tests/vocab/test_ring_dtp_worlds.py" in worlds[2] & worlds[4]
    assert not any(p.endswith("_worlds.py") for p in worlds[3])
    from tests import _worlds

    assert tuple(w.values[0] for w in _worlds.WORLDS) == use.WORLD_SIZES


def test_the_block_raises_where_an_import_error_would_be_forgiven():
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("u", {str(ROOT / "tests" / "_megatron_use.py")!r})
        u = importlib.util.module_from_spec(spec); spec.loader.exec_module(u)
        u.block_megatron()
        import megatron_flat.plan  # the project itself stays importable
        try:
            import megatron.core
        except ImportError:
            print("import error (would be skipped)")
        except u.MegatronBlocked as err:
            print("blocked:", err)
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("blocked: import of 'megatron' in a test file classified "
                                  "megatron-free"), done.stdout
