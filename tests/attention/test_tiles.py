"""Sequence tiles of the attention block: the pure plan, and the tiled projections on one
rank (no group: the tiles only bound the GEMM) against plain ``F.linear``."""

import pytest
import torch
import torch.nn.functional as F

from megatron_flat.attention import (
    SequenceTiles,
    rows_for_bytes,
    rows_for_tokens,
    tiled_gather_linear,
    tiled_linear_reduce_scatter,
)


def test_tiles_cover_each_shard_once_in_order():
    tiles = SequenceTiles(n_local=10, tp=4, rows=4)
    assert list(tiles.bounds()) == [(0, 4), (4, 8), (8, 10)]
    assert tiles.count == 3 and tiles.gathered_rows == 16
    assert list(tiles.global_rows(8, 10)) == [(8, 10), (18, 20), (28, 30), (38, 40)]
    whole = SequenceTiles(n_local=3, tp=2, rows=8)
    assert list(whole.bounds()) == [(0, 3)] and whole.gathered_rows == 6


@pytest.mark.parametrize("bad", [dict(n_local=0, tp=1, rows=1), dict(n_local=4, tp=0, rows=1),
                                 dict(n_local=4, tp=2, rows=-1), dict(n_local=4, tp=2, rows=1.5)])
def test_bad_tiles_are_refused(bad):
    with pytest.raises(ValueError, match="must be a positive int"):
        SequenceTiles(**bad)


def test_tile_size_from_tokens_or_bytes():
    assert rows_for_tokens(4096, 8) == 512 and rows_for_tokens(3, 8) == 1
    # a gathered tile of 8 ranks x rows x (b 1 x H 8192 x bf16 2 B) within 64 MiB
    assert rows_for_bytes(64 << 20, 8, 8192 * 2) == 512
    with pytest.raises(ValueError):
        rows_for_tokens(0, 8)
    with pytest.raises(ValueError):
        rows_for_bytes(1 << 20, 8, 0)


@pytest.mark.parametrize("rows", [1, 3, 7, 32])
def test_one_rank_equals_linear(rows):
    torch.manual_seed(rows)
    x = torch.randn(20, 2, 16, requires_grad=True)
    w = torch.randn(12, 16, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    g = torch.randn(20, 2, 12)
    tiles = SequenceTiles(n_local=20, tp=1, rows=rows)
    y = tiled_gather_linear(x, w, tiles, bias=b)
    ref = F.linear(x, w, b)
    # The same GEMM rows; a BLAS may pick another kernel for a few rows (a 1-row tile of
    # 2 sequences is a matrix-vector product), so rounding, not bitwise (world2 tests are).
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    got = torch.autograd.grad((y * g).sum(), (x, w, b))
    want = torch.autograd.grad((ref * g).sum(), (x, w, b))
    for a, e in zip(got, want):  # weight and bias: sums over tiles, stock's row sum reordered
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    z = x.detach().clone().requires_grad_()
    out = tiled_linear_reduce_scatter(z, w, tiles)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-6, atol=1e-6)
    got = torch.autograd.grad((out * g).sum(), (z, w))
    want = torch.autograd.grad((F.linear(x, w) * g).sum(), (x, w))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_shapes_that_do_not_fit_are_refused():
    tiles = SequenceTiles(n_local=8, tp=1, rows=4)
    with pytest.raises(ValueError, match="does not fit the tiles"):
        tiled_gather_linear(torch.randn(6, 4), torch.randn(3, 4), tiles)
    with pytest.raises(ValueError, match="does not fit the tiles"):
        tiled_gather_linear(torch.randn(8, 5), torch.randn(3, 4), tiles)
    with pytest.raises(ValueError, match="planned for TP 2"):
        tiled_linear_reduce_scatter(torch.randn(16, 4), torch.randn(3, 4),
                                    SequenceTiles(n_local=8, tp=2, rows=4))


def test_weight_gradients_into_main_grad():
    """``main_grad=True``: the tiles' fp32 sum goes into ``weight.main_grad`` (Megatron's
    gradient-accumulation fusion); the weight gets a placeholder and the flag DDP reads."""
    torch.manual_seed(3)
    x = torch.randn(12, 2, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8))
    tiles = SequenceTiles(n_local=12, tp=1, rows=5)
    with pytest.raises(ValueError, match="needs the weight's main_grad buffer"):
        tiled_gather_linear(x, w, tiles, main_grad=True)
    w.main_grad = torch.full((6, 8), 0.5)  # what earlier micro-batches left
    w.grad_added_to_main_grad = False
    g = torch.randn(12, 2, 6)
    (tiled_gather_linear(x, w, tiles, main_grad=True) * g).sum().backward()
    want = 0.5 + g.reshape(-1, 6).t() @ x.detach().reshape(-1, 8)
    torch.testing.assert_close(w.main_grad, want, rtol=1e-5, atol=1e-5)
    assert w.grad_added_to_main_grad and torch.count_nonzero(w.grad) == 0
