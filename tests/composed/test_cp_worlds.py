"""Context parallelism, each layout with full recompute: stock equals the single-rank model,
and each technique, and all four on, equal stock (see ``_cp.py`` for what each test proves).

- 2 ranks: CP 2 alone (with Megatron's distributed optimizer, so OffloadStreamAdamW's shards
  are over the data- × context-parallel group) and CP 2 × EP 2 (the experts' group spans the
  CP peers); all four also at CP 2 × EP 2 with an MTP head (its label and mask rolls cross the
  CP ranks).
- 4 ranks: CP 2 × PP 2 with 1F1B (Ring-DTP on the last stage only) and the distributed
  optimizer; CP 2 × TP 2 × EP 2 (sequence parallelism, experts without expert-TP); CP 2 × TP 2
  with experts at Megatron's default expert-TP (= TP 2, EP 1). There PipelinedLLEP must refuse
  the layout, once, clearly: it needs expert-TP 1, and TP 2 with expert-TP 1 needs EP > 1 (at
  EP 1 Megatron does not reduce the replicated experts' gradients over the TP peers, which see
  different tokens: the harness reports their replicas disagree).
"""

import functools

import pytest

from tests._worlds import per_world
from tests.composed import _cp as cp

# world size -> layout name -> (layout, model overrides, techniques that must equal stock)
ALL = tuple(cp.TECHNIQUES)
LAYOUTS = {
    2: {
        "cp2-distopt": (dict(cp=2, recompute="full", distributed_optimizer=True), {}, ALL),
        "cp2-ep2": (dict(cp=2, ep=2, recompute="full"), {}, ALL),
        "cp2-ep2-mtp": (dict(cp=2, ep=2, recompute="full"), dict(mtp_num_layers=1), ()),
    },
    4: {
        "cp2-pp2-distopt": (dict(cp=2, pp=2, recompute="full", distributed_optimizer=True),
                            {}, ALL),
        # 32 tokens: each rank keeps a quarter (CP 2 × SP 2), 16 per step's microbatch of 2,
        # so PipelinedLLEP's 8-token chunks make several.
        "cp2-tp2-ep2": (dict(cp=2, tp=2, etp=1, ep=2, recompute="full"),
                        dict(seq_length=32), ALL),
        "cp2-tp2": (dict(cp=2, tp=2, recompute="full"), {},
                    ("ring-dtp", "sco", "offload-adamw")),
    },
}
ALL_FOUR = {2: ["cp2-distopt", "cp2-ep2", "cp2-ep2-mtp"], 4: ["cp2-pp2-distopt", "cp2-tp2-ep2"]}


@functools.lru_cache(maxsize=None)
def case(world, name):
    """One layout's runs, made once, by the first test that needs them."""
    from megatron_flat.testing.equivalence import Layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    layout, model, _ = LAYOUTS[world][name]
    return cp.CPCase(TinyMoE(**model), Layout(**layout))


def _with_techniques():
    return [pytest.param(world, name, technique, marks=pytest.mark.world(world),
                         id=f"world{world}-{name}-{technique}")
            for world, layouts in LAYOUTS.items()
            for name, (_, _, techniques) in layouts.items() for technique in techniques]


STOCK = {world: [name for name, (_, _, t) in layouts.items() if t]
         for world, layouts in LAYOUTS.items()}


@pytest.mark.parametrize("world, name", per_world(STOCK))
def test_stock_cp_equals_single_rank(megatron_cpu, world, name):
    case(world, name).assert_stock_matches_single_rank()


@pytest.mark.parametrize("world, name, technique", _with_techniques())
def test_technique_under_cp_equals_stock(megatron_cpu, world, name, technique):
    case(world, name).assert_technique_matches_stock(technique)


@pytest.mark.parametrize("world, name", per_world(ALL_FOUR))
def test_all_four_under_cp_equal_stock(megatron_cpu, world, name):
    case(world, name).assert_all_four_match_stock()


@pytest.mark.world(4)
def test_pipelined_llep_refuses_expert_tp(megatron_cpu):
    with pytest.raises(ValueError, match="expert_tensor_parallel_size"):
        case(4, "cp2-tp2").assert_technique_matches_stock("pipelined-llep")
