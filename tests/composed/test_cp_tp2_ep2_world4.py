"""Context parallelism at 4 ranks: CP 2 × TP 2 × EP 2 (sequence parallelism, experts without
expert-TP), with full recompute. Stock equals the single-rank model; each technique, and all
four, equal stock. See ``_cp.py`` for what each test proves. (One layout per file: each torchrun
process keeps the gloo threads of every group it made.)"""


import pytest

pytestmark = pytest.mark.world(4)

from tests.composed import _cp as cp

# 32 tokens: each rank keeps a quarter (CP 2 × SP 2), 16 per step's microbatch of 2, so
# PipelinedLLEP's 8-token chunks make several.
globals().update(cp.layout_tests(dict(cp=2, tp=2, etp=1, ep=2, recompute="full"),
                                 model=dict(seq_length=32)))
