"""Expert banks: the experts a dispatch engine runs, seen as weights plus one function.

The engine (:mod:`megatron_flat.dispatch.llep`) moves routes and, for spilled experts, whole
expert weights between ranks; it never looks inside an expert. What it needs is an
:class:`ExpertBank`:

* ``num_local_experts`` — E_local, the experts native to this rank;
* ``local_weights(j)`` — the parameters of local expert ``j`` as a tuple in a fixed order; every
  expert of the model has the same shapes and dtypes (so a helper rank can run a spilled expert
  from a flat copy of its owner's weights);
* ``run(weights, x, probs)`` — the output of one expert with ``weights`` on routes ``x``
  (``[R, H]``) with router probabilities ``probs`` (``[R]``), *already weighted by probs*: the
  combine is then a plain per-token sum, as in Megatron-Core's experts (``per_token_scale``).

``run`` must be a pure function of its arguments (rows independent of each other), because the
engine calls it on any subset of an expert's routes, on any rank, and again in backward to
recompute. A bank may also offer ``run_for_grad(weights, x, probs, first=None)``: a tensor
whose autograd graph gives exactly ``run``'s gradients but whose *values* are never read (so
the last linear layer's forward GEMM can be skipped when recomputing for backward: the output
is not needed, only its input); the engine uses it for recompute when present. A bank that
also offers ``run_saving(weights, x, probs) -> (out, first)`` returns, beside ``run``'s
output, its first linear layer's output (``first``); given back to ``run_for_grad`` it stands
in for that layer's forward GEMM, so a chunk saved for backward costs one ``[R, F1]`` tensor
(F1: the first layer's width) instead of a recompute.

A bank whose experts run as one grouped GEMM may also offer the *native* calls, on the rows of
its own local experts concatenated in expert order (``counts[j]`` rows for local expert j,
zero for an absent one) with its own parameters: ``run_native(x, probs, counts)``,
``run_native_for_grad(x, probs, counts, first=None)`` and ``run_native_saving(x, probs,
counts) -> (out, first)``, the same three contracts over all local experts at once. The engine
then computes each chunk's native rows in one grouped call (its graph in backward holds that
chunk's native experts together) and only spilled experts' rows one expert at a time.

Megatron's ``SequentialMLP`` is adapted in :mod:`megatron_flat.megatron.moe`;
:class:`GLUExperts` here is a plain-PyTorch bank for users outside Megatron and for tests.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["BiasGrad", "ExpertBank", "GLUExperts", "GradOnlyGroupedLinear", "GradOnlyLinear",
           "GroupedBiasGrad", "SavedOutputGroupedLinear", "SavedOutputLinear", "check_bank"]


class ExpertBank(Protocol):
    """What the dispatch engine needs from the experts (see the module docstring)."""

    @property
    def num_local_experts(self) -> int: ...

    def local_weights(self, j: int) -> Tuple[torch.Tensor, ...]: ...

    def run(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
            probs: torch.Tensor) -> torch.Tensor: ...


def check_bank(bank: ExpertBank, experts_per_rank: int) -> list[tuple[torch.Size, torch.dtype]]:
    """Validate ``bank`` for an EP group with ``experts_per_rank`` experts per rank.

    Returns the (shape, dtype) of each weight of one expert. Raises ``ValueError`` when the
    bank has the wrong number of experts or its experts differ in weight shapes or dtypes.
    """
    n = bank.num_local_experts
    if n != experts_per_rank:
        raise ValueError(f"the expert bank holds {n} local experts, but num_experts / ep_size = "
                         f"{experts_per_rank}: inconsistent expert count")
    signature = None
    for j in range(n):
        weights = bank.local_weights(j)
        sig = [(w.shape, w.dtype) for w in weights]
        if not sig:
            raise ValueError(f"local expert {j} has no weights")
        if signature is None:
            signature = sig
        elif sig != signature:
            raise ValueError(f"local expert {j} has weights {sig}, expert 0 has {signature}: "
                             "every expert must have the same weight shapes and dtypes")
    if len({dtype for _, dtype in signature}) != 1:
        raise ValueError(f"an expert's weights must share one dtype, got {signature}")
    return signature


class GradOnlyLinear(torch.autograd.Function):
    """``x Wᵀ`` for a graph that is only differentiated: forward returns an *uninitialised*
    ``[..., out]`` tensor (no GEMM); backward returns ``g W`` and ``gᵀ x`` (2-D), the formulas
    of Megatron-Core's non-fused linear backward. Saves ``x`` and ``W`` (references)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        g2 = grad.contiguous().view(-1, grad.shape[-1])
        grad_w = g2.t().matmul(x.contiguous().view(-1, x.shape[-1]))
        return grad_x, grad_w


class SavedOutputLinear(torch.autograd.Function):
    """``x Wᵀ`` whose value was computed earlier (``output``, saved from forward): forward
    returns it without a GEMM; backward is :class:`GradOnlyLinear`'s (``g W``, ``gᵀ x``).
    Saves ``x`` and ``W`` (references)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,
                output: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x, grad_w = GradOnlyLinear.backward(ctx, grad)
        return grad_x, grad_w, None


class BiasGrad(torch.autograd.Function):
    """A linear's bias ``b`` on an output whose value needs no addition: a saved output that
    already holds it, or a grad-only output that is never read. Forward returns ``y``;
    backward passes ``g`` on and gives ``b`` the row sum of ``g``, the formula of
    Megatron-Core's linear backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.contiguous().view(-1, grad.shape[-1]).sum(0)


