"""A layer's span in the autograd graph, so param offload moves its state at the right points.

:func:`offloaded_layer` runs ``fn(weights, *inputs)`` between two autograd Functions:

========================  =========================================================
``_Enter.forward``        acquire the layer's weights; prefetch the next layer's
                          (the previous one's inside a backward: the recompute order)
``_Exit.forward``         outside a backward: release the weights (the forward pass is
                          done with them); inside a backward (the recompute) keep them
``_Exit.backward``        the layer's backward starts: its weights are acquired again (a
                          slot hit after a recompute), its gradient slot gets the running
                          ``main_grad`` (zeros or the host sum), the previous layer's
                          weights are prefetched
``_Enter.backward``       the layer's backward has ended: drain the gradient, release
                          the weights
========================  =========================================================

The layer may recompute in its backward (full recompute, reentrant or not: the recompute
acquires the weights, and its ``_Exit`` keeps them for the backward that follows) or keep its
forward graph: a slot view the forward saved or kept is the same tensor object in the
backward, refilled with this layer's weights by ``_Exit.backward`` before any node of the
layer runs (the slot copy leaves the views' version counters alone, so saved views unpack).

An anchor leaf that requires grad rides along ``_Enter``, so its backward (the drain) runs
even when the layer's input needs no gradient (the first layer).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["offloaded_layer"]

_ANCHOR = torch.zeros((), requires_grad=True)


def _in_backward() -> bool:
    """Whether the autograd engine is running (a recompute inside a backward)."""
    return torch._C._current_graph_task_id() != -1


def _passed(xs: tuple) -> tuple:
    return tuple(x.view_as(x) if isinstance(x, torch.Tensor) else x for x in xs)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, offload, layer: int, anchor, *xs):
        ctx.offload, ctx.layer = offload, layer
        offload.acquire(layer)
        offload.prefetch(layer - 1 if _in_backward() else layer + 1)
        return _passed(xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.offload.drain(ctx.layer)
        ctx.offload.release(ctx.layer)
        return (None, None, None, *grads)


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, offload, layer: int, *ys):
        ctx.offload, ctx.layer = offload, layer
        if not _in_backward():
            offload.release(layer)
        return _passed(ys)

    @staticmethod
    def backward(ctx, *grads):
        ctx.offload.acquire(ctx.layer)
        ctx.offload.acquire_grads(ctx.layer)
        ctx.offload.prefetch(ctx.layer - 1)
        ctx.offload.prefetch_grads(ctx.layer - 1)  # its running sum, while this layer runs
        return (None, None, *grads)


def offloaded_layer(offload, layer: int, fn: Callable[..., Any], *inputs: Any) -> Any:
    """``fn(weights, *inputs)`` as layer ``layer`` of ``offload`` (a
    :class:`~megatron_flat.params.ParamOffload`): ``weights`` are the layer's device tensors,
    each with ``main_grad`` (where ``fn``'s backward adds the weight gradient, as under
    Megatron's DDP). Returns ``fn``'s output (a tensor or a tuple of them)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors:
        raise TypeError("offloaded_layer: the layer needs at least one tensor input")
    entered = _Enter.apply(offload, layer, _ANCHOR, *inputs)
    out = fn(offload.weights(layer), *entered)
    outs = out if isinstance(out, tuple) else (out,)
    exited = _Exit.apply(offload, layer, *outs)
    return exited if isinstance(out, tuple) else exited[0]
