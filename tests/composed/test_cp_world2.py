"""Context parallelism at 2 ranks: CP 2 alone (with Megatron's distributed optimizer, so
OffloadStreamAdamW's shards are over the data- × context-parallel group) and CP 2 × EP 2 (the
experts' group spans the CP peers), each with full recompute; and all four on at CP 2 × EP 2
with an MTP head (its label and mask rolls cross the CP ranks). See ``_cp.py`` for what each
test proves."""

import functools

import pytest

pytestmark = pytest.mark.world(2)

from tests.composed import _cp as cp

LAYOUTS = {
    "cp2-distopt": dict(cp=2, recompute="full", distributed_optimizer=True),
    "cp2-ep2": dict(cp=2, ep=2, recompute="full"),
    "cp2-ep2-mtp": dict(cp=2, ep=2, recompute="full"),  # with an MTP head
}
MODELS = {"cp2-ep2-mtp": dict(mtp_num_layers=1)}


@functools.lru_cache(maxsize=None)
def case(name):
    from megatron_flat.testing.equivalence import Layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return cp.CPCase(TinyMoE(**MODELS.get(name, {})), Layout(**LAYOUTS[name]))


@pytest.mark.parametrize("name", ["cp2-distopt", "cp2-ep2"])
def test_stock_cp_equals_single_rank(megatron_cpu, name):
    case(name).assert_stock_matches_single_rank()


@pytest.mark.parametrize("technique", list(cp.TECHNIQUES))
@pytest.mark.parametrize("name", ["cp2-distopt", "cp2-ep2"])
def test_technique_under_cp_equals_stock(megatron_cpu, name, technique):
    case(name).assert_technique_matches_stock(technique)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_all_four_under_cp_equal_stock(megatron_cpu, name):
    case(name).assert_all_four_match_stock()
