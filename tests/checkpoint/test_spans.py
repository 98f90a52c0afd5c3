"""Byte spans: aliasing inputs share one copy and come back as views of one buffer."""

from __future__ import annotations

import torch

from megatron_flat.checkpoint.spans import plan_spans, rebuild, span_bytes


def _round_trip(tensors):
    spans, metas = plan_spans(tensors)
    buffers = [span_bytes(s).clone() for s in spans]  # the "reloaded" copies
    return spans, [rebuild(buffers[i], meta) for i, meta in metas]


def test_same_storage_one_span_and_views_rebuilt():
    x = torch.arange(24, dtype=torch.float32).view(4, 6)
    y = torch.randn(5)
    big = torch.zeros(100)
    tensors = [x, x, x[1:3, 2:], x.t(), y, x.view(torch.int32)[2], big[10:20]]
    spans, out = _round_trip(tensors)
    assert len(spans) == 3
    assert [s.nbytes for s in spans] == [96, 20, 40]  # only big's addressed bytes
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    # aliasing inside a span survives: all of x's views share the one buffer
    assert len({t.untyped_storage().data_ptr() for t in out[:4] + [out[5]]}) == 1
    out[0][0, 0] = -1.0
    assert out[3][0, 0] == -1.0 and out[1][0, 0] == -1.0


def test_span_start_aligned_for_every_member_dtype():
    raw = torch.arange(64, dtype=torch.uint8)
    as_int = raw[4:].view(torch.int32)  # starts at byte 4
    odd = raw[5:9]  # starts at byte 5
    spans, out = _round_trip([odd, as_int[1:3]])
    assert spans[0].lo == 4  # rounded down to a multiple of 4 (int32)
    assert torch.equal(out[0], odd) and torch.equal(out[1], as_int[1:3])
