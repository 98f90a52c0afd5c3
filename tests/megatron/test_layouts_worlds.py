"""Megatron-Core's own layouts at 2 and 4 ranks agree with the single-rank model.

Covers what the CPU backend must run: MoE with the alltoall and allgather dispatchers at
EP=2 and EP=4, TP=2 with sequence parallelism, PP=2 with the 1F1B schedule, the distributed
optimizer at DP=2, full recompute (uniform and block) and selective recompute, and at 4 ranks
EP combined with TP and with PP. Tolerances: see ``megatron_flat.testing.equivalence`` (fp32
reduction order).
"""

import pytest
import torch
import torch.distributed as dist

LAYOUTS_2 = {
    "ep2-alltoall": dict(ep=2),
    "ep2-allgather": dict(ep=2, dispatcher="allgather"),
    "tp2-sp": dict(tp=2),
    "pp2-1f1b": dict(pp=2),
    "dp2-distopt": dict(distributed_optimizer=True),
    "ep2-recompute-full-uniform": dict(ep=2, recompute="full"),
    "tp2-recompute-full-block": dict(tp=2, recompute="full", recompute_method="block"),
    "pp2-recompute-full": dict(pp=2, recompute="full"),
    "ep2-recompute-selective": dict(ep=2, recompute="selective",
                                    recompute_modules=("layernorm", "core_attn", "moe")),
}
LAYOUTS_4 = {
    "ep4-alltoall": dict(ep=4),
    "ep4-allgather": dict(ep=4, dispatcher="allgather"),
    "tp2-ep2": dict(tp=2, ep=2),
    "pp2-ep2-recompute-full": dict(pp=2, ep=2, recompute="full"),
}
LAYOUTS = {**LAYOUTS_2, **LAYOUTS_4}
CASES = ([pytest.param(name, marks=pytest.mark.world(2)) for name in LAYOUTS_2]
         + [pytest.param(name, marks=pytest.mark.world(4)) for name in LAYOUTS_4])


@pytest.fixture(scope="module")
def tiny():
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE()


@pytest.fixture(scope="module")
def reference(megatron_cpu, tiny):
    from megatron_flat.testing.equivalence import run_reference

    return run_reference(tiny)


@pytest.mark.parametrize("name", CASES)
def test_layout_matches_single_rank(name, tiny, reference):
    from megatron_flat.testing.equivalence import Layout, assert_equivalent, run_layout

    layout = Layout(**LAYOUTS[name])
    result = run_layout(tiny, layout, reference)
    assert len(result.losses) == 2
    assert result.losses[1] != result.losses[0]  # the optimizer really stepped
    assert_equivalent(result, reference)
    # The gradient check is the strong one; only the distributed optimizer skips it.
    assert (result.grads is None) == layout.distributed_optimizer
    if set(LAYOUTS[name]) <= {"pp", "recompute"}:
        # PP alone only moves activations between stages: every op of step 0 sees the
        # reference's inputs, so its loss and gradients are bitwise (the clip norm's sum over
        # the stages is reordered, so step 1 is not).
        assert result.losses[0] == reference.losses[0], (result.losses, reference.losses)
        differ = [k for k, g in reference.grads.items() if not torch.equal(result.grads[k], g)]
        assert not differ, differ


@pytest.mark.world(2)
def test_harness_catches_a_wrong_expert_shard(tiny, reference):
    """A silently corrupted expert on one rank must be reported, not averaged away."""
    from megatron_flat.testing.equivalence import Layout, mismatches, run_layout

    result = run_layout(tiny, Layout(ep=2), reference, wrap_model=_CorruptAfterLoad)
    problems = mismatches(result, reference)
    assert any("experts" in p for p in problems), problems


class _CorruptAfterLoad:
    """Wraps a built model so its first forward sees one expert weight scaled on rank 1."""

    def __new__(cls, model):
        hook_state = {"done": False}

        def pre_hook(module, args):
            if not hook_state["done"]:
                hook_state["done"] = True
                if dist.get_rank() == 1:
                    with torch.no_grad():
                        for name, p in module.named_parameters():
                            if "experts" in name:
                                p.mul_(1.5)
                                break

        model.register_forward_pre_hook(pre_hook)
        return model


@pytest.mark.world(2)
def test_full_tensors_rejects_disagreeing_replicas(tiny, megatron_cpu):
    """Norm weights are replicated over TP; if the replicas differ, gathering says so."""
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.equivalence import full_tensors
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, transformer_config

    with megatron_layout(tp=2):
        model = build_tiny_gpt(tiny, transformer_config(tiny, tp=2))
        full_tensors([model])  # consistent: fine
        norm = model.decoder.final_layernorm.weight
        with torch.no_grad():
            norm.add_(float(dist.get_rank()))
        with pytest.raises(AssertionError, match="replicas of .* disagree"):
            full_tensors([model])
