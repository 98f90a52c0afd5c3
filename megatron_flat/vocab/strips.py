"""The work on one weight shard: fold its logit strips forward, their gradients backward.

A strip is ``x @ w[b0:b1].T`` for one block of real (unpadded) vocab rows: ``[N, b1-b0]``
in the accumulation dtype (fp32, or fp64 for fp64 inputs). Only one strip is live at a
time here; it is overwritten in place (forward: ``exp(Y - m')``; backward: the softmax,
then ``softmax - onehot``, then scaled by the incoming gradient), so folding or
differentiating it costs no second strip. With half-precision inputs the matmuls run in the
input dtype (fp32 accumulation inside the kernel); their products are upcast before they
are folded or accumulated (on CUDA the kernel writes fp32 directly via
``torch.mm(out_dtype=)``), and the logit gradient is rounded to the input dtype once for
the two backward matmuls, as a dense bf16 model does. Half-precision copies of a strip are
made a quarter of its rows at a time, so they add 1/4 strip, not 1/2.

**Token tiles** (``tile_rows``): each strip is then computed ``tile_rows`` tokens at a time,
vocabulary blocks outer and token tiles inner, so the live strip is ``tile_rows x B`` whatever
N is. The forward folds each tile into its tokens' rows of the state (per token the same folds
in the same order: the loss is what the untiled fold gives, up to the GEMM's own row split);
the backward adds each tile's ``dY @ w_b`` into its rows of dX and ``dY.T @ x`` into the
block's dW, one tile after another in a fixed order (fp32, no atomics: a rerun is bitwise
equal; the sum over tokens is reordered against the untiled GEMM, within fp32 rounding).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_flat.vocab.online_lse import LSEState, fold

__all__ = ["matmul_nt", "fold_shard", "grad_shard", "token_tiles"]

# (device type, dtype) -> whether torch.mm(..., out_dtype=) works there (CUDA fp16/bf16).
_OUT_DTYPE_WORKS: dict[tuple[str, torch.dtype], bool] = {}
# Half-precision copies of a strip are made in this many row chunks (1/4 strip each).
HALF_CHUNKS = 4


def _out_dtype_mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> Optional[torch.Tensor]:
    """``a @ b`` written as ``acc`` by the kernel itself (CUDA half inputs), or None."""
    key = (a.device.type, a.dtype)
    if not _OUT_DTYPE_WORKS.get(key, a.device.type == "cuda"):
        return None
    try:
        out = torch.mm(a, b, out_dtype=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        _OUT_DTYPE_WORKS[key] = False
        return None
    _OUT_DTYPE_WORKS[key] = True
    return out


def _row_chunks(n: int) -> list[tuple[int, int]]:
    step = max(1, -(-n // HALF_CHUNKS))
    return [(r, min(r + step, n)) for r in range(0, n, step)]


def _mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` as an ``acc``-dtype tensor (``a``, ``b`` of the input dtype).

    Half inputs without an ``out_dtype`` kernel: computed in row chunks, each upcast into
    the ``acc`` result, so the half-precision temporary is 1/HALF_CHUNKS of the result.
    """
    if a.dtype == acc:
        return torch.mm(a, b)
    out = _out_dtype_mm(a, b, acc)
    if out is not None:
        return out
    out = torch.empty(a.shape[0], b.shape[1], dtype=acc, device=a.device)
    for r0, r1 in _row_chunks(a.shape[0]):
        out[r0:r1].copy_(torch.mm(a[r0:r1], b))
    return out


