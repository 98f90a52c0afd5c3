"""The attention block's two sequence-parallel projections, one sequence tile at a time.

* :func:`tiled_gather_linear` — the QKV projection: ``Y = all_gather(X) @ Wᵀ (+ b)`` with X
  this rank's ``[n_local, ..., H]`` shard and Y ``[TP·n_local, ..., out]`` (all N rows, this
  rank's output columns). Forward gathers, projects and frees one tile at a time, writing the
  tile's rows of Y at their global positions. Backward, per tile: dX's tile is
  ``reduce_scatter(dY_tile @ W)``; the weight gradient re-gathers the tile of X.
* :func:`tiled_linear_reduce_scatter` — the output projection: ``Y = reduce_scatter(Z @ Wᵀ)``
  with Z ``[TP·n_local, ..., in]`` (all N rows, this rank's input columns) and Y this rank's
  ``[n_local, ..., H]`` shard. Forward multiplies and reduce-scatters one tile at a time;
  backward all-gathers a tile of dY, writes ``dY_tile @ W`` into dZ at the tile's positions,
  and adds the tile's weight gradient.

The gathered N × H input and the N × H partial output never exist: the working set beyond the
N·H/TP tensors (X, Y, Z, their gradients) is one tile (:class:`~.tiles.SequenceTiles`).

Exactness: each output row is the same GEMM row as in the untiled projection, and each dX / Y
row the same sum over the TP ranks, so Y, dX and dZ equal stock bitwise where the GEMM kernel
computes a row independently of how many rows it is given (the CPU reference here); the weight
and bias gradients are sums over tiles, i.e. stock's sum over rows reordered (fp32 tolerance).
With a group of one rank there is nothing to gather and the tiles only bound the GEMM size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flat.attention.tiles import SequenceTiles

__all__ = ["tiled_gather_linear", "tiled_linear_reduce_scatter"]

# torch >= 2.12 names it all_gather_single (all_gather_into_tensor warns as deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather(piece: torch.Tensor, group) -> torch.Tensor:
    """``[s, ...]`` from every rank -> ``[tp·s, ...]``, rank-major."""
    tp = _size(group)
    if tp == 1:
        return piece
    out = piece.new_empty((tp * piece.shape[0],) + tuple(piece.shape[1:]))
    _all_gather(out, piece.contiguous(), group=group)
    return out


def _reduce_scatter(full: torch.Tensor, group) -> torch.Tensor:
    """``[tp·s, ...]`` summed over the ranks, this rank's ``[s, ...]``."""
    tp = _size(group)
    if tp == 1:
        return full
    out = full.new_empty((full.shape[0] // tp,) + tuple(full.shape[1:]))
    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
    return out


def _ranked(full: torch.Tensor, tp: int) -> torch.Tensor:
    """``[tp·n, ...]`` viewed as ``[tp, n, ...]``: a tile's rows are ``[:, start:stop]``."""
    return full.view((tp, full.shape[0] // tp) + tuple(full.shape[1:]))


def _tile_rows(full: torch.Tensor, tp: int, start: int, stop: int) -> torch.Tensor:
    """The gathered tile ``[start, stop)`` of a full-sequence tensor: ``[tp·(stop−start), ...]``."""
    return _ranked(full, tp)[:, start:stop].reshape((-1,) + tuple(full.shape[1:]))


def _grad_accumulator(weight: torch.Tensor) -> torch.Tensor:
    """Where the tiles' weight gradients add up: fp32 for a half-precision weight, so the sum
    over tiles rounds once at the end, as stock's single GEMM does."""
    dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


def _add_weight_grad(acc: torch.Tensor, grad_rows: torch.Tensor,
                     input_rows: torch.Tensor) -> None:
    g = grad_rows.reshape(-1, grad_rows.shape[-1]).to(acc.dtype)
    acc.addmm_(g.t(), input_rows.reshape(-1, input_rows.shape[-1]).to(acc.dtype))


def _check(x: torch.Tensor, weight: torch.Tensor, tiles: SequenceTiles, rows: int,
           what: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{what}: the input needs a sequence and a feature dimension, got "
                         f"shape {tuple(x.shape)}")
    if rows != tiles.n_local or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{what}: input {tuple(x.shape)} does not fit the tiles "
                         f"(n_local {tiles.n_local}, TP {tiles.tp}) and weight "
                         f"{tuple(weight.shape)}")


def _backward_buffers(ctx):
    """The saved input and weight, the input gradient (uninitialised: every tile writes its
    rows) and where the weight gradient adds up (``main_grad`` when given), each where
    asked, the tiles and the group."""
    inp, weight = ctx.saved_tensors
    grad_in = torch.empty_like(inp) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = ctx.main_grad if ctx.main_grad is not None else _grad_accumulator(weight)
    return inp, weight, grad_in, grad_w, ctx.tiles, ctx.group


def _weight_result(ctx, acc: Optional[torch.Tensor],
                   weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight's gradient for autograd: the fp32 sum cast to the weight's dtype, or, when
    it went into ``main_grad``, Megatron's fused-linear convention (a placeholder that lets
    DDP's hook fire, and ``grad_added_to_main_grad`` so the hook does not add it again)."""
    if acc is None:
        return None
    if ctx.main_grad is None:
        return acc.to(weight.dtype)
    weight.grad_added_to_main_grad = True
    return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tiles, group, main_grad):
        tp = tiles.tp
        out = x.new_empty((tp * x.shape[0],) + tuple(x.shape[1:-1]) + (weight.shape[0],))
        ranked = _ranked(out, tp)
        for start, stop in tiles.bounds():
            gathered = _gather(x[start:stop], group)
            ranked[:, start:stop] = _ranked(F.linear(gathered, weight, bias), tp)
            del gathered  # one tile at a time
        ctx.save_for_backward(x, weight)
        ctx.tiles, ctx.group, ctx.has_bias = tiles, group, bias is not None
        ctx.main_grad = main_grad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, grad_x, grad_w, tiles, group = _backward_buffers(ctx)
        for start, stop in tiles.bounds():
            grad_rows = _tile_rows(grad_out, tiles.tp, start, stop)
            if grad_x is not None:
                grad_x[start:stop] = _reduce_scatter(grad_rows @ weight, group)
            if grad_w is not None:
                _add_weight_grad(grad_w, grad_rows, _gather(x[start:stop], group))
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, _weight_result(ctx, grad_w, weight), grad_b, None, None, None


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, weight, tiles, group, main_grad):
        tp = tiles.tp
        out = z.new_empty((z.shape[0] // tp,) + tuple(z.shape[1:-1]) + (weight.shape[0],))
        for start, stop in tiles.bounds():
            partial = F.linear(_tile_rows(z, tp, start, stop), weight)
            out[start:stop] = _reduce_scatter(partial, group)
            del partial  # one tile at a time
        ctx.save_for_backward(z, weight)
        ctx.tiles, ctx.group, ctx.main_grad = tiles, group, main_grad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        z, weight, grad_z, grad_w, tiles, group = _backward_buffers(ctx)
        ranked = None if grad_z is None else _ranked(grad_z, tiles.tp)
        for start, stop in tiles.bounds():
            grad_rows = _gather(grad_out[start:stop], group)
            if ranked is not None:
                ranked[:, start:stop] = _ranked(grad_rows @ weight, tiles.tp)
            if grad_w is not None:
                _add_weight_grad(grad_w, grad_rows, _tile_rows(z, tiles.tp, start, stop))
        return grad_z, _weight_result(ctx, grad_w, weight), None, None, None


def tiled_gather_linear(x: torch.Tensor, weight: torch.Tensor, tiles: SequenceTiles,
                        bias: Optional[torch.Tensor] = None,
                        group: Optional[dist.ProcessGroup] = None,
                        main_grad: bool = False) -> torch.Tensor:
    """``all_gather(x) @ weight.T + bias`` over the sequence dimension (dim 0), one tile of
    ``tiles`` at a time; ``x``: this rank's ``[tiles.n_local, ..., in]`` shard, ``weight``:
    ``[out, in]``; returns ``[tiles.tp · n_local, ..., out]``. ``group``: the tensor-parallel
    group (its size must be ``tiles.tp``; None: one rank). ``main_grad``: add the weight
    gradient into ``weight.main_grad`` (Megatron's gradient-accumulation fusion) instead of
    returning it."""
    _check(x, weight, tiles, x.shape[0] if x.dim() else 0, "tiled_gather_linear")
    _check_group(tiles, group, "tiled_gather_linear")
    return _GatherLinear.apply(x, weight, bias, tiles, group, _main_grad(weight, main_grad))


def tiled_linear_reduce_scatter(z: torch.Tensor, weight: torch.Tensor, tiles: SequenceTiles,
                                group: Optional[dist.ProcessGroup] = None,
                                main_grad: bool = False) -> torch.Tensor:
    """``reduce_scatter(z @ weight.T)`` over the sequence dimension (dim 0), one tile of
    ``tiles`` at a time; ``z``: all ``[tiles.tp · n_local, ..., in]`` rows (this rank's input
    columns), ``weight``: ``[out, in]``; returns this rank's ``[n_local, ..., out]``. A bias
    is the caller's to add after the reduce-scatter, as Megatron's row-parallel linear does.
    ``main_grad``: as for :func:`tiled_gather_linear`."""
    rows = z.shape[0] // tiles.tp if z.dim() and z.shape[0] % tiles.tp == 0 else -1
    _check(z, weight, tiles, rows, "tiled_linear_reduce_scatter")
    _check_group(tiles, group, "tiled_linear_reduce_scatter")
    return _LinearReduceScatter.apply(z, weight, tiles, group, _main_grad(weight, main_grad))


def _main_grad(weight: torch.Tensor, main_grad: bool) -> Optional[torch.Tensor]:
    if not main_grad:
        return None
    buffer = getattr(weight, "main_grad", None)
    if buffer is None or buffer.shape != weight.shape:
        raise ValueError("main_grad=True needs the weight's main_grad buffer (Megatron DDP's), "
                         "of the weight's shape")
    return buffer


def _check_group(tiles: SequenceTiles, group, what: str) -> None:
    if _size(group) != tiles.tp:
        raise ValueError(f"{what}: the tiles are planned for TP {tiles.tp}, the group has "
                         f"{_size(group)} rank(s)")

