"""All four techniques on vs off (``_composed.py``), gloo.

2 ranks, EP=2 (DP=2 for the dense part): with full recompute, with and without Megatron's
distributed optimizer, with an MTP head, with grouped-GEMM experts, with module recompute (two
SCO boundaries per layer), and with delayed copies (SCO's and OffloadStreamAdamW's side-stream
copies land late, their destinations poison until a wait makes them due: a missing wait fails
the comparison).

4 ranks: TP=2 with sequence parallelism (Ring-DTP's ring is the TP group; experts at EP=2
without expert-TP, which PipelinedLLEP requires) and PP=2 with 1F1B (Ring-DTP on the last
stage only), each with full recompute and Megatron's distributed optimizer; and the TP=2
layout with a tied model and an MTP head (every MTP head's projection + loss on the same ring).
"""


import pytest

from tests._worlds import per_world
from tests.composed import _composed as composed

LAYOUTS = {
    2: {
        "ep2": dict(ep=2, recompute="full"),
        "ep2-distopt": dict(ep=2, recompute="full", distributed_optimizer=True),
        "ep2-mtp": dict(ep=2, recompute="full"),  # with an MTP head
        "ep2-grouped": dict(ep=2, recompute="full"),  # grouped-GEMM experts
        "ep2-selective": dict(ep=2, recompute="selective",
                              recompute_modules=("core_attn", "moe")),
        "ep2-distopt-delayed-copies": dict(ep=2, recompute="full", distributed_optimizer=True),
        "ep2-selective-delayed-copies": dict(ep=2, recompute="selective",
                                             recompute_modules=("core_attn", "moe")),
    },
    4: {
        "tp2-sp-etp1-ep2": dict(tp=2, etp=1, ep=2, recompute="full"),
        "pp2-ep2-distopt": dict(pp=2, ep=2, recompute="full", distributed_optimizer=True),
        # with an MTP head
        "tp2-sp-etp1-ep2-mtp-tied": dict(tp=2, etp=1, ep=2, recompute="full"),
    },
}
# The tiny model's variant per layout (TinyMoE fields); default: the plain tiny model.
MODELS = {"ep2-mtp": dict(mtp_num_layers=1), "ep2-grouped": dict(grouped_gemm=True),
          "tp2-sp-etp1-ep2-mtp-tied": dict(mtp_num_layers=1, share_embeddings=True)}


@pytest.mark.parametrize("world, name", per_world(LAYOUTS))
def test_all_four_on_equals_all_four_off(megatron_cpu, world, name):
    from contextlib import nullcontext

    from megatron_flat.runtime import streams
    from megatron_flat.testing.equivalence import Layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    delayed = name.endswith("delayed-copies")
    before = streams.delayed_copy_count()
    with streams.delayed_copies() if delayed else nullcontext():
        composed.assert_composed_equal(TinyMoE(**MODELS.get(name, {})),
                                       Layout(**LAYOUTS[world][name]))
    if delayed:  # SCO's offloads and reloads, the optimizer's uploads and write-backs
        assert streams.delayed_copy_count() - before > 100
