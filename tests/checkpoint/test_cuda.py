"""SCO on CUDA: real side streams, pinned pool, allocator-measured bound (skipped without CUDA).

Boundaries are large (64 MiB) so each device-to-host copy is still running when the
next layer's forward and even the backward start: a reload that did not wait for its
offload event would read unfinished host bytes and break the bitwise comparison.
"""

from __future__ import annotations

import pytest
import torch

from megatron_flat.checkpoint import SelectiveCheckpointOffload
from megatron_flat.runtime import MemoryMeter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

S, B, H = 8192, 2, 1024  # boundary 64 MiB fp32


def _run(stack, depth, ck):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(stack.Block(H) for _ in range(depth)).cuda()
    x = torch.randn(S, B, H, device="cuda", requires_grad=True)
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(7)
    torch.cuda.synchronize()
    with MemoryMeter("cuda") as m:
        loss = stack.forward(blocks, x, ck)
        loss.backward()
        torch.cuda.synchronize()
    grads = [x.grad] + [p.grad for p in blocks.parameters()]
    return loss.detach(), grads, m.peak_device_bytes


def test_bitwise_and_no_race_on_streams(stack):
    ref = _run(stack, 4, stack.plain)
    for prefetch in (0, 1, 2):
        sco = SelectiveCheckpointOffload(4 * S * B * H * 4, prefetch=prefetch)
        assert sco.pool.pinned
        got = _run(stack, 4, sco.checkpoint)
        assert torch.equal(ref[0], got[0])
        for u, v in zip(ref[1], got[1]):
            assert torch.equal(u, v)
        sco.synchronize()
        s = sco.stats
        assert s.boundaries_offloaded == 4 and s.host_bytes_in_use == 0
        assert s.max_restored_on_device <= prefetch + 1


def test_device_peak_flat_in_depth(stack):
    bb = S * B * H * 4
    peaks = {}
    for depth in (2, 6):
        sco = SelectiveCheckpointOffload(depth * bb)
        peaks[depth] = _run(stack, depth, sco.checkpoint)[2]
    plain = {d: _run(stack, d, stack.plain)[2] for d in (2, 6)}
    assert abs(peaks[6] - peaks[2]) < bb
    assert plain[6] - plain[2] >= 4 * bb * 0.99
