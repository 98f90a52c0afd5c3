"""A plain-PyTorch stack of expert layers, resident or with param offload, for the param
offload tests and ``benchmarks/model_state.py``.

Each layer is ``x + Σ_e gelu(x_e W1_e) W2_e`` over fixed routing (token t to expert
t mod E). Its backward adds each weight gradient into ``main_grad`` in two row chunks, as
PipelinedLLEP adds chunk by chunk under Megatron's DDP, so the order of the fp32 adds is
part of what the offloaded run must reproduce bitwise. The layer recomputes in its backward
(reentrant or non-reentrant checkpoint, or SCO), as a full-recompute Megatron run does, or
keeps its forward graph (``checkpoint="none"``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from megatron_flat.params import ParamOffload, offloaded_layer

__all__ = ["CHECKPOINTS", "ChunkedExperts", "ExpertStack", "expert_layer", "make_weights",
           "train"]

CHECKPOINTS = ("reentrant", "non-reentrant", "sco", "none")


def _experts(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    num = len(weights) // 2
    out = x
    for e in range(num):
        rows = torch.arange(e, x.shape[0], num, device=x.device)
        y = F.gelu(x[rows] @ weights[2 * e]) @ weights[2 * e + 1]
        out = out.index_add(0, rows, y)
    return out


class ChunkedExperts(torch.autograd.Function):
    """The layer; backward adds weight gradients into ``w.main_grad`` per row chunk."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x)
        ctx.weights = weights  # as PipelinedLLEP keeps them: the objects, main_grad attached
        return _experts(x, weights)

    @staticmethod
    def backward(ctx, grad):
        (x,), weights = ctx.saved_tensors, ctx.weights
        dx = torch.empty_like(x)
        half = x.shape[0] // 2
        for rows in (slice(0, half), slice(half, x.shape[0])):
            with torch.enable_grad():
                xc = x[rows].detach().requires_grad_()
                ws = [w.detach().requires_grad_() for w in weights]
                grads = torch.autograd.grad(_experts(xc, ws), [xc, *ws], grad[rows])
            dx[rows] = grads[0]
            for w, g in zip(weights, grads[1:]):
                w.main_grad.add_(g)  # fp32 main_grad += gradient, as Megatron's DDP
        return (dx, *[None] * len(weights))


def expert_layer(weights: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return ChunkedExperts.apply(x, *weights)


def make_weights(layers: int, hidden: int = 8, ffn: int = 16, experts: int = 2,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> List[List[torch.Tensor]]:
    """Every layer's ``[W1_0, W2_0, W1_1, ...]``."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(shape, generator=g) * 0.3).to(dtype)
             for _ in range(experts) for shape in ((hidden, ffn), (ffn, hidden))]
            for _ in range(layers)]


class ExpertStack:
    """The stack's weights resident on the device (``main_grad`` beside each, as Megatron's
    DDP keeps it) or, with ``offload``, in a :class:`~megatron_flat.params.ParamOffload`."""

    def __init__(self, weights: Sequence[Sequence[torch.Tensor]], *, offload: bool,
                 checkpoint: str = "non-reentrant", sco=None, tier=None,
                 device=None) -> None:
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}")
        self.checkpoint, self.sco = checkpoint, sco
        self.offload: Optional[ParamOffload] = None
        self.params: List[List[torch.Tensor]] = []
        device = torch.device(device or "cpu")
        if offload:
            self.offload = ParamOffload(weights, tier=tier, device=device)
        else:
            for ws in weights:
                params = [torch.nn.Parameter(w.to(device, copy=True)) for w in ws]
                for p in params:
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
                self.params.append(params)

    @property
    def num_layers(self) -> int:
        return self.offload.num_layers if self.offload else len(self.params)

    def _layer(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.offload is not None:
            return lambda x: offloaded_layer(self.offload, index, expert_layer, x)
        return lambda x: expert_layer(self.params[index], x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.offload is not None:
            self.offload.prefetch(0)
        for index in range(self.num_layers):
            fn = self._layer(index)
            if self.checkpoint == "none":
                x = fn(x)
            elif self.checkpoint == "sco":
                x = self.sco.checkpoint(fn, x)
            else:
                x = torch_checkpoint.checkpoint(fn, x,
                                                use_reentrant=self.checkpoint == "reentrant")
        return x

    def main_grads(self, index: int) -> List[torch.Tensor]:
        if self.offload is not None:
            return self.offload.host_grads(index)
        return [p.main_grad for p in self.params[index]]

    def weights(self, index: int) -> List[torch.Tensor]:
        if self.offload is not None:
            return self.offload.host_weights(index)
        return [p.data for p in self.params[index]]

    def sgd_step(self, lr: float = 0.1) -> None:
        """``w -= lr · main_grad`` in the weights' dtype, then a new accumulation."""
        with torch.no_grad():
            for index in range(self.num_layers):
                for w, g in zip(self.weights(index), self.main_grads(index)):
                    w.sub_((g * lr).to(w.dtype))
        if self.offload is not None:
            self.offload.weights_updated()
            self.offload.zero_grad()
        else:
            for params in self.params:
                for p in params:
                    p.main_grad.zero_()


def train(stack: ExpertStack, batches: Sequence[Sequence[torch.Tensor]],
          lr: float = 0.1, keep: bool = True) -> dict:
    """Steps of gradient accumulation over each step's microbatches; with ``keep``, every
    loss, input gradient, main_grad (before each update) and the final weights (without:
    nothing is kept, so a memory meter sees only the step)."""
    out: dict = {"losses": [], "input_grads": [], "main_grads": [], "weights": None}
    for microbatches in batches:
        for x in microbatches:
            x = x.clone().requires_grad_()
            loss = (stack(x).float() ** 2).mean()
            loss.backward()
            if keep:
                out["losses"].append(loss.detach())
                out["input_grads"].append(x.grad)
        if keep:
            out["main_grads"].append([[g.clone() for g in stack.main_grads(i)]
                                      for i in range(stack.num_layers)])
        stack.sgd_step(lr)
    if keep:
        out["weights"] = [[w.clone() for w in stack.weights(i)]
                          for i in range(stack.num_layers)]
    return out
