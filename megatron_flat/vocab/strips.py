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
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_flat.vocab.online_lse import LSEState, fold

__all__ = ["matmul_nt", "fold_shard", "grad_shard"]

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


def fold_shard(
    state: LSEState,
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    start: int,
    blocks: Sequence[tuple[int, int]],
) -> LSEState:
    """Fold every strip of ``w`` (vocab ids ``start + row``) into ``state``."""
    acc = state.m.dtype
    for b0, b1 in blocks:
        strip = matmul_nt(x, w[b0:b1], acc)
        state = fold(state, strip, labels, start + b0, overwrite=True)
        del strip
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
) -> None:
    """Accumulate this shard's gradient into ``dx [N, H]`` and ``dw [rows, H]``.

    Per strip ``dY = (exp(Y - lse) - onehot(label)) * coef`` (``coef`` = incoming gradient,
    0 for masked tokens); ``dx += dY @ w_b`` and ``dw[b] += dY.T @ x``. Either may be None.
    With ``dw_direct`` the strip's ``dY.T @ x`` is written to ``dw[b]`` (input dtype)
    instead of added: for a ``dw`` that each block touches once (one rounding, exactly as
    precise as an fp32 accumulator cast at the end, at a third of its memory).
    ``before_write`` is called once, after the first strip is computed and before anything
    is written to ``dx``/``dw``: the moment to wait for a buffer still arriving, so that
    the strip's matmul overlaps its arrival.
    """
    acc = lse.dtype
    lse_col = lse.unsqueeze(1)
    coef_col = coef.unsqueeze(1)
    for b0, b1 in blocks:
        strip = matmul_nt(x, w[b0:b1], acc)
        strip.sub_(lse_col).exp_()
        # - onehot: scatter -1 where the label falls in this strip, 0 elsewhere (no
        # data-dependent shapes, so no host sync on CUDA).
        local = labels - (start + b0)
        hit = (local >= 0) & (local < b1 - b0)
        strip.scatter_add_(1, torch.where(hit, local, 0).unsqueeze(1),
                           hit.to(acc).neg_().unsqueeze(1))
        strip.mul_(coef_col)
        if before_write is not None:
            before_write()
            before_write = None
        w_b = w[b0:b1]
        if x.dtype == acc:
            if dx is not None:
                dx.addmm_(strip, w_b)
            if dw is not None:
                if dw_direct:
                    torch.mm(strip.t(), x, out=dw[b0:b1])
                else:
                    dw[b0:b1].addmm_(strip.t(), x)
            del strip
            continue
        # Half inputs: the logit gradient goes to the input dtype a row chunk at a time.
        dw_block = dw[b0:b1] if dw is not None and not dw_direct else None
        if dw is not None and dw_direct:
            dw_block = torch.zeros(b1 - b0, x.shape[1], dtype=acc, device=x.device)
        for r0, r1 in _row_chunks(x.shape[0]):
            d_chunk = strip[r0:r1].to(x.dtype)
            if dx is not None:
                _add_mm_(dx[r0:r1], d_chunk, w_b)
            if dw_block is not None:
                _add_mm_(dw_block, d_chunk.t(), x[r0:r1])
            del d_chunk
        del strip
        if dw is not None and dw_direct:
            dw[b0:b1].copy_(dw_block)
        del dw_block
