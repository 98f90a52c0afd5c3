"""A minimal reentrant checkpoint, as Megatron's ``CheckpointFunction`` runs one: the
function's forward without autograd, then in backward its re-run inside
:func:`~megatron_flat.dispatch.recompute.recompute_region` and a backward through the
re-run's output. For tests of graph-only recompute without Megatron."""

from __future__ import annotations

import torch

from megatron_flat.dispatch.recompute import recompute_region

__all__ = ["Reentrant"]


class Reentrant(torch.autograd.Function):
    """``Reentrant.apply(fn, *args)``: ``fn(*args)``, re-run in backward (see the module)."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad):
        args = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        with torch.enable_grad(), recompute_region():
            out = ctx.fn(*args)
        torch.autograd.backward(out, grad)
        return (None,) + tuple(a.grad for a in args)
