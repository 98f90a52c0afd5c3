"""The example launch scripts (``examples/*.sh``) are what ``scripts/emit_examples.py``
writes from the planner's current output: a planner change that moves a figure or a flag
must regenerate them (``python scripts/emit_examples.py``). Run in-process, so that the
check needs no megatron-core (a megatron-free file: CI's second version skips it)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _emitter():
    spec = importlib.util.spec_from_file_location("emit_examples",
                                                  ROOT / "scripts" / "emit_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EMIT = _emitter()


@pytest.mark.parametrize("name", sorted(EMIT.EXAMPLES))
def test_the_example_script_is_what_the_planner_emits(name):
    script = EMIT.path(name)
    assert script.is_file(), script
    assert script.read_text() == EMIT.script_text(name), (
        f"{script} is stale: run python scripts/emit_examples.py")
