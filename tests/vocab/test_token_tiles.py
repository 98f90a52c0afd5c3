"""Ring-DTP's token tiles at P = 1: each strip computed ``tile_rows`` tokens at a time.

Against the dense fp64 reference within the errors dense fp32 itself has (the same tolerances
as the untiled op), against the untiled op to fp32 reordering, bitwise on a rerun, and the
working set: peak minus (inputs, returned gradients, fp32 accumulators, per-token vectors)
stays within one tile (1.25 tiles for half inputs) whatever N is."""

import pytest
import torch

from megatron_flat.runtime import MemoryMeter
from megatron_flat.vocab import ring_dtp_cross_entropy
from megatron_flat.vocab.plan import describe_rank, make_plan
from megatron_flat.vocab.strips import token_tiles

TILE = 16 * 1024  # bytes: 16 tokens of a 256-wide fp32 strip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 37, 200])
def test_matches_dense(ring_ref, dtype, n) -> None:
    p = ring_ref.make_problem([n], vocab_size=700, dtype=dtype, seed=n, mask_every=5,
                              ignore_every=7)
    ring_ref.check_rank(p, 0, block_size=256, tile_bytes=TILE)


def test_tiny_tiles_narrow_the_strips(ring_ref) -> None:
    """A tile smaller than one token's strip narrows the strips (still exact)."""
    p = ring_ref.make_problem([20], vocab_size=300, seed=3)
    ring_ref.check_rank(p, 0, block_size=256, tile_bytes=64)
    row = describe_rank(torch.zeros(20, 8), torch.zeros(300, 8), torch.zeros(20, dtype=torch.long),
                        torch.ones(20, dtype=torch.bool), mode="auto", vocab_start=None,
                        vocab_size=None, block_size=256, tile_bytes=64)
    plan = make_plan(row.unsqueeze(0), 0)
    assert plan.block_size == 16 and plan.tile_rows(0) == 1


def test_tiles_follow_the_plan() -> None:
    assert token_tiles(10, None) == [(0, 10)] and token_tiles(10, 20) == [(0, 10)]
    assert token_tiles(10, 4) == [(0, 4), (4, 8), (8, 10)]
    row = describe_rank(torch.zeros(100, 8), torch.zeros(1000, 8),
                        torch.zeros(100, dtype=torch.long), torch.ones(100, dtype=torch.bool),
                        mode="auto", vocab_start=None, vocab_size=None, block_size=250,
                        tile_bytes=TILE)
    plan = make_plan(row.unsqueeze(0), 0)
    assert plan.blocks(0) == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert plan.tile_rows(0) == TILE // (250 * 4)
    assert plan.acc_bytes == 4


@pytest.mark.parametrize("bad", [0, -5, True])
def test_bad_tile_bytes_raise(bad) -> None:
    with pytest.raises(ValueError, match="tile_bytes"):
        ring_dtp_cross_entropy(torch.randn(3, 4), torch.randn(8, 4),
                               torch.zeros(3, dtype=torch.long), tile_bytes=bad)


def _run(x, w, labels, grad, **kwargs):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = ring_dtp_cross_entropy(x, w, labels, **kwargs)
    dx, dw = torch.autograd.grad(loss, (x, w), grad)
    return loss, dx, dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_equals_untiled_to_reordering_and_reruns_bitwise(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    n, h, v = 300, 16, 1000
    x = torch.randn(n, h, generator=gen).to(dtype)
    w = torch.randn(v, h, generator=gen).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    grad = torch.randn(n, generator=gen)
    whole = _run(x, w, labels, grad, block_size=256)
    tiled = _run(x, w, labels, grad, block_size=256, tile_bytes=TILE)
    again = _run(x, w, labels, grad, block_size=256, tile_bytes=TILE)
    assert all(torch.equal(a, b) for a, b in zip(tiled, again))
    # Per token the folds are the untiled ones: the loss to the GEMM's row split.
    torch.testing.assert_close(tiled[0], whole[0], rtol=1e-6, atol=1e-6)
    # dW sums over tokens in another order: fp32 rounding. Half inputs on CPU round each row
    # chunk's product to the input dtype (no fp32-output GEMM here), and tiles make more
    # chunks: a few of the input dtype's ulps at the gradient's scale (against fp64 both are
    # within test_matches_dense's tolerances).
    for a, b in zip(tiled[1:], whole[1:]):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            scale = float(b.float().abs().max())
            assert float((a.float() - b.float()).abs().max()) <= 8 * 2.0**-8 * scale


def _transient(n: int, dtype: torch.dtype, tile_bytes) -> int:
    """Peak of forward + backward minus what the contract allows besides the tile."""
    h, v, block = 16, 2048, 256
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(v, h, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    with MemoryMeter("cpu") as meter:
        loss = ring_dtp_cross_entropy(x, w, labels, block_size=block, tile_bytes=tile_bytes)
        loss.sum().backward()
    grads = (n * h + v * h) * dtype.itemsize  # returned gradients
    accumulators = n * h * 4 + block * h * 4  # fp32 dX, one fp32 dW block
    per_token = 16 * n * 4 + 8192  # labels, state, lse, grad, masks; slack
    return meter.peak_device_bytes - grads - accumulators - per_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_working_set_is_one_tile_whatever_n(dtype) -> None:
    factor = 1.0 if dtype == torch.float32 else 1.25
    # N from 16 to 64 tiles: the transient stays one tile (each tile is a metered pass of
    # Python ops, so larger N only costs test time).
    for n in (256, 1024):
        assert _transient(n, dtype, TILE) <= factor * TILE, n
    # Untiled, the strip grows with N (1024 tokens: a 1 MiB strip).
    assert _transient(1024, dtype, None) > 32 * TILE
