"""Param offload is exact: losses, input gradients, every main_grad and every weight after
several steps bitwise equal to the same stack with its weights resident, in fp32 and bf16,
over 2 microbatches, with every recompute style (and none). Copies are counted by the cost
ledger; a schedule the slots cannot serve is refused."""

import pytest
import torch

from megatron_flat.checkpoint.offload import SelectiveCheckpointOffload
from megatron_flat.params import ParamOffload, ParamOffloadError
from megatron_flat.runtime import CostLedger
from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.runtime.streams import delayed_copy_count, delaying
from megatron_flat.testing.expert_stack import CHECKPOINTS, ExpertStack, make_weights, train


def _batches(dtype, steps=2, microbatches=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(12, 8, generator=g).to(dtype) for _ in range(microbatches)]
            for _ in range(steps)]


def _stack(weights, offload, checkpoint):
    sco = SelectiveCheckpointOffload(1 << 20, device="cpu") if checkpoint == "sco" else None
    return ExpertStack(weights, offload=offload, checkpoint=checkpoint, sco=sco)


def _assert_equal(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
    assert all(torch.equal(x, y) for x, y in zip(a["input_grads"], b["input_grads"]))
    for step_a, step_b in zip(a["main_grads"], b["main_grads"]):
        for layer_a, layer_b in zip(step_a, step_b):
            assert all(torch.equal(x, y) for x, y in zip(layer_a, layer_b))
    for layer_a, layer_b in zip(a["weights"], b["weights"]):
        assert all(torch.equal(x, y) for x, y in zip(layer_a, layer_b))


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_training_is_bitwise_the_resident_one(dtype, checkpoint):
    weights, batches = make_weights(5, dtype=dtype), _batches(dtype)
    delayed = delayed_copy_count()
    offloaded = _stack(weights, True, checkpoint)
    result = train(offloaded, batches)
    _assert_equal(train(_stack(weights, False, checkpoint), batches), result)
    assert result["losses"][0] != result["losses"][2]  # the update changed the weights
    stats = offloaded.offload.stats
    # per step: 5 fetches for the first forward, 3 in its backward (the last two layers are
    # still in their slots), 3 and 3 for the second microbatch (layers 0 and 1 are); after
    # the last update, layer 0's new weights for a next step
    assert (stats.fetches, stats.demand_fetches, stats.acquisitions) == (29, 0, 40)
    assert (stats.grad_zeroings, stats.grad_uploads, stats.drains) == (10, 10, 20)
    # the running sums go up while the layer above runs its backward: all but the top one
    assert stats.grad_uploads_ahead == 8
    if delaying():  # FLAT_DELAYED_COPIES=1: the copies really landed late
        assert delayed_copy_count() - delayed >= stats.fetches + stats.drains


def test_the_ledger_counts_every_copy_and_one_sync_per_step():
    weights, batches = make_weights(4), _batches(torch.float32, steps=1)
    stack = _stack(weights, True, "non-reentrant")
    plan = stack.offload.plan
    # at set-up, layer 0's weights went up; after the update, its new ones do (next step)
    assert stack.offload.stats.h2d_bytes == plan.slot_weight_bytes
    with CostLedger() as ledger:
        train(stack, batches)
    assert ledger.h2d_bytes == stack.offload.stats.h2d_bytes - plan.slot_weight_bytes
    assert ledger.d2h_bytes == stack.offload.stats.d2h_bytes == 2 * plan.microbatch_bytes()[1]
    # under the plan's bound: a slot that still holds its layer is not fetched again (the
    # last two layers at each forward/backward turnaround, the first two when the second
    # microbatch's forward follows the first one's backward)
    bound = plan.microbatch_bytes(first=True)[0] + plan.microbatch_bytes(first=False)[0]
    assert ledger.h2d_bytes == bound - 6 * plan.slot_weight_bytes
    # pinned, non-blocking copies: the one sync is the step's wait for the drains
    assert ledger.syncs == 1 and dict(ledger.sync_kinds) == {"stream_synchronize": 1}


def test_a_layer_whose_slot_is_in_use_is_refused():
    offload = ParamOffload(make_weights(4))
    offload.acquire(0)
    with pytest.raises(ParamOffloadError, match="weight slot 0, still in use by layer 0"):
        offload.acquire(2)
    offload.release(0)
    offload.acquire(2)  # served once layer 0 is done
    offload.acquire_grads(1)
    with pytest.raises(ParamOffloadError, match="still holding layer 1's undrained gradient"):
        offload.acquire_grads(3)
    offload.drain(1)
    offload.acquire_grads(3)
    with pytest.raises(ParamOffloadError, match="no layer 4"):
        offload.acquire(4)


def test_a_host_budget_the_node_cannot_hold_is_refused_before_allocating():
    tier = host_tiers.HostTier(node_budget_bytes=4096, local_ranks=2)
    with pytest.raises(host_tiers.HostTierError, match="param offload"):
        ParamOffload(make_weights(4), tier=tier)
    assert tier.allocated_bytes == {}


def test_the_host_tier_holds_every_layer_and_the_device_two_slots():
    tier = host_tiers.HostTier()
    offload = ParamOffload(make_weights(6), tier=tier)
    assert tier.allocated_bytes == {"param offload": offload.plan.host_bytes}
    assert offload.plan.device_bytes == 2 * (offload.plan.slot_weight_bytes
                                             + offload.plan.slot_grad_bytes)
    # a layer's device tensors are the same objects each time, main_grad attached
    assert offload.weights(2)[0] is offload.weights(2)[0]
    assert offload.weights(2)[0].main_grad.dtype == torch.float32


def test_a_dropped_offload_lets_its_copies_land_first():
    """A param offload dropped without close() (a model freed mid-run) waits for its copies
    in flight before its slots and host buffer can go; under delayed copies the first
    layer's fetch, started at construction, is still queued when it is dropped."""
    import gc

    from megatron_flat.runtime.streams import delayed_copies, pending_copy_count

    weights = make_weights(2, hidden=8, ffn=16, experts=2, dtype=torch.float32)
    with delayed_copies():
        offload = ParamOffload(weights, tier=host_tiers.HostTier())
        assert pending_copy_count() > 0
        del offload
        gc.collect()
        assert pending_copy_count() == 0
