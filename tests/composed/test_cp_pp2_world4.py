"""Context parallelism at 4 ranks: CP 2 × PP 2 with 1F1B (Ring-DTP on the last stage only) and
Megatron's distributed optimizer, with full recompute. Stock equals the single-rank model; each
technique, and all four, equal stock. See ``_cp.py`` for what each test proves. (One layout per
file: each torchrun process keeps the gloo threads of every group it made.)"""


import pytest

pytestmark = pytest.mark.world(4)

from tests.composed import _cp as cp

globals().update(cp.layout_tests(dict(cp=2, pp=2, recompute="full",
                                           distributed_optimizer=True)))
