"""The dispatch engine's expert bank over Megatron's grouped experts (``--moe-grouped-gemm``).

:class:`GroupedExpertsBank` serves ``GroupedMLP`` (0.16: ``weight1 [H, E_l·2F]`` and
``weight2 [E_l·F, H]``, read by Megatron as ``[E_l, H, 2F]`` / ``[E_l, F, H]`` blocks) and
``TEGroupedMLP`` (0.16 and 0.19: one ``weight{i}`` per expert in each grouped linear) as the
engine's :class:`~megatron_flat.dispatch.experts.ExpertBank`:

* ``local_weights(j)`` — expert j's two weights in the module's own layout: its blocks of
  ``weight1``/``weight2`` (views from one ``unbind``, so backward stacks the experts'
  gradients once, rather than a full-size zero per expert; under Megatron DDP each view
  carries its block of ``main_grad``, where the engine adds its gradient in place), or
  ``weight{j}`` of each linear;
* ``run(weights, x, probs)`` — Megatron's own experts ``forward`` on ``x``, all rows given
  to slot 0 whose weights are swapped for ``weights`` (``torch.func.functional_call``;
  ``GroupedMLP`` is told it holds one expert for the call): the configured activation, GLU,
  probability weighting and ``moe_apply_probs_on_input`` are Megatron's, through the same
  grouped kernel the stock layer calls (with empty groups for the other slots).

Exactness: per expert the same GEMMs on the same rows as the stock grouped layer, so equal
to it bitwise where the kernel is row-independent (the CPU reference; rows of a CUDA grouped
GEMM may round differently when the row count changes, as for SequentialMLP).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Tuple

import torch

__all__ = ["GroupedExpertsBank", "GroupedMLPBank", "TEGroupedMLPBank"]


class GroupedExpertsBank:
    """:class:`~megatron_flat.dispatch.experts.ExpertBank` over ``GroupedMLP`` or
    ``TEGroupedMLP`` (see the module docstring)."""

    def __init__(self, experts: torch.nn.Module, config) -> None:
        if not self.supports(experts):
            raise TypeError(f"{type(experts).__name__} is not a grouped experts module")
        self.experts = experts
        self.blocks = hasattr(experts, "weight1")  # GroupedMLP: per-expert blocks of 2 weights
        # TEGroupedMLP: (linear, kind) of each per-expert tensor, the biases (GPT-OSS's
        # experts) after the weights; slot 0's names are what run() swaps.
        self._fields = [] if self.blocks else [
            (linear, kind) for kind in ("weight", "bias") for linear in ("linear_fc1", "linear_fc2")
            if kind == "weight" or getattr(getattr(experts, linear), "bias0", None) is not None]
        self.names = (("weight1", "weight2") if self.blocks
                      else tuple(f"{linear}.{kind}0" for linear, kind in self._fields))
        self._views: list = []
        self._key: tuple = ()
        # The experts' weight gradients leave through the engine's autograd Function, so the
        # grouped linears must return them rather than fuse them into main_grad themselves.
        for module in experts.modules():
            for flag in ("fuse_wgrad_accumulation", "gradient_accumulation_fusion"):
                if getattr(module, flag, False) is True:
                    setattr(module, flag, False)

    @staticmethod
    def supports(experts: torch.nn.Module) -> bool:
        """Whether ``experts`` is a ``GroupedMLP`` (weight1/weight2) or a ``TEGroupedMLP``
        (grouped linears with weight0..)."""
        if hasattr(experts, "weight1") and hasattr(experts, "weight2"):
            return True
        fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
        return fc1 is not None and fc2 is not None and hasattr(fc1, "weight0") \
            and hasattr(fc2, "weight0")

    @property
    def num_local_experts(self) -> int:
        return self.experts.num_local_experts

    def local_weights(self, j: int) -> Tuple[torch.Tensor, ...]:
        if not self.blocks:
            return tuple(getattr(getattr(self.experts, linear), f"{kind}{j}")
                         for linear, kind in self._fields)
        return self._blocks()[j]

    def _blocks(self) -> list:
        """Every expert's (weight1 block, weight2 block), as views from one ``unbind`` each.

        Kept while the parameters are unchanged (same storage, no in-place update since) and
        the grad mode is the same; rebuilt after an optimizer step or for a recompute."""
        w1, w2 = self.experts.weight1, self.experts.weight2
        grads = tuple(getattr(w, "main_grad", None) for w in (w1, w2))
        key = (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version, torch.is_grad_enabled(),
               tuple(None if g is None else g.data_ptr() for g in grads))
        if key != self._key:
            n, hidden = self.num_local_experts, self.experts.config.hidden_size
            shapes = ((n, hidden, -1), (n, -1, hidden))
            blocks = [w.view(shape).unbind(0) for w, shape in zip((w1, w2), shapes)]
            for w, grad, shape, views in zip((w1, w2), grads, shapes, blocks):
                if grad is None:
                    continue
                # Megatron DDP: each expert's block of main_grad, so the engine adds the
                # block's gradient there in place (no full-size gradient per expert).
                for view, grad_view in zip(views, grad.view(shape).unbind(0)):
                    view.main_grad = grad_view
                    view.main_grad_owner = w
            self._views = list(zip(*blocks))
            self._key = key
        return self._views

    def run(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
            probs: torch.Tensor) -> torch.Tensor:
        slots = 1 if self.blocks else self.num_local_experts
        tokens_per_expert = torch.zeros(slots, dtype=torch.long)  # on the host, as Megatron's
        tokens_per_expert[0] = x.shape[0]
        with self._one_expert():
            return self._output(torch.func.functional_call(
                self.experts, dict(zip(self.names, weights)), (x, tokens_per_expert, probs)))

    @staticmethod
    def _output(result: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
        """The experts' output from Megatron's ``(output, bias)``: the experts add their
        biases themselves (TEGroupedMLP adds fc2's ``b_i · prob`` per expert), so a separate
        bias would be one the flat dispatch does not know how to weight."""
        out, bias = result
        if bias is not None:
            raise RuntimeError("grouped experts returned a separate bias; expected the "
                               "experts to add their biases themselves")
        return out

    @contextlib.contextmanager
    def _one_expert(self) -> Iterator[None]:
        """``GroupedMLP`` views its weights as ``num_local_experts`` blocks: one, for a call
        with one expert's blocks swapped in."""
        if not self.blocks:
            yield
            return
        n = self.experts.num_local_experts
        self.experts.num_local_experts = 1
        try:
            yield
        finally:
            self.experts.num_local_experts = n


class GroupedMLPBank(GroupedExpertsBank):
    """:class:`GroupedExpertsBank` for 0.16's ``GroupedMLP``, whose per-expert maths Megatron
    exposes (``activation_func_with_probs``), so the bank also offers the engine's
    recompute shortcuts: ``run_for_grad`` (fc2's forward GEMM skipped: its output is only
    differentiated) and ``run_saving`` (fc1's output saved for a saved chunk, standing in for
    that GEMM in backward), as :class:`~megatron_flat.megatron.moe.SequentialMLPBank` does.
    The GEMMs are the grouped kernel's per expert (``x @ w1``, ``h @ w2``); their gradients
    use the formulas of :class:`~megatron_flat.dispatch.experts.GradOnlyLinear`."""

    def _inputs(self, x: torch.Tensor, probs: torch.Tensor):
        if getattr(self.experts.config, "moe_apply_probs_on_input", False):
            x = (probs.unsqueeze(-1) * x).to(x.dtype)  # as GroupedMLP.forward does
            probs = torch.ones_like(probs)
        return x, probs.unsqueeze(-1)

    def run_saving(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                   probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        w1, w2 = weights
        x, p = self._inputs(x, probs)
        fc1 = x @ w1
        return self.experts.activation_func_with_probs(fc1, p) @ w2, fc1

    def run_for_grad(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                     probs: torch.Tensor, first: Optional[torch.Tensor] = None) -> torch.Tensor:
        from megatron_flat.dispatch.experts import GradOnlyLinear, SavedOutputLinear

        w1, w2 = weights
        x, p = self._inputs(x, probs)
        fc1 = x @ w1 if first is None else SavedOutputLinear.apply(x, w1.t(), first)
        return GradOnlyLinear.apply(self.experts.activation_func_with_probs(fc1, p), w2.t())

    # -- one grouped call over the native experts (ExpertBank's run_native*) -------------
    # The call reads weight1/weight2 whole (viewed as [E_l, H, 2F] / [E_l, F, H], as
    # GroupedMLP.forward does, through the same gmm), so its graph is differentiated with
    # respect to them (native_params) and the gradients split per expert (native_grads).
    def native_params(self) -> list:
        return [self.experts.weight1, self.experts.weight2]

    def native_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> list:
        n, hidden = self.num_local_experts, self.experts.config.hidden_size
        g1, g2 = grads
        blocks1 = [None] * n if g1 is None else g1.view(n, hidden, -1).unbind(0)
        blocks2 = [None] * n if g2 is None else g2.view(n, -1, hidden).unbind(0)
        return list(zip(blocks1, blocks2))

    def _stacked(self):
        n, hidden = self.num_local_experts, self.experts.config.hidden_size
        return (self.experts.weight1.view(n, hidden, -1),
                self.experts.weight2.view(n, -1, hidden))

    @staticmethod
    def _check(x: torch.Tensor, counts: Sequence[int], n: int) -> torch.Tensor:
        if len(counts) != n or sum(counts) != x.shape[0]:
            raise RuntimeError("PipelinedLLEP bug: native rows do not match their counts")
        return torch.tensor(list(counts), dtype=torch.long)  # on the host, as Megatron's

    def run_native(self, x: torch.Tensor, probs: torch.Tensor,
                   counts: Sequence[int]) -> torch.Tensor:
        return self.run_native_saving(x, probs, counts)[0]

    def run_native_saving(self, x: torch.Tensor, probs: torch.Tensor,
                          counts: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        batch = self._check(x, counts, self.num_local_experts)
        w1, w2 = self._stacked()
        x, p = self._inputs(x, probs)
        fc1 = gg.ops.gmm(x, w1, batch, trans_b=False)
        out = gg.ops.gmm(self.experts.activation_func_with_probs(fc1, p), w2, batch,
                         trans_b=False)
        return out, fc1

    def run_native_for_grad(self, x: torch.Tensor, probs: torch.Tensor, counts: Sequence[int],
                            first: Optional[torch.Tensor] = None) -> torch.Tensor:
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        from megatron_flat.dispatch.experts import GradOnlyGroupedLinear, SavedOutputGroupedLinear

        batch = self._check(x, counts, self.num_local_experts)
        w1, w2 = self._stacked()
        x, p = self._inputs(x, probs)
        if first is None:
            fc1 = gg.ops.gmm(x, w1, batch, trans_b=False)
        else:
            fc1 = SavedOutputGroupedLinear.apply(x, first, list(counts),
                                                 *[w.t() for w in w1.unbind(0)])
        act = self.experts.activation_func_with_probs(fc1, p)
        return GradOnlyGroupedLinear.apply(act, list(counts), *[w.t() for w in w2.unbind(0)])


class TEGroupedMLPBank(GroupedExpertsBank):
    """:class:`GroupedExpertsBank` for ``TEGroupedMLP`` (0.16 and 0.19), with the engine's
    recompute shortcuts made by shadowing its two grouped linears' ``forward`` for one call
    (one expert's rows, all in slot 0; the weights read are the swapped-in ones):

    * ``run_saving``: ``run`` plus ``linear_fc1``'s output, saved for a saved chunk;
    * ``run_for_grad``: ``linear_fc2`` returns :class:`~megatron_flat.dispatch.experts.
      GradOnlyLinear` (its forward GEMM skipped: the output is only differentiated) and, with
      ``first``, ``linear_fc1`` returns :class:`~megatron_flat.dispatch.experts.
      SavedOutputLinear` (the saved output stands in for its GEMM).

    With biases (GPT-OSS's experts) a shadowed linear gives its biases as its own forward
    does: fc1 adds ``b_i`` (:class:`~megatron_flat.dispatch.experts.BiasGrad`: the saved or
    grad-only value needs no addition, the gradient is the row sum), fc2 returns every
    expert's bias for ``TEGroupedMLP`` to add ``b_i · prob`` itself.

    Everything between the linears (activation, GLU, probabilities) stays Megatron's. When
    the module computes its experts without calling its linears (TE's fused grouped MLP),
    nothing is shadowed: ``run_saving`` then saves nothing (``None``: that expert is
    recomputed) and ``run_for_grad`` is ``run``, values computed, gradients the same.

    The native calls (``run_native``, ``run_native_for_grad``, ``run_native_saving``) run
    all local experts' rows of a chunk through Megatron's ``forward`` once, with the
    module's own weights and ``tokens_per_expert`` set from the counts, as the stock layer
    runs its whole batch; the shortcuts then use the grouped forms
    (:class:`~megatron_flat.dispatch.experts.GradOnlyGroupedLinear`,
    :class:`~megatron_flat.dispatch.experts.SavedOutputGroupedLinear`).
    """

    @contextlib.contextmanager
    def _shadowed(self, fc1=None, fc2=None) -> Iterator[None]:
        linears = [(self.experts.linear_fc1, fc1), (self.experts.linear_fc2, fc2)]
        for module, forward in linears:
            if forward is not None:
                module.forward = forward  # instance attribute: shadows the class's forward
        try:
            yield
        finally:
            for module, forward in linears:
                if forward is not None:
                    del module.forward

    def _biased(self, linear, out: torch.Tensor, splits: Optional[Sequence[int]] = None):
        """A shadowed ``linear``'s ``(output, bias)`` for the value ``out``: without biases
        ``(out, None)``; a linear that returns its biases (``skip_bias_add``: fc2) gives the
        list of every expert's; one that adds them gets their gradient path. ``splits``:
        rows per local expert (a native call), else all rows are slot 0's."""
        from megatron_flat.dispatch.experts import BiasGrad, GroupedBiasGrad

        if getattr(linear, "bias0", None) is None:
            return out, None
        biases = self._weights(linear, "bias")
        if getattr(linear, "te_return_bias", getattr(linear, "skip_bias_add", False)):
            return out, biases
        if splits is None:
            return BiasGrad.apply(out, biases[0]), None
        return GroupedBiasGrad.apply(out, list(splits), *biases), None

    def _capturing_fc1(self, captured: list):
        """``linear_fc1``'s own forward, appending its output to ``captured``."""
        fc1 = self.experts.linear_fc1

        def forward(*args, **kwargs):
            out = type(fc1).forward(fc1, *args, **kwargs)
            captured.append(out[0])
            return out

        return forward

    def run_saving(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                   probs: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        captured: list = []
        with self._shadowed(fc1=self._capturing_fc1(captured)):
            out = self.run(weights, x, probs)
        return out, (captured[0] if len(captured) == 1 else None)

    def run_for_grad(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                     probs: torch.Tensor, first: Optional[torch.Tensor] = None) -> torch.Tensor:
        from megatron_flat.dispatch.experts import GradOnlyLinear, SavedOutputLinear

        fc1, fc2 = self.experts.linear_fc1, self.experts.linear_fc2

        def fc2_forward(input_, *args, **kwargs):
            return self._biased(fc2, GradOnlyLinear.apply(input_, fc2.weight0))

        def fc1_forward(input_, *args, **kwargs):
            return self._biased(fc1, SavedOutputLinear.apply(input_, fc1.weight0, first))

        with self._shadowed(fc1=fc1_forward if first is not None else None, fc2=fc2_forward):
            return self.run(weights, x, probs)

    # -- one grouped call over the native experts (ExpertBank's run_native*) -------------
    def _native(self, x: torch.Tensor, probs: torch.Tensor, counts: Sequence[int],
                fc1=None, fc2=None) -> torch.Tensor:
        """Megatron's experts ``forward`` on the local experts' rows (``counts`` per expert),
        with the module's own weights: one grouped call."""
        if len(counts) != self.num_local_experts or sum(counts) != x.shape[0]:
            raise RuntimeError("PipelinedLLEP bug: native rows do not match their counts")
        tokens_per_expert = torch.tensor(list(counts), dtype=torch.long)  # host, as Megatron's
        with self._shadowed(fc1=fc1, fc2=fc2):
            return self._output(self.experts(x, tokens_per_expert, probs))

    def _weights(self, linear, kind: str = "weight") -> list:
        """Every local expert's ``weight{j}`` (or ``bias{j}``) of a grouped ``linear``."""
        return [getattr(linear, f"{kind}{j}") for j in range(self.num_local_experts)]

    def run_native(self, x: torch.Tensor, probs: torch.Tensor,
                   counts: Sequence[int]) -> torch.Tensor:
        return self._native(x, probs, counts)

    def run_native_saving(self, x: torch.Tensor, probs: torch.Tensor,
                          counts: Sequence[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        captured: list = []
        out = self._native(x, probs, counts, fc1=self._capturing_fc1(captured))
        return out, (captured[0] if len(captured) == 1 else None)

    def run_native_for_grad(self, x: torch.Tensor, probs: torch.Tensor, counts: Sequence[int],
                            first: Optional[torch.Tensor] = None) -> torch.Tensor:
        from megatron_flat.dispatch.experts import GradOnlyGroupedLinear, SavedOutputGroupedLinear

        fc1, fc2 = self.experts.linear_fc1, self.experts.linear_fc2

        def fc2_forward(input_, *args, **kwargs):
            return self._biased(fc2, GradOnlyGroupedLinear.apply(input_, counts,
                                                                 *self._weights(fc2)), counts)

        def fc1_forward(input_, *args, **kwargs):
            return self._biased(fc1, SavedOutputGroupedLinear.apply(
                input_, first, counts, *self._weights(fc1)), counts)

        return self._native(x, probs, counts, fc1=fc1_forward if first is not None else None,
                            fc2=fc2_forward)
