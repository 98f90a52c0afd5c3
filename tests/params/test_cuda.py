"""Param offload on CUDA: real copy streams and pinned host memory (skipped without CUDA).

Layers are large enough (2 × 32 MiB of bf16 weights each) that a copy is still running when
the compute stream would use its slot: a missing wait reads a half-written slot or drains a
gradient that is not yet written, and the bitwise comparison fails (the mutation suite's
``--gpu`` run adds a sleep before every side-stream copy to make sure of it)."""

import pytest
import torch

from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.testing.expert_stack import ExpertStack, make_weights, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("checkpoint", ["reentrant", "non-reentrant"])
def test_offloaded_training_on_cuda_is_bitwise_the_resident_one(checkpoint):
    weights = make_weights(4, hidden=1024, ffn=4096, experts=4, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    batches = [[torch.randn(4096, 1024, generator=g).to(torch.bfloat16).cuda()
                for _ in range(2)] for _ in range(2)]
    resident = train(ExpertStack(weights, offload=False, checkpoint=checkpoint,
                                 device="cuda"), batches)
    stack = ExpertStack(weights, offload=True, checkpoint=checkpoint, device="cuda",
                        tier=host_tiers.HostTier())
    offloaded = train(stack, batches)
    torch.cuda.synchronize()
    for key in ("losses", "input_grads"):
        assert all(torch.equal(a, b) for a, b in zip(resident[key], offloaded[key])), key
    for a, b in zip(resident["weights"], offloaded["weights"]):
        assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))
    assert stack.offload.stats.demand_fetches == 0


def test_first_fetch_waits_for_the_slots_previous_user():
    """The slots are fresh blocks of the current stream's pool. Work queued there before may
    still write that memory (here: a sleep, then a fill of a freed block of the slots' size);
    the first fetch runs on the copy stream and must wait for it, or the late fill
    overwrites the fetched weights."""
    from megatron_flat.params import ParamOffload

    g = torch.Generator().manual_seed(7)
    layers = [[torch.randn(2048, 2048, generator=g).to(torch.bfloat16)] for _ in range(2)]
    on_device = [[w.cuda() for w in ws] for ws in layers]
    torch.cuda.synchronize()
    stale = torch.empty(2048 * 2048 * 2, dtype=torch.uint8, device="cuda")  # a slot's size
    torch.cuda._sleep(200_000_000)  # the fill below runs late on the current stream
    stale.fill_(0xFF)
    del stale  # its block goes back to the current stream's pool with the fill pending
    offload = ParamOffload(on_device, device="cuda", tier=host_tiers.HostTier())
    (weight,) = offload.acquire(0)
    torch.cuda.synchronize()
    assert torch.equal(weight.cpu(), layers[0][0])
    offload.release(0)
    offload.close()
