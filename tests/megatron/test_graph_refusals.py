"""The CUDA-graph settings SCO and attention replay refuse, one message each, before anything
is built (install's checks), in every release's spelling."""

import argparse

import pytest

from megatron_flat.config import FlatConfig
from megatron_flat.megatron import install as inst
from megatron_flat.megatron.graph_refusals import replay_graph_problems, sco_graph_problems

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
CORE_ATTN = dict(recompute_granularity="selective")  # Megatron's default module: core_attn

# (settings, the words the one message must hold)
SCO_REFUSED = {
    "full-iteration-0.19": (dict(FULL, cuda_graph_impl="full_iteration"),
                            "--cuda-graph-impl full_iteration captures the whole training"),
    "full-iteration-0.16": (dict(FULL, cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]),
                            "--cuda-graph-scope full_iteration captures the whole training"),
    "whole-layers": (dict(FULL, cuda_graph_impl="transformer_engine"), "captures whole layers"),
    "enable-cuda-graph": (dict(FULL, enable_cuda_graph=True), "captures whole layers"),
    "local-attn": (dict(FULL, cuda_graph_impl="local", cuda_graph_modules=["attn"]),
                   "local graphs wrap each layer"),
    # the case the flat dispatcher's refusal suggests: core_attn recompute inside attn graphs
    "core-attn-in-attn": (dict(CORE_ATTN, cuda_graph_impl="transformer_engine",
                               cuda_graph_scope=["attn"]), "captures the recompute of core_attn"),
    "core-attn-in-attn-0.19": (dict(CORE_ATTN, cuda_graph_impl="transformer_engine",
                                    cuda_graph_modules=["attn", "mamba"]),
                               "--cuda-graph-modules attn mamba captures the recompute of"),
    "moe-in-moe": (dict(recompute_granularity="selective", recompute_modules=["moe"],
                        cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe"]),
                   "captures the recompute of moe"),
    "moe-layer-recompute-0.16": (dict(moe_layer_recompute=True,
                                      cuda_graph_impl="transformer_engine",
                                      cuda_graph_scope=["moe"]), "captures the recompute of moe"),
}
SCO_ACCEPTED = {
    "no-graphs": dict(FULL),
    "graph-none": dict(FULL, cuda_graph_impl="none", cuda_graph_scope=["attn"]),
    # graphs inside a checkpointed region: SCO's work runs before the region, uncaptured
    "full-recompute-attn-graphs": dict(FULL, cuda_graph_impl="transformer_engine",
                                       cuda_graph_scope=["attn"]),
    "moe-recompute-attn-graphs": dict(recompute_granularity="selective",
                                      recompute_modules=["moe"],
                                      cuda_graph_impl="transformer_engine",
                                      cuda_graph_modules=["attn"]),
    "core-attn-router-graphs": dict(CORE_ATTN, cuda_graph_impl="transformer_engine",
                                    cuda_graph_scope=["moe_router"]),
}


@pytest.mark.parametrize("name", sorted(SCO_REFUSED))
def test_sco_refuses_graphs_that_capture_its_checkpoint_calls(name):
    settings, words = SCO_REFUSED[name]
    problems = sco_graph_problems(argparse.Namespace(**settings))
    assert len(problems) == 1 and words in problems[0], problems
    assert problems[0].startswith("--flat-sco: ") and "--cuda-graph-impl none" in problems[0]
    # install reports it with the rest, before anything is built
    assert problems[0] in inst.check_against_megatron(FlatConfig(sco=True),
                                                      argparse.Namespace(**settings))


@pytest.mark.parametrize("name", sorted(SCO_ACCEPTED))
def test_sco_accepts_graphs_inside_its_regions(name):
    config = argparse.Namespace(**SCO_ACCEPTED[name])
    assert sco_graph_problems(config) == []


REPLAY_REFUSED = {
    "full-iteration": (dict(FULL, cuda_graph_impl="full_iteration"), "whole training iteration"),
    "whole-layers": (dict(FULL, cuda_graph_impl="transformer_engine", cuda_graph_scope=["full"]),
                     "whole layers"),
    "attn": (dict(FULL, cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]),
             "--cuda-graph-scope attn captures attention"),
    "attn-0.19": (dict(FULL, cuda_graph_impl="transformer_engine",
                       cuda_graph_modules=["attn", "moe_router"]),
                  "--cuda-graph-modules attn moe_router captures attention"),
}


@pytest.mark.parametrize("name", sorted(REPLAY_REFUSED))
def test_replay_refuses_graphs_that_capture_attention(name):
    settings, words = REPLAY_REFUSED[name]
    problems = replay_graph_problems(argparse.Namespace(**settings))
    assert len(problems) == 1 and words in problems[0], problems
    assert problems[0].startswith("--flat-attn-replay: ")
    assert problems[0] in inst.check_against_megatron(FlatConfig(attn_replay=True),
                                                      argparse.Namespace(**settings))


def test_replay_accepts_graphs_without_attention():
    for settings in (dict(FULL), dict(FULL, cuda_graph_impl="transformer_engine",
                                      cuda_graph_modules=["mamba", "moe_router"])):
        assert replay_graph_problems(argparse.Namespace(**settings)) == []
