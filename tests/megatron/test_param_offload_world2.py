"""Param offload at EP 2: PipelinedLLEP spills the overloaded rank's experts to the other,
whose weights leave the owner's slot (the layer's weights are up while it dispatches) and
whose weight gradients come back into the owner's gradient slot before it drains. Every
rank's loss, input and router gradients, expert main_grads and updated weights bitwise equal
to the same run with the experts resident; the plans did transfer weights."""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig
from megatron_flat.megatron.param_offload import attach_param_offload
from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from tests.megatron import _param_offload as harness

pytestmark = pytest.mark.world(2)

TINY = TinyMoE(num_experts=4, topk=2, num_layers=3)


def _batches(rank: int, direction: torch.Tensor):
    g = torch.Generator().manual_seed(30 + rank)
    return [[torch.randn(8, 2, TINY.hidden_size, generator=g) + 2.0 * direction
             for _ in range(2)] for _ in range(2)]


@pytest.mark.parametrize("kind", ["sequential", "te-grouped-mlp"])
@pytest.mark.parametrize("recompute", ["megatron", "non-reentrant"])
def test_spilled_experts_come_from_the_slots(megatron_cpu, kind, recompute):
    flat = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8,
                      llep_imbalance_threshold=0.0, llep_min_tokens_per_gemm=1)
    direction = torch.nn.functional.normalize(
        torch.randn(TINY.hidden_size, generator=torch.Generator().manual_seed(5)), dim=0)
    batches = _batches(dist.get_rank(), direction)
    with megatron_layout(ep=2):
        resident = harness.build_stack(TINY, 2, kind, 3, torch.float32, flat)
        harness.skew_router(resident, direction)
        harness.resident_main_grads(resident)
        want, want_transfers = harness.train(resident, batches, recompute)
        stack = harness.build_stack(TINY, 2, kind, 3, torch.float32, flat)
        harness.skew_router(stack, direction)
        offload = attach_param_offload(stack, tier=host_tiers.HostTier())
        got, transfers = harness.train(stack, batches, recompute, offload)
    assert harness.differences(want, got) == []
    assert transfers == want_transfers > 0
    assert offload.stats.demand_fetches == 0
