"""Param offload's plan: packing, slots, host and device bytes, bytes moved, bad input."""

import pytest
import torch

from megatron_flat.params import ParamOffloadPlan, layer_layout


def test_a_layer_packs_its_weights_and_fp32_grads_aligned():
    layout = layer_layout([((4, 8), torch.bfloat16), ((8, 4), torch.bfloat16)])
    assert [(p.offset, p.nbytes) for p in layout.weights] == [(0, 64), (512, 64)]
    assert [(p.offset, p.nbytes, p.dtype) for p in layout.grads] == [
        (0, 128, torch.float32), (512, 128, torch.float32)]
    assert layout.weight_bytes == layout.grad_bytes == 1024 and layout.numel == 64
    flat = torch.arange(1024, dtype=torch.uint8)
    view = layout.weights[1].view(flat)
    assert view.shape == (8, 4) and view.dtype == torch.bfloat16
    assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_device_bytes_do_not_grow_with_depth_and_host_bytes_do():
    layer = layer_layout([((64, 128), torch.bfloat16), ((128, 64), torch.bfloat16)])
    plans = {n: ParamOffloadPlan((layer,) * n) for n in (4, 8, 16)}
    assert len({p.device_bytes for p in plans.values()}) == 1
    assert plans[4].device_bytes == 2 * layer.weight_bytes + 2 * layer.grad_bytes
    assert [plans[n].host_bytes for n in (4, 8, 16)] == [
        n * (layer.weight_bytes + layer.grad_bytes) for n in (4, 8, 16)]
    assert plans[16].resident_bytes == plans[16].host_bytes


def test_slots_alternate_and_bytes_moved_per_microbatch():
    layer = layer_layout([((4, 4), torch.float32)])
    plan = ParamOffloadPlan((layer,) * 3)
    assert [plan.slot_of(i) for i in range(3)] == [(0, 0), (1, 1), (0, 0)]
    w, g = 3 * layer.weight_bytes, 3 * layer.grad_bytes
    assert plan.microbatch_bytes(first=True) == (2 * w, g)
    assert plan.microbatch_bytes(first=False) == (2 * w + g, g)


@pytest.mark.parametrize("specs, kwargs, message", [
    ([], {}, "at least one weight"),
    ([((2, 2), torch.int32)], {}, "floating point"),
    ([((2, 2), torch.float32)], {"weight_slots": 1}, "weight_slots must be at least 2"),
    ([((2, 2), torch.float32)], {"grad_slots": 0}, "grad_slots must be at least 2"),
])
def test_bad_input_is_refused_with_one_message(specs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParamOffloadPlan((layer_layout(specs),), **kwargs)


def test_a_plan_needs_layers():
    with pytest.raises(ValueError, match="no layers"):
        ParamOffloadPlan(())
