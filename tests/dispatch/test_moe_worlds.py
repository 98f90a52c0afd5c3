"""FlatMoELayer at EP=2 and EP=4 (gloo) against Megatron's alltoall dispatcher, and the tiny
MoE GPT through the equivalence harness: a full step at EP=2 (plain and grouped-GEMM experts),
EP=4 and PP=2 x EP=2.

Same weights, same routing (Megatron's RouterReplay) → same MoE output, input gradient,
router gradient and expert gradients; Megatron's aux loss and z-loss are on and untouched.
Unchunked LLEP on a plain-EP plan feeds every expert exactly the rows the alltoall
dispatcher does, so there the results are bitwise equal; otherwise fp32 rounding (see
``_moe_layers.RTOL``). Each case is marked with its world size (``tests/_worlds.py``).
"""


import pytest
import torch
import torch.distributed as dist

from tests._worlds import per_world
from tests.dispatch import _moe_layers as helpers


def flat(mode="pipelined", **kw):
    from megatron_flat.config import FlatConfig

    kw.setdefault("llep_min_tokens_per_gemm", 1)
    return FlatConfig(dispatch=mode, **kw)


# world size -> name: (topk, profile, seq length per rank, micro-batch,
#                      {variant: FlatConfig kwargs})
CASES = {
    2: {
        "balanced": (2, "balanced", [6, 6], 2, {
            "llep-plain-ep": dict(mode="llep"),
            "pipelined-strided": dict(dispatch_chunk_tokens=4),
            "pipelined-contiguous": dict(dispatch_chunk_tokens=5, dispatch_membership="contiguous"),
        }),
        "heavy-skew": (2, "0.9/1", [8, 8], 2, {
            "llep": dict(mode="llep", llep_imbalance_threshold=0.0),
            "pipelined": dict(dispatch_chunk_tokens=4, llep_imbalance_threshold=0.0),
            # The first 2 of 4 chunks keep their graphs (Megatron's MLP with autograd) instead
            # of being recomputed (fc2's forward skipped): bitwise the "pipelined" variant.
            "pipelined-kept": dict(dispatch_chunk_tokens=4, llep_imbalance_threshold=0.0,
                                   dispatch_saved_chunks=2),
            # Grouped experts: one grouped call per chunk for each rank's own experts (no effect
            # on SequentialMLP); recomputed, saved and unchunked.
            "pipelined-grouped-calls": dict(dispatch_chunk_tokens=4, llep_imbalance_threshold=0.0,
                                            dispatch_grouped_calls=True),
            "pipelined-kept-grouped-calls": dict(dispatch_chunk_tokens=4,
                                                 llep_imbalance_threshold=0.0,
                                                 dispatch_saved_chunks=2,
                                                 dispatch_grouped_calls=True),
            "llep-grouped-calls": dict(mode="llep", llep_imbalance_threshold=0.0,
                                       dispatch_grouped_calls=True),
        }),
        "one-rank-receives-nothing": (1, "1/1", [5, 5], 2, {
            "plain-ep": dict(dispatch_chunk_tokens=3, llep_imbalance_threshold=1e9),
            "llep": dict(dispatch_chunk_tokens=3, llep_imbalance_threshold=0.0),
        }),
        "ragged-n": (2, "0.7/2", [3, 9], 2, {
            "pipelined": dict(dispatch_chunk_tokens=4, llep_imbalance_threshold=0.0),
            "llep-plain-ep": dict(mode="llep", llep_imbalance_threshold=1e9),
        }),
        "n-below-k": (2, "0.8/1", [1, 3], 1, {
            "pipelined": dict(dispatch_chunk_tokens=1, llep_imbalance_threshold=0.0),
        }),
        "k1": (2, "0.8/1", [5, 4], 2, {
            "pipelined": dict(dispatch_chunk_tokens=64, llep_imbalance_threshold=0.0),
        }),
    },
    4: {
        "balanced": (2, "balanced", [4, 4, 4, 4], 2, {
            "llep-plain-ep": dict(mode="llep"),
            "pipelined": dict(dispatch_chunk_tokens=3),
        }),
        "heavy-skew": (2, "0.95/1", [6, 6, 6, 6], 2, {
            "llep": dict(mode="llep", llep_imbalance_threshold=0.0),
            "pipelined": dict(dispatch_chunk_tokens=4, llep_imbalance_threshold=0.0),
        }),
        "three-ranks-receive-nothing": (1, "1/1", [3, 3, 3, 3], 2, {
            "plain-ep": dict(dispatch_chunk_tokens=2, llep_imbalance_threshold=1e9),
        }),
        "ragged-n-below-k": (2, "0.6/2", [1, 2, 7, 4], 1, {
            "pipelined": dict(dispatch_chunk_tokens=1, dispatch_membership="contiguous",
                              llep_imbalance_threshold=0.0),
        }),
    },
}
SEEDS = {2: 50, 4: 70}  # per-rank input seeds: SEEDS[world] + rank


