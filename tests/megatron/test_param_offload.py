"""Param offload on Megatron's MoE layers (one rank): a stack of FlatMoELayers trains bitwise
as the same stack with its experts resident — losses, input and router gradients, every
expert's main_grad and every weight after two steps of two microbatches — for SequentialMLP
and grouped experts, fp32 and bf16, with Megatron's recompute, torch's non-reentrant
checkpoint or none; the experts' device copies are gone between layers."""

import pytest
import torch

from megatron_flat.config import FlatConfig
from megatron_flat.megatron.param_offload import attach_param_offload
from megatron_flat.params import ParamOffloadError
from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from tests.dispatch import _moe_layers as helpers
from tests.megatron import _param_offload as harness

FLAT = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8, llep_imbalance_threshold=0.0)
TINY = TinyMoE(num_experts=4, topk=2, num_layers=3)


def _batches(dtype, steps=2, microbatches=2):
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(8, 2, TINY.hidden_size, generator=g).to(dtype)
             for _ in range(microbatches)] for _ in range(steps)]


def _pair(kind, dtype, recompute, depth=3):
    if kind != "sequential" and helpers.grouped_experts_spec(kind) is None:
        pytest.skip("megatron-core 0.19 has no GroupedMLP (TEGroupedMLP is tested)")
    batches = _batches(dtype)
    resident = harness.build_stack(TINY, 1, kind, depth, dtype, FLAT)
    harness.resident_main_grads(resident)
    want, _ = harness.train(resident, batches, recompute)
    stack = harness.build_stack(TINY, 1, kind, depth, dtype, FLAT)
    offload = attach_param_offload(stack, tier=host_tiers.HostTier())
    got, _ = harness.train(stack, batches, recompute, offload)
    return want, got, stack, offload


@pytest.mark.parametrize("recompute", harness.RECOMPUTES)
@pytest.mark.parametrize("kind", ["sequential", *helpers.GROUPED_KINDS, helpers.BIASED_KIND])
def test_offloaded_experts_train_bitwise_as_resident_ones(megatron_cpu, kind, recompute):
    with megatron_layout():
        want, got, stack, offload = _pair(kind, torch.float32, recompute)
    assert harness.differences(want, got) == []
    assert want["losses"][0] != want["losses"][2]  # the updates changed the model
    assert offload.stats.demand_fetches == 0 and offload.stats.drains == 2 * 2 * 3
    # between layers every expert Parameter is its host view: no device copy left
    for layer in stack.layers:
        for p in layer.experts.parameters():
            assert p.untyped_storage().data_ptr() == offload._host.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", ["sequential", "te-grouped-mlp"])
def test_bf16_experts_train_bitwise_as_resident_ones(megatron_cpu, kind):
    with megatron_layout():
        want, got, _, _ = _pair(kind, torch.bfloat16, "megatron")
    assert harness.differences(want, got) == []


def test_a_model_without_flat_moe_layers_is_refused(megatron_cpu):
    with megatron_layout():
        stack = harness.build_stack(TINY, 1, "sequential", 1, torch.float32, FlatConfig())
        with pytest.raises(ParamOffloadError, match="no flat MoE layer"):
            attach_param_offload(stack)
        flat = harness.build_stack(TINY, 1, "sequential", 1, torch.float32, FLAT)
        attach_param_offload(flat, tier=host_tiers.HostTier())
        with pytest.raises(ParamOffloadError, match="already offloaded"):
            attach_param_offload(flat)