class GroupedBiasGrad(torch.autograd.Function):
    """:class:`BiasGrad` for a grouped linear: group j's rows (``splits``) give ``b_j`` their
    row sum (None for an empty group, as for its weight)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, splits: Sequence[int], *biases: torch.Tensor):
        ctx.splits = list(splits)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sums = [g.sum(0) if g.shape[0] else None for g in torch.split(grad, ctx.splits)]
        return (grad, None, *sums)


def _grouped_backward(x: torch.Tensor, weights: Sequence[torch.Tensor], splits: Sequence[int],
                      grad: torch.Tensor):
    """``(g_j W_j for every group, as one tensor; gᵀ_j x_j per group, None for an empty one)``:
    :class:`GradOnlyLinear`'s formulas on each group of rows."""
    grad_x, grad_w = [], []
    for xj, gj, w in zip(torch.split(x, list(splits)), torch.split(grad, list(splits)), weights):
        grad_x.append(gj.matmul(w))
        grad_w.append(gj.t().matmul(xj) if xj.shape[0] else None)
    return torch.cat(grad_x) if grad_x else grad.new_empty(x.shape), grad_w


class GradOnlyGroupedLinear(torch.autograd.Function):
    """``x_j W_jᵀ`` for each group j of rows (``splits``) of a grouped linear, for a graph
    that is only differentiated: forward returns an uninitialised ``[rows, out]`` tensor (no
    GEMM); backward is :class:`GradOnlyLinear`'s per group (no weight gradient for an empty
    group). Saves ``x`` and the weights (references)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, splits: Sequence[int], *weights: torch.Tensor):
        ctx.splits = list(splits)
        ctx.save_for_backward(x, *weights)
        return x.new_empty((x.shape[0], weights[0].shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x, grad_w = _grouped_backward(x, weights, ctx.splits, grad)
        return (grad_x, None, *grad_w)


class SavedOutputGroupedLinear(torch.autograd.Function):
    """A grouped linear's output computed earlier (``output``, saved from forward): forward
    returns it without a GEMM; backward is :class:`GradOnlyGroupedLinear`'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output: torch.Tensor, splits: Sequence[int],
                *weights: torch.Tensor):
        ctx.splits = list(splits)
        ctx.save_for_backward(x, *weights)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x, grad_w = _grouped_backward(x, weights, ctx.splits, grad)
        return (grad_x, None, None, *grad_w)


class GLUExperts(torch.nn.Module):
    """E_local feed-forward experts: ``y = (act(x W1ᵀ) · p) W2ᵀ``, gated by default.

    Gated (SwiGLU with ``activation=F.silu``): ``W1`` is ``[2F, H]`` and
    ``act(x W1ᵀ) = act(a) * b`` for ``a, b = chunk(x W1ᵀ, 2)``; otherwise ``W1`` is ``[F, H]``.
    ``W2`` is ``[H, F]``. The router probability scales the activation before ``W2``, which is
    where Megatron-Core's MLP applies ``per_token_scale``. Weights are initialised from
    ``generator`` (normal, std 0.02 — deterministic for tests).
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 gated: bool = True, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        if num_local_experts < 1 or hidden_size < 1 or ffn_hidden_size < 1:
            raise ValueError("num_local_experts, hidden_size and ffn_hidden_size must be >= 1")
        self.gated, self.activation = gated, activation
        rows = 2 * ffn_hidden_size if gated else ffn_hidden_size

        def param(*shape):
            w = torch.empty(*shape, dtype=torch.float32)
            w.normal_(0.0, 0.02, generator=generator)
            return torch.nn.Parameter(w.to(dtype=dtype, device=device))

        self.fc1 = torch.nn.ParameterList(param(rows, hidden_size)
                                          for _ in range(num_local_experts))
        self.fc2 = torch.nn.ParameterList(param(hidden_size, ffn_hidden_size)
                                          for _ in range(num_local_experts))

    @property
    def num_local_experts(self) -> int:
        return len(self.fc1)

    def local_weights(self, j: int) -> Tuple[torch.Tensor, ...]:
        return (self.fc1[j], self.fc2[j])

    def run(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
            probs: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self._hidden(weights, x, probs), weights[1].t())

    def run_saving(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                   probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.matmul(x, weights[0].t())
        return torch.matmul(self._hidden(weights, x, probs, first), weights[1].t()), first

    def run_for_grad(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                     probs: torch.Tensor, first: Optional[torch.Tensor] = None) -> torch.Tensor:
        first = None if first is None else SavedOutputLinear.apply(x, weights[0], first)
        return GradOnlyLinear.apply(self._hidden(weights, x, probs, first), weights[1])

    def _hidden(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                probs: torch.Tensor, first: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.matmul(x, weights[0].t()) if first is None else first
        if self.gated:
            a, b = torch.chunk(h, 2, dim=-1)
            h = self.activation(a) * b
        else:
            h = self.activation(h)
        return (h * probs.unsqueeze(-1)).to(x.dtype)
