"""All four techniques on vs off over 4 ranks: TP=2 with sequence parallelism (Ring-DTP's
ring is the TP group; experts at EP=2 without expert-TP, which PipelinedLLEP requires) and
PP=2 with 1F1B (Ring-DTP on the last stage only), each with full recompute and Megatron's
distributed optimizer (gloo); and the TP=2 layout with a tied model and an MTP head (every
MTP head's projection + loss on the same ring)."""


import pytest

pytestmark = pytest.mark.world(4)

from tests.composed import _composed as composed

LAYOUTS = {
    "tp2-sp-etp1-ep2": dict(tp=2, etp=1, ep=2, recompute="full"),
    "pp2-ep2-distopt": dict(pp=2, ep=2, recompute="full", distributed_optimizer=True),
    "tp2-sp-etp1-ep2-mtp-tied": dict(tp=2, etp=1, ep=2, recompute="full"),  # with an MTP head
}
# The tiny model's variant per layout (TinyMoE fields); default: the plain tiny model.
MODELS = {"tp2-sp-etp1-ep2-mtp-tied": dict(mtp_num_layers=1, share_embeddings=True)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_all_four_on_equals_all_four_off(megatron_cpu, name):
    from megatron_flat.testing.equivalence import Layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    composed.assert_composed_equal(TinyMoE(**MODELS.get(name, {})), Layout(**LAYOUTS[name]))
