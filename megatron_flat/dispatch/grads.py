"""Weight gradients of PipelinedLLEP's experts: where they go and how they add up.

Megatron-Core's DDP gives each parameter a ``main_grad`` buffer and a
``grad_added_to_main_grad`` flag (its fused-accumulation protocol): the engine adds each
chunk's expert weight gradient straight into it and sets the flag, as Megatron's fused
linear layers do, so no full-size gradient per expert is held until the end of backward.
Without DDP the gradients are summed over chunks in fp32 accumulators and returned.
Both the step (the helpers' gradient return) and the chunk strategies use these, so they
live below both.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

__all__ = ["accumulate", "accumulate_all", "add_all", "main_grad", "mark_added"]


def main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient buffer of a parameter under Megatron-Core's DDP (``main_grad``, with the
    ``grad_added_to_main_grad`` flag of its fused-accumulation protocol), else None.

    The engine then adds each chunk's weight gradient straight into it and marks it added, as
    Megatron's fused linear layers do, so no full-size gradient per expert is held until the
    end of backward; without DDP the gradients are summed in accumulators and returned.
    A bank may hand out a view of a parameter (one expert's block of a grouped weight) with
    ``main_grad`` (the same view of the parameter's buffer) and ``main_grad_owner`` (the
    parameter, whose flag DDP reads) set: it takes the same path."""
    owner = getattr(param, "main_grad_owner", param)
    if not isinstance(owner, torch.nn.Parameter) or not hasattr(owner, "grad_added_to_main_grad"):
        return None
    return getattr(param, "main_grad", None)


def mark_added(param: torch.Tensor) -> None:
    """Set DDP's ``grad_added_to_main_grad`` on the parameter (or the view's owner)."""
    param.grad_added_to_main_grad = True
    owner = getattr(param, "main_grad_owner", None)
    if owner is not None:
        owner.grad_added_to_main_grad = True


def add_all(targets: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """``t += g`` for each pair (a None gradient adds nothing): one fused ``_foreach_add_``
    (one launch on CUDA) for the pairs whose dtypes match, a plain ``add_`` for the others
    (a mixed-dtype foreach takes torch's per-tensor path: no fewer launches, so no
    pretence of fusing). Same per-element sums either way."""
    same, mixed = ([], []), []
    for t, g in zip(targets, grads):
        if g is None:
            continue
        if t.dtype == g.dtype and t.device == g.device:
            same[0].append(t)
            same[1].append(g)
        else:
            mixed.append((t, g))
    if len(same[0]) > 1:
        torch._foreach_add_(same[0], same[1])
    elif same[0]:
        same[0][0].add_(same[1][0])
    for t, g in mixed:
        t.add_(g)


def accumulate(acc: dict, e: int, grads: Sequence[Optional[torch.Tensor]],
               leaves: Sequence[torch.Tensor]) -> None:
    """Sum an expert's weight gradients over chunks: straight into ``main_grad`` for a
    parameter under Megatron's DDP (see :func:`main_grad`), else into fp32 accumulators."""
    if all(main_grad(w) is not None for w in leaves):
        add_all([w.main_grad for w in leaves], grads)
        for w in leaves:
            mark_added(w)
        return
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, leaves)]
    if e not in acc:
        acc[e] = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads]
    else:
        add_all(acc[e], grads)


def accumulate_all(acc: dict, expert_grads: Iterator[tuple]) -> None:
    """:func:`accumulate` for each ``(expert, gradients, leaves)``; in a function of its own
    so no gradient outlives the call (a loop variable would keep the last expert's alive
    while the next unit's graph is built)."""
    for e, grads, leaves in expert_grads:
        accumulate(acc, e, grads, leaves)
