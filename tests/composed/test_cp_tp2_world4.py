"""Context parallelism at 4 ranks: CP 2 × TP 2 with sequence parallelism, experts at
Megatron's default expert-TP (= TP 2, EP 1), with full recompute. Stock equals the single-rank
model; Ring-DTP, SCO and OffloadStreamAdamW each equal stock. PipelinedLLEP needs expert-TP 1,
and TP 2 with expert-TP 1 needs EP > 1 (at EP 1 Megatron does not reduce the replicated
experts' gradients over the TP peers, which see different tokens: the harness reports their
replicas disagree), so here it must refuse the layout, once, clearly; it and all four on run
at CP 2 × TP 2 × EP 2 (``test_cp_tp2_ep2_world4.py``). See ``_cp.py`` for what each test
proves. (One layout per file: each torchrun process keeps the gloo threads of every group it
made.)"""


import pytest

pytestmark = pytest.mark.world(4)

from tests.composed import _cp as cp

TESTS = cp.layout_tests(dict(cp=2, tp=2, recompute="full"),
                        techniques=("ring-dtp", "sco", "offload-adamw"))
globals().update(TESTS)


def test_pipelined_llep_refuses_expert_tp(megatron_cpu):
    with pytest.raises(ValueError, match="expert_tensor_parallel_size"):
        TESTS["case"]().assert_technique_matches_stock("pipelined-llep")