def _check_stats(world, case, name, stats, rank, seqs, mb):
    """What each case's plan must show, beyond equality with the stock layer."""
    if name.startswith("llep-plain-ep") and world == 2:
        assert stats.num_chunks == 1 and not stats.llep
    if case == "heavy-skew":
        if world == 2:
            assert stats.llep and stats.plan.weight_transfers
        else:  # expert 0's rows spill to at least two helpers
            assert len({h for e, _, h in stats.plan.weight_transfers if e == 0}) >= 2
    if case == "one-rank-receives-nothing" and name == "plain-ep":
        assert (sum(stats.received) == 0) == (rank == 1)
    if case == "three-ranks-receive-nothing":
        assert (sum(stats.received) == 0) == (rank != 0)
    if case == "n-below-k":  # c = 1: K = max N = 3 on both ranks; rank 0 has N = 1
        assert stats.num_chunks == max(seqs) * mb == 3
    if case == "ragged-n-below-k":
        assert stats.num_chunks == 7
    if case == "k1":
        assert stats.num_chunks == 1
    if name.startswith("pipelined-kept"):
        assert stats.saved_chunks == 2 and stats.num_chunks == 4


@pytest.mark.parametrize("world, case", per_world({w: list(c) for w, c in CASES.items()}))
def test_layer_matches_alltoall(world, case, megatron_cpu):
    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    assert dist.get_world_size() == world
    topk, profile, seqs, mb, variants = CASES[world][case]
    rank = dist.get_rank()
    tiny = TinyMoE(num_experts=2 * world, topk=topk)
    s = seqs[rank]
    gen = torch.Generator().manual_seed(SEEDS[world] + rank)
    x = torch.randn(s, mb, tiny.hidden_size, generator=gen)
    g = torch.randn(s, mb, tiny.hidden_size, generator=gen)
    ids = routing_profile(profile, s * mb, tiny.num_experts, topk)
    problems, results = {}, {}
    with megatron_layout(ep=world):
        stock, layers = helpers.build_pair(tiny, world,
                                           {n: flat(**kw) for n, kw in variants.items()})
        want = helpers.run(stock, x, g, ids)
        for name, layer in layers.items():
            got = results[name] = helpers.run(layer, x, g, ids)
            stats = layer.flat_dispatch.last
            exact = name.startswith("llep-plain-ep")
            problems[name] = helpers.differences(want, got, exact=exact)
            assert max(stats.received) <= stats.receive_bound
            _check_stats(world, case, name, stats, rank, seqs, mb)
    assert problems == {name: [] for name in variants}
    if "pipelined-kept" in results:
        assert helpers.differences(results["pipelined"], results["pipelined-kept"],
                                   exact=True) == []


