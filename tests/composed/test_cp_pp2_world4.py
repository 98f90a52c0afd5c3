"""Context parallelism at 4 ranks: CP 2 × PP 2 with 1F1B (Ring-DTP on the last stage only) and
Megatron's distributed optimizer, with full recompute. Stock equals the single-rank model; each
technique, and all four, equal stock. See ``_cp.py`` for what each test proves. (One layout per
file: each torchrun process keeps the gloo threads of every group it made.)"""

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.world(4)

_spec = importlib.util.spec_from_file_location("_cp", pathlib.Path(__file__).with_name("_cp.py"))
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)

globals().update(cp.layout_tests(dict(cp=2, pp=2, recompute="full",
                                           distributed_optimizer=True)))
