"""The mutation suite (scripts/mutants.py) follows the code: every anchor matches exactly once,
every mutant changes its line and names existing tests, and a moved anchor is reported."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(_spec)
sys.modules["mutants"] = mutants  # dataclasses resolve their module by name
_spec.loader.exec_module(mutants)


def test_every_anchor_matches_once():
    assert mutants.check_anchors(mutants.MUTANTS) == []


def test_a_moved_anchor_is_an_error():
    moved = mutants.Mutant("moved", mutants.TRANSFER, "no such line\n", "x\n",
                           mutants.SPAN_MOVER)
    twice = mutants.Mutant("twice", mutants.TRANSFER, "\n", "", mutants.SPAN_MOVER)
    problems = mutants.check_anchors([moved, twice])
    assert any("moved: anchor found 0 times" in p for p in problems), problems
    assert any(p.startswith("twice: anchor found") for p in problems), problems


def test_every_cpu_mutant_has_a_selection_and_every_gpu_one_a_reason():
    for m in mutants.MUTANTS:
        assert m.tests, m.name
        assert m.gpu_only == "" or len(m.gpu_only) > 20, m.name
    # the suite only grows: nine CPU-killable mutants when it was written
    assert sum(not m.gpu_only for m in mutants.MUTANTS) >= 9
