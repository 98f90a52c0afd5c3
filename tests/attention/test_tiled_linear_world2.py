"""The attention block's tiled projections on a tensor-parallel group of 2 (gloo): outputs
and every gradient against the stock sequence-parallel arithmetic (all-gather the whole
sequence, one GEMM, reduce-scatter), and the working set flat in N."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flat.attention import (
    SequenceTiles,
    tiled_gather_linear,
    tiled_linear_reduce_scatter,
)
from megatron_flat.runtime import MemoryMeter

pytestmark = pytest.mark.world(2)


def _problem(n_local, tp, hidden, out, seed, dtype=torch.float32):
    """One global problem every rank builds alike: the whole sequence, the whole weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tp * n_local, 2, hidden, generator=g).to(dtype)
    w = torch.randn(tp * out, hidden, generator=g).to(dtype)
    b = torch.randn(tp * out, generator=g).to(dtype)
    grad = torch.randn(tp * n_local, 2, tp * out, generator=g).to(dtype)
    return x, w, b, grad


@pytest.mark.parametrize("rows", [8, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_projection_equals_stock(dist_world, rows, dtype):
    """Y = all_gather(X) @ W_rᵀ + b_r; dX_r = reduce_scatter(dY_r @ W_r); dW_r, db_r."""
    rank, tp, n_local, out = dist.get_rank(), dist.get_world_size(), 24, 6
    x, w, b, grad = _problem(n_local, tp, 16, out, seed=rows, dtype=dtype)
    cols = slice(rank * out, (rank + 1) * out)
    mine = slice(rank * n_local, (rank + 1) * n_local)
    x_r = x[mine].clone().requires_grad_()
    w_r, b_r = w[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()
    y = tiled_gather_linear(x_r, w_r, SequenceTiles(n_local, tp, rows), bias=b_r,
                            group=dist.group.WORLD)
    y.backward(grad[..., cols])
    # Stock: the whole gathered sequence through one GEMM; dX summed over the ranks in order.
    assert torch.equal(y, F.linear(x, w[cols], b[cols]))
    partials = [grad[..., q * out:(q + 1) * out] @ w[q * out:(q + 1) * out] for q in range(tp)]
    assert torch.equal(x_r.grad, (partials[0] + partials[1])[mine])
    # half precision: fp32 tile sums, rounded once to the weight dtype (as stock's one GEMM)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-8, atol=2**-8)
    g_r = grad[..., cols].reshape(-1, out).float()
    torch.testing.assert_close(w_r.grad.float(), g_r.t() @ x.reshape(-1, 16).float(), **tol)
    torch.testing.assert_close(b_r.grad.float(), g_r.sum(0), **tol)


@pytest.mark.parametrize("rows", [8, 5, 64])
def test_output_projection_equals_stock(dist_world, rows):
    """Y_r = reduce_scatter(Z_r @ W_rᵀ)[rows of r]; dZ_r = all_gather(dY) @ W_r; dW_r."""
    rank, tp, n_local, hidden, inner = dist.get_rank(), dist.get_world_size(), 24, 16, 6
    g = torch.Generator().manual_seed(100 + rows)
    z = torch.randn(tp * n_local, 2, tp * inner, generator=g)
    w = torch.randn(hidden, tp * inner, generator=g)
    grad = torch.randn(tp * n_local, 2, hidden, generator=g)
    cols = slice(rank * inner, (rank + 1) * inner)
    mine = slice(rank * n_local, (rank + 1) * n_local)
    z_r = z[..., cols].clone().requires_grad_()
    w_r = w[:, cols].clone().requires_grad_()
    y = tiled_linear_reduce_scatter(z_r, w_r, SequenceTiles(n_local, tp, rows),
                                    group=dist.group.WORLD)
    y.backward(grad[mine])
    partials = [F.linear(z[..., q * inner:(q + 1) * inner], w[:, q * inner:(q + 1) * inner])
                for q in range(tp)]
    assert torch.equal(y, (partials[0] + partials[1])[mine])
    assert torch.equal(z_r.grad, grad @ w[:, cols])
    torch.testing.assert_close(w_r.grad, grad.reshape(-1, hidden).t() @ z[..., cols].reshape(
        -1, inner), rtol=1e-5, atol=1e-5)


def _peak(n_local, rows):
    """Peak bytes of forward + backward of both projections (QKV-like, then output-like)."""
    tp, hidden, out = dist.get_world_size(), 64, 32
    rank = dist.get_rank()
    x, w, _, grad = _problem(n_local, tp, hidden, out, seed=n_local)
    x_r = x[rank * n_local:(rank + 1) * n_local].clone().requires_grad_()
    w_r = w[rank * out:(rank + 1) * out].clone().requires_grad_()
    w_o = torch.randn(hidden, out).requires_grad_()
    g_r = grad[..., rank * out:(rank + 1) * out].clone()
    del x, w, grad
    tiles = SequenceTiles(n_local, tp, rows)
    with MemoryMeter("cpu") as meter:
        y = tiled_gather_linear(x_r, w_r, tiles, group=dist.group.WORLD)  # N x out
        h = tiled_linear_reduce_scatter(y, w_o, tiles, group=dist.group.WORLD)
        torch.autograd.backward([y, h], [g_r, torch.ones_like(h)])
    return meter.peak_device_bytes


def test_the_gathered_sequence_never_exists(dist_world):
    """Against the same ops with one tile (the whole gathered N × H at once, as stock):
    tiling removes the gathered N × H from the peak, and the tiled peak grows with N only by
    the N·H/TP tensors (stock's grows by those and the gathered N × H)."""
    tp, hidden = dist.get_world_size(), 64
    gathered = {n: tp * n * 2 * hidden * 4 for n in (256, 2048)}  # fp32, micro-batch 2
    tiled = {n: _peak(n, 16) for n in gathered}
    whole = {n: _peak(n, n) for n in gathered}
    print(f"peak bytes, tiles of 16 rows per rank: {tiled}; one tile: {whole}; gathered "
          f"N x H: {gathered}")
    for n in gathered:
        assert whole[n] - tiled[n] >= 0.9 * gathered[n], (n, whole, tiled)
    growth = gathered[2048] - gathered[256]
    assert tiled[2048] - tiled[256] <= whole[2048] - whole[256] - 0.9 * growth