def matmul_nt(x: torch.Tensor, w: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The logit strip ``x @ w.T`` in the accumulation dtype."""
    return _mm_acc(x, w.t(), acc)


def _add_mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in the accumulation dtype, ``a``/``b`` in the input dtype.

    Half inputs: the product comes from the kernel as fp32 where ``out_dtype`` works (CUDA),
    else as a half-precision temporary (rounded once) that ``add_`` upcasts.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    product = _out_dtype_mm(a, b, out.dtype)
    out.add_(product if product is not None else torch.mm(a, b))


def token_tiles(n: int, tile_rows: Optional[int]) -> list[tuple[int, int]]:
    """``(first, end)`` token rows of each tile: one tile of all ``n`` without ``tile_rows``."""
    if not tile_rows or tile_rows >= n:
        return [(0, n)]
    return [(t, min(t + tile_rows, n)) for t in range(0, n, tile_rows)]


def fold_shard(
    state: LSEState,
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    start: int,
    blocks: Sequence[tuple[int, int]],
    tile_rows: Optional[int] = None,
) -> LSEState:
    """Fold every strip of ``w`` (vocab ids ``start + row``) into ``state``, ``tile_rows``
    tokens at a time when given (the state is then updated in place, a tile's rows at a time)."""
    acc = state.m.dtype
    tiles = token_tiles(x.shape[0], tile_rows)
    if len(tiles) == 1:
        for b0, b1 in blocks:
            strip = matmul_nt(x, w[b0:b1], acc)
            state = fold(state, strip, labels, start + b0, overwrite=True)
            del strip
        return state
    for b0, b1 in blocks:
        for t0, t1 in tiles:
            strip = matmul_nt(x[t0:t1], w[b0:b1], acc)
            rows = LSEState(state.m[t0:t1], state.z[t0:t1], state.t[t0:t1])
            folded = fold(rows, strip, labels[t0:t1], start + b0, overwrite=True)
            del strip
            for mine, new in zip(rows, folded):
                mine.copy_(new)
    return state


def grad_shard(
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    start: int,
    blocks: Sequence[tuple[int, int]],
    dx: Optional[torch.Tensor],
    dw: Optional[torch.Tensor],
    *,
    dw_direct: bool = False,
    before_write: Optional[Callable[[], None]] = None,
    tile_rows: Optional[int] = None,
) -> None:
    """Accumulate this shard's gradient into ``dx [N, H]`` and ``dw [rows, H]``.

    Per strip ``dY = (exp(Y - lse) - onehot(label)) * coef`` (``coef`` = incoming gradient,
    0 for masked tokens); ``dx += dY @ w_b`` and ``dw[b] += dY.T @ x``. Either may be None.
    With ``dw_direct`` the strip's ``dY.T @ x`` is written to ``dw[b]`` (input dtype)
    instead of added: for a ``dw`` that each block touches once (one rounding, exactly as
    precise as an fp32 accumulator cast at the end, at a third of its memory; with several
    token tiles or half inputs the block is summed in one fp32 block buffer first).
    ``before_write`` is called once, after the first strip is computed and before anything
    is written to ``dx``/``dw``: the moment to wait for a buffer still arriving, so that
    the strip's matmul overlaps its arrival. ``tile_rows``: token tiles (module doc).
    """
    acc = lse.dtype
    tiles = token_tiles(x.shape[0], tile_rows)
    for b0, b1 in blocks:
        w_b = w[b0:b1]
        # Where the block's dW goes: dw itself, or (written once, but summed over several
        # tiles or from half-precision chunks) one fp32 block buffer copied at the end.
        dw_block, staged = None, False
        if dw is not None:
            staged = dw_direct and (x.dtype != acc or len(tiles) > 1)
            dw_block = (torch.zeros(b1 - b0, x.shape[1], dtype=acc, device=x.device)
                        if staged else dw[b0:b1])
        for i, (t0, t1) in enumerate(tiles):
            strip = matmul_nt(x[t0:t1], w_b, acc)
            strip.sub_(lse[t0:t1].unsqueeze(1)).exp_()
            # - onehot: scatter -1 where the label falls in this strip, 0 elsewhere (no
            # data-dependent shapes, so no host sync on CUDA).
            local = labels[t0:t1] - (start + b0)
            hit = (local >= 0) & (local < b1 - b0)
            strip.scatter_add_(1, torch.where(hit, local, 0).unsqueeze(1),
                               hit.to(acc).neg_().unsqueeze(1))
            strip.mul_(coef[t0:t1].unsqueeze(1))
            if before_write is not None:
                before_write()
                before_write = None
            dx_t = dx[t0:t1] if dx is not None else None
            x_t = x[t0:t1]
            if x.dtype == acc:
                if dx_t is not None:
                    dx_t.addmm_(strip, w_b)
                if dw_block is not None:
                    if dw_direct and len(tiles) == 1:
                        torch.mm(strip.t(), x_t, out=dw_block)
                    else:
                        dw_block.addmm_(strip.t(), x_t)
                del strip
                continue
            # Half inputs: the logit gradient goes to the input dtype a row chunk at a time.
            for r0, r1 in _row_chunks(t1 - t0):
                d_chunk = strip[r0:r1].to(x.dtype)
                if dx_t is not None:
                    _add_mm_(dx_t[r0:r1], d_chunk, w_b)
                if dw_block is not None:
                    _add_mm_(dw_block, d_chunk.t(), x_t[r0:r1])
                del d_chunk
            del strip
        if staged:
            dw[b0:b1].copy_(dw_block)
        del dw_block
