"""PipelinedLLEP's forward and backward passes over the chunks of one call.

Each pass is one loop over the K chunks: dispatch chunk i's routes to their compute ranks,
run the chunk's strategy (:mod:`.strategies`), return the results to the sources and add
them into this rank's output (forward: expert outputs summed per token; backward: input and
probability gradients). With ``Step.overlap`` the all-to-alls are in flight while experts
compute (chunk i+1's dispatch during chunk i, chunk i's return during chunk i+1, the
spilled-weight transfer during the first dispatch); otherwise one chunk at a time, which
keeps the peak lowest. Either order gives bitwise the same values.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_flat.dispatch.exchange import Pending
from megatron_flat.dispatch.step import Step
from megatron_flat.dispatch.grads import main_grad, mark_added

__all__ = ["backward_pass", "forward_pass", "rounds"]


def rounds(step: Step, dispatch: Callable[[int], Pending],
           compute: Callable[[int, list], tuple], land: Callable[[int, Pending], None],
           arrived: Callable[[], None] = lambda: None) -> None:
    """The chunk loop of both passes: chunk i's ``dispatch(i)`` (in flight), ``compute(i,
    received)`` (what goes back, as ``Step.pack`` gives it), its return all-to-all and
    ``land(i, returning)`` (wait, then add into this rank's result). ``arrived()`` runs once
    the first dispatch is issued (the spilled experts' weights land there). With
    ``step.overlap`` chunk i+1's dispatch is issued before chunk i computes and chunk i's
    return lands after chunk i+1 computed; otherwise one chunk at a time. Every rank issues
    the all-to-alls in the same order either way."""
    k = step.send.num_chunks
    pending = dispatch(0)
    arrived()
    returning: Optional[tuple[int, Pending]] = None  # the previous chunk's, in flight
    for i in range(k):
        received = pending.wait()
        pending = dispatch(i + 1) if step.overlap and i + 1 < k else None
        back = compute(i, received)
        del received
        if returning is not None:  # chunk i-1's return ran while chunk i computed
            land(*returning)
        returning = (i, step.a2a(back, i, back=True))
        del back
        if not step.overlap:
            land(*returning)
            returning = None
            if i + 1 < k:
                pending = dispatch(i + 1)
    if returning is not None:
        land(*returning)


def forward_pass(step: Step, tokens: torch.Tensor, probs: torch.Tensor,
                 weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N, H]``: each token's sum of its routes' probability-weighted expert outputs (zeros
    for a graph-only re-run, which moves nothing)."""
    hidden = tokens.shape[1]
    out = tokens.new_zeros((step.n, hidden))
    if not step.values:
        return out
    fetched = step.fetch_helper_weights(weights)
    helper: dict = {}

    def dispatch(i: int) -> Pending:
        idx = step.send.chunk(i)
        tok = step.route_token.index_select(0, idx)
        return step.a2a(step.pack([(tokens, tok), (probs, idx)]), i, back=False)

    def compute(i: int, received: list):
        return [step.strategies[i].forward(step, i, received, weights, helper)], None

    def combine(i: int, returning: Pending) -> None:
        (y_send,) = returning.wait()
        restore = step.send.restore[i]
        y_em = y_send.index_select(0, restore)
        del y_send
        tok = step.route_token.index_select(0, step.send.chunk(i).index_select(0, restore))
        out.scatter_add_(0, tok.unsqueeze(1).expand(-1, hidden), y_em)

    rounds(step, dispatch, compute, combine, lambda: helper.update(fetched()))
    if step.graph:
        step.helper = helper  # the held graphs use the helper copies
    return out


def backward_pass(step: Step, grad_out: torch.Tensor, tokens: torch.Tensor,
                  probs: torch.Tensor, weights: Sequence[torch.Tensor]):
    """``(grad_tokens, grad_probs, grad_weights)`` of one call; weight gradients that went
    into ``main_grad`` come back as one-element placeholders (see below)."""
    grad_out = grad_out.contiguous()
    fetched = (lambda: step.helper) if step.graph else step.fetch_helper_weights(weights)
    helper: dict = {}
    acc: dict[int, list[torch.Tensor]] = {}
    grad_tokens = torch.zeros_like(tokens)
    grad_probs = torch.zeros_like(probs)

    def dispatch(i: int) -> Pending:
        idx = step.send.chunk(i)
        tok = step.route_token.index_select(0, idx)
        if step.strategies[i].resends_tokens:
            parts = [(tokens, tok), (probs, idx), (grad_out, tok)]
        else:
            parts = [(grad_out, tok)]
        return step.a2a(step.pack(parts), i, back=False)

    def add_back(i: int, returning: Pending) -> None:
        dx_send, dp_send = returning.wait()
        idx = step.send.chunk(i)
        restore = step.send.restore[i]
        tok = step.route_token.index_select(0, idx.index_select(0, restore))
        grad_tokens.index_add_(0, tok, dx_send.index_select(0, restore))
        grad_probs.index_copy_(0, idx, dp_send.to(grad_probs.dtype))

    def arrived() -> None:
        helper.update(fetched())
        step.helper = {}

    rounds(step, dispatch,
           lambda i, received: step.strategies[i].backward(step, i, received, weights, helper,
                                                           acc),
           add_back, arrived)
    helper.clear()
    step.return_helper_grads(acc, weights)
    grad_weights = []
    for j in range(step.e_local):
        e = step.first + j
        own = step.own(e, weights)
        got = acc.pop(e, None)
        for n, w in enumerate(own):
            if main_grad(w) is not None:
                # Already in main_grad: a placeholder keeps DDP's per-parameter hooks firing
                # (they skip the add: grad_added_to_main_grad), one element of memory
                # instead of a full gradient per parameter.
                mark_added(w)
                grad_weights.append(w.new_empty(1).expand_as(w))
            else:
                grad_weights.append(torch.zeros_like(w) if got is None else got[n].to(w.dtype))
    return grad_tokens, grad_probs, grad_weights
