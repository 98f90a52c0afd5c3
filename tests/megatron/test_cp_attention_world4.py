"""ContextParallelCoreAttention at CP 4 (eight chunks, each rank two of them): the world-2
file's equivalence test, run over four ranks."""

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.world(4)

_spec = importlib.util.spec_from_file_location(
    "_cp_attention_world2", pathlib.Path(__file__).with_name("test_cp_attention_world2.py"))
_world2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_world2)

test_cp_equals_single_rank = _world2.test_cp_equals_single_rank
