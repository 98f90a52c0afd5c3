"""All four techniques on vs off at EP=2 (DP=2 for the dense part), with full recompute,
with and without Megatron's distributed optimizer, with an MTP head, with grouped-GEMM
experts, with module recompute (two SCO boundaries per layer), and with delayed copies (SCO's
and OffloadStreamAdamW's side-stream copies land late, their destinations poison until a
wait makes them due: a missing wait fails the comparison) (2 ranks, gloo)."""


import pytest

pytestmark = pytest.mark.world(2)

from tests.composed import _composed as composed

LAYOUTS = {
    "ep2": dict(ep=2, recompute="full"),
    "ep2-distopt": dict(ep=2, recompute="full", distributed_optimizer=True),
    "ep2-mtp": dict(ep=2, recompute="full"),  # with an MTP head
    "ep2-grouped": dict(ep=2, recompute="full"),  # grouped-GEMM experts
    "ep2-selective": dict(ep=2, recompute="selective", recompute_modules=("core_attn", "moe")),
    "ep2-distopt-delayed-copies": dict(ep=2, recompute="full", distributed_optimizer=True),
    "ep2-selective-delayed-copies": dict(ep=2, recompute="selective",
                                         recompute_modules=("core_attn", "moe")),
}
# The tiny model's variant per layout (TinyMoE fields); default: the plain tiny model.
MODELS = {"ep2-mtp": dict(mtp_num_layers=1), "ep2-grouped": dict(grouped_gemm=True)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_all_four_on_equals_all_four_off(megatron_cpu, name):
    from contextlib import nullcontext

    from megatron_flat.runtime import streams
    from megatron_flat.testing.equivalence import Layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    delayed = name.endswith("delayed-copies")
    before = streams.delayed_copy_count()
    with streams.delayed_copies() if delayed else nullcontext():
        composed.assert_composed_equal(TinyMoE(**MODELS.get(name, {})), Layout(**LAYOUTS[name]))
    if delayed:  # SCO's offloads and reloads, the optimizer's uploads and write-backs
        assert streams.delayed_copy_count() - before > 100