GROUPED_CASES = {2: ("balanced", "heavy-skew", "one-rank-receives-nothing"),
                 4: ("balanced", "heavy-skew", "three-ranks-receive-nothing")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world, case", per_world(GROUPED_CASES))
@pytest.mark.parametrize("kind", helpers.GROUPED_KINDS + (helpers.BIASED_KIND,))
def test_grouped_layer_matches_alltoall(kind, world, case, dtype, megatron_cpu):
    """FlatMoELayer with grouped-GEMM experts against the stock alltoall layer with the same
    experts: every variant of the case (chunked, spilled, kept chunks); see
    ``_moe_layers.check_grouped_layer``."""
    variants = CASES[world][case][4]
    helpers.check_grouped_layer(kind, CASES[world][case], dtype, world,
                                {n: flat(**kw) for n, kw in variants.items()})


@pytest.mark.world(2)
@pytest.mark.parametrize("profile", ["balanced", "1/1", "0.7/1"])
@pytest.mark.parametrize("kind", helpers.GROUPED_KINDS)
def test_grouped_reference_equals_sequential_at_ep2(kind, profile, megatron_cpu):
    """The CPU grouped-GEMM reference at EP=2 (stock alltoall dispatcher): grouped experts
    equal SequentialMLP (bitwise for TEGroupedMLP; see test_grouped_reference.py), including
    a rank that receives no rows ("1/1": every route to expert 0)."""
    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    if helpers.grouped_experts_spec(kind) is None:
        pytest.skip("megatron-core 0.19 has no GroupedMLP (TEGroupedMLP is tested)")
    rank = dist.get_rank()
    tiny = TinyMoE(num_experts=4)
    gen = torch.Generator().manual_seed(60 + rank)
    x = torch.randn(5, 2, tiny.hidden_size, generator=gen)
    g = torch.randn(5, 2, tiny.hidden_size, generator=gen)
    ids = routing_profile(profile, 10, tiny.num_experts, tiny.topk)
    with megatron_layout(ep=2):
        sequential, grouped = helpers.build_grouped_pair(tiny, 2, kind)
        assert grouped.experts.num_local_experts == tiny.num_experts // 2
        assert helpers.grouped_differences(sequential, grouped, x, g, ids,
                                           exact=kind == "te-grouped-mlp") == []


# ---------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def tiny():
    """The GPT of the whole-model steps: 4 experts at EP=2, 8 at EP=4 (two per rank)."""
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE() if dist.get_world_size() == 2 else TinyMoE(num_experts=8)


@pytest.fixture(scope="module")
def reference(megatron_cpu, tiny):
    from megatron_flat.testing.equivalence import run_reference

    return run_reference(tiny)


def _flat_gpt_step(tiny, reference, layout_kw, flat_kw):
    """The tiny MoE GPT's run of ``Layout(**layout_kw)`` with FlatMoELayer (per
    ``flat(**flat_kw)``, built by Megatron's own spec functions): (result, the flat layers)."""
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import flat_moe_specs
    from megatron_flat.testing.equivalence import Layout, run_layout

    built = []

    def record(model):
        built.extend(m for m in model.modules() if isinstance(m, FlatMoELayer))
        return model

    with flat_moe_specs(flat(**flat_kw)):
        result = run_layout(tiny, Layout(**layout_kw), reference, wrap_model=record)
    return result, built


GPT_LAYOUTS = {
    # 32 tokens per micro-batch per rank; c = 8 -> K = 4 chunks; lambda 0 + m 1 -> LLEP spills.
    "ep2-pipelined": (dict(ep=2), dict(dispatch_chunk_tokens=8, llep_imbalance_threshold=0.0)),
    "ep2-llep": (dict(ep=2), dict(mode="llep", llep_imbalance_threshold=0.0)),
    "ep2-pipelined-recompute-moe": (
        dict(ep=2, recompute="selective", recompute_modules=("moe",)),
        dict(dispatch_chunk_tokens=8, dispatch_membership="contiguous")),
}


@pytest.mark.world(2)
@pytest.mark.parametrize("name", list(GPT_LAYOUTS))
def test_gpt_step_matches_stock_model(name, tiny, reference):
    """Loss and every gradient (and the parameters after two AdamW steps) of the tiny MoE GPT
    with FlatMoELayer — built by Megatron's own spec functions — equal the stock model's."""
    from megatron_flat.testing.equivalence import assert_equivalent

    layout_kw, flat_kw = GPT_LAYOUTS[name]
    result, built = _flat_gpt_step(tiny, reference, layout_kw, flat_kw)
    assert len(built) == tiny.num_layers
    assert_equivalent(result, reference)
    assert result.grads is not None
    stats = [layer.flat_dispatch.last for layer in built]
    assert all(s.num_chunks == (1 if "llep" in name else 4) for s in stats)
    if flat_kw.get("llep_imbalance_threshold") == 0.0:  # the spill path really ran
        assert all(s.llep for s in stats) and any(s.plan.weight_transfers for s in stats)
    # MoE-module recompute: the layer's own checkpoint region ends at its output, so after
    # the first step's verification its re-runs are graph-only.
    verdicts = [layer.flat_dispatch.verdict for layer in built]
    if "recompute" in name:
        assert all(v.graph_only and v.graph_only_calls > 0 for v in verdicts), verdicts
    else:
        assert all(v.watched_calls == 0 for v in verdicts)


GROUPED_GPT_LAYOUTS = {
    "ep2-pipelined": dict(ep=2),
    "ep2-pipelined-full-recompute": dict(ep=2, recompute="full"),
    # Both layers in one checkpointed region: layer 1's MoE output feeds layer 2's norm.
    "ep2-pipelined-full-recompute-2": dict(ep=2, recompute="full", recompute_num_layers=2),
    # One grouped call per chunk for each rank's own experts (--flat-dispatch-grouped-calls).
    "ep2-pipelined-grouped-calls": dict(ep=2, recompute="full"),
}


@pytest.fixture(scope="module")
def grouped_reference(megatron_cpu):
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE(grouped_gemm=True)
    return tiny, run_reference(tiny)


@pytest.mark.world(2)
@pytest.mark.parametrize("name", list(GROUPED_GPT_LAYOUTS))
def test_grouped_gpt_step_matches_stock_model(name, grouped_reference):
    """The tiny MoE GPT with grouped-GEMM experts (0.16: GroupedMLP; 0.19: TEGroupedMLP on
    the CPU grouped linears) and FlatMoELayer (chunked, LLEP spilling) against the stock
    single-rank grouped model: loss, every gradient, the parameters after two AdamW steps;
    also inside Megatron's full recompute."""
    from megatron_flat.megatron import compat
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import flat_moe_specs
    from megatron_flat.testing.equivalence import Layout, assert_equivalent, run_layout

    tiny, reference = grouped_reference
    built, native_calls = [], []

    def record(model):
        built.extend(m for m in model.modules() if isinstance(m, FlatMoELayer))
        for layer in built:  # count the grouped calls over each rank's native experts
            bank = layer.flat_dispatch.experts
            for name in ("run_native", "run_native_for_grad", "run_native_saving"):
                if hasattr(bank, name):
                    method = getattr(bank, name)
                    setattr(bank, name, lambda *a, _m=method, **k: (native_calls.append(1),
                                                                     _m(*a, **k))[1])
        return model

    grouped_calls = name.endswith("grouped-calls")
    with flat_moe_specs(flat(dispatch_chunk_tokens=8, llep_imbalance_threshold=0.0,
                             dispatch_grouped_calls=grouped_calls)):
        result = run_layout(tiny, Layout(**GROUPED_GPT_LAYOUTS[name]), reference,
                            wrap_model=record)
    assert len(built) == tiny.num_layers
    kind = "GroupedMLP" if compat.grouped_mlp_class() is not None else "TEGroupedMLP"
    assert all(type(layer.experts).__name__ == kind for layer in built)
    # With grouped calls on, each chunk's native experts run in one grouped call.
    assert bool(native_calls) == grouped_calls
    assert_equivalent(result, reference)
    stats = [layer.flat_dispatch.last for layer in built]
    assert all(s.num_chunks == 4 and s.llep for s in stats)
    assert any(s.plan.weight_transfers for s in stats)
    # Graph-only recompute: the first step's re-run verifies, later re-runs skip the dispatch
    # for an MoE layer last in its checkpointed region; a layer whose output feeds the next
    # layer inside the region keeps its values (and says why).
    verdicts = [layer.flat_dispatch.verdict for layer in built]
    layout = GROUPED_GPT_LAYOUTS[name]
    if layout.get("recompute") != "full":
        assert all(v.watched_calls == 0 for v in verdicts)
    elif layout.get("recompute_num_layers", 1) == 1:
        assert all(v.graph_only and v.graph_only_calls > 0 for v in verdicts)
    else:
        assert verdicts[0].graph_only is False and verdicts[0].graph_only_calls == 0
        assert "computed from the MoE output" in verdicts[0].reason
        assert verdicts[1].graph_only and verdicts[1].graph_only_calls > 0


GPT_LAYOUTS_4 = {
    "ep4-pipelined": (dict(ep=4), dict(dispatch_chunk_tokens=8, llep_imbalance_threshold=0.0)),
    "pp2-ep2-pipelined": (dict(pp=2, ep=2), dict(dispatch_chunk_tokens=8,
                                                 llep_imbalance_threshold=0.0)),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("name", list(GPT_LAYOUTS_4))
def test_gpt_step_at_ep4_and_pp2_matches_stock_model(name, tiny, reference):
    from megatron_flat.testing.equivalence import assert_equivalent

    layout_kw, flat_kw = GPT_LAYOUTS_4[name]
    result, built = _flat_gpt_step(tiny, reference, layout_kw, flat_kw)
    assert len(built) == tiny.num_layers // layout_kw.get("pp", 1)
    assert_equivalent(result, reference)
    assert all(layer.flat_dispatch.last.num_chunks == 4 for layer in built)
