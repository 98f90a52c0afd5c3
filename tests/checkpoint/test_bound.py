"""The measured bound: restored boundaries on the device <= prefetch + 1, flat in depth."""

from __future__ import annotations

import pytest
import torch

from megatron_flat.checkpoint import SelectiveCheckpointOffload
from megatron_flat.runtime import MemoryMeter


def _measure(stack, depth: int, ck_factory):
    """Held bytes after forward, peak of forward+backward, peak of backward; in boundaries.

    Gradients exist before the meter opens (as Megatron's grad buffers do), so the
    figures are activations and boundaries only.
    """
    blocks, x = stack.make_stack(depth), stack.make_input()
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    x.requires_grad_()
    ck = ck_factory()
    torch.manual_seed(7)
    with MemoryMeter("cpu") as meter:
        loss = stack.forward(blocks, x, ck)
        held = meter.current_device_bytes()
        with meter.section("backward") as bwd:
            loss.backward()
        del loss
    bb = stack.boundary_bytes()
    return held / bb, meter.peak_device_bytes / bb, bwd.peak_device_bytes / bb


_NO_PREFETCH_BWD: dict = {}  # depth -> backward peak with prefetch 0 (shared by params)


def _sco(budget: int, prefetch: int, keep: list):
    def factory():
        sco = SelectiveCheckpointOffload(budget, prefetch=prefetch, device="cpu")
        keep.append(sco)
        return sco.checkpoint

    return factory


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_restored_boundaries_at_most_prefetch_plus_one(stack, prefetch):
    depth = 8
    keep: list = []
    _, _, bwd = _measure(stack, depth, _sco(1 << 24, prefetch, keep))
    s = keep[0].stats
    assert s.max_restored_on_device == prefetch + 1  # bound reached: prefetch really runs ahead
    # With prefetch, the first boundary of the backward is reloaded when its region's output
    # gradient exists (the loss's backward overlaps it): none waits for a reload on demand.
    assert s.reloads_on_demand == (depth if prefetch == 0 else 0)
    assert s.prefetch_hits == depth - s.reloads_on_demand
    # the meter agrees: each prefetched boundary adds at most one boundary to the peak
    if prefetch == 0:
        _NO_PREFETCH_BWD[depth] = bwd
    else:
        bwd0 = _NO_PREFETCH_BWD.get(depth)
        if bwd0 is None:
            _, _, bwd0 = _measure(stack, depth, _sco(1 << 24, 0, []))
        assert bwd <= bwd0 + prefetch + 0.01


@pytest.mark.inline_copies(reason="device bytes freed when offloads finish at issue")
def test_device_boundary_bytes_flat_in_depth(stack):
    keep: list = []
    plain = {d: _measure(stack, d, lambda: stack.plain) for d in (4, 16)}
    sco = {d: _measure(stack, d, _sco(1 << 24, 1, keep)) for d in (4, 16)}
    loss = 4 / stack.boundary_bytes()  # the fp32 loss scalar, in boundaries
    # after forward plain checkpoint holds one boundary per layer (+ the output); SCO
    # only the output; both the loss: byte counts, exact
    assert plain[4][0] == 5 + loss and plain[16][0] == 17 + loss
    assert sco[4][0] == 1 + loss and sco[16][0] == 1 + loss
    # peaks: plain grows by the 12 extra boundaries, SCO by less than one boundary
    assert plain[16][1] - plain[4][1] >= 12 - 0.01
    assert abs(sco[16][1] - sco[4][1]) < 1
    assert abs(sco[16][2] - sco[4][2]) < 1
    assert all(k.stats.max_restored_on_device <= 2 for k in keep)


@pytest.mark.filterwarnings("ignore:SCO. host pool full")
@pytest.mark.inline_copies(reason="device bytes freed when offloads finish at issue")
def test_partial_budget_holds_only_the_overflow(stack):
    """Boundaries past the budget are what stays on the device between forward and backward."""
    depth = 8
    bb = stack.boundary_bytes()
    keep: list = []
    held, _, _ = _measure(stack, depth, _sco(5 * bb, 1, keep))
    s = keep[0].stats
    assert s.boundaries_offloaded == 5 and s.boundaries_kept == 3
    # the 3 boundaries past the budget (the last layers' inputs) plus the output and the loss
    assert held == 4 + 4 / bb
    assert s.max_restored_on_device <= 2
