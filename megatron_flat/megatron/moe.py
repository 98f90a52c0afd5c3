"""``FlatMoELayer``: Megatron-Core's ``MoELayer`` with LLEP / PipelinedLLEP dispatch.

Everything up to the routing decision is Megatron's: the router (top-k, score function, aux
loss, z-loss, expert bias, token dropping) runs untouched through ``MoELayer.route``, and the
experts are Megatron's modules, whose own forward computes every expert: ``SequentialMLP``
(:class:`SequentialMLPBank`) or the grouped-GEMM experts ``GroupedMLP`` / ``TEGroupedMLP``
(:class:`~megatron_flat.megatron.grouped_bank.GroupedExpertsBank`). Only dispatch → expert
compute → combine is replaced, by :class:`~megatron_flat.dispatch.llep.PipelinedLLEP` over the
layer's expert-parallel group.
With ``FlatConfig.dispatch == "off"`` the layer is the stock ``MoELayer``.

Select it through the layer spec (:mod:`megatron_flat.megatron.spec`), which also passes the
``FlatConfig``; without one the layer uses the installed config (``megatron_flat.install``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_flat.config import FlatConfig
from megatron_flat.dispatch.experts import GradOnlyLinear, SavedOutputLinear
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.dispatch.schedule import routes_from_map
from megatron_flat.megatron import compat, layer_kwargs_note, regions
from megatron_flat.megatron.grouped_bank import (
    GroupedExpertsBank,
    GroupedMLPBank,
    TEGroupedMLPBank,
)
from megatron_flat.megatron.moe_refusals import refused_settings

__all__ = ["FlatMoELayer", "SequentialMLPBank", "expert_bank", "replay_routing",
           "unsupported_settings"]


class SequentialMLPBank:
    """:class:`~megatron_flat.dispatch.experts.ExpertBank` over Megatron's ``SequentialMLP``.

    ``run`` calls Megatron's own ``MLP.forward(x, per_token_scale=probs)``: a native expert's
    module when given that expert's parameters, else the first local expert's module with the
    given weights swapped in (``torch.func.functional_call``; spilled experts on a helper). So
    every expert runs Megatron's code path for the configured activation, GLU, bias and fusions
    — the same kernels the alltoall dispatcher's experts use. ``moe_apply_probs_on_input`` is
    applied first, as ``SequentialMLP.forward`` does.
    """

    def __init__(self, experts: SequentialMLP, config):
        self.experts = experts
        self.apply_probs_on_input = bool(getattr(config, "moe_apply_probs_on_input", False))
        template = experts.local_experts[0]
        self.names = [name for name, _ in template.named_parameters()]
        self._index: dict = {}
        self._index_weights: list = []
        for expert in experts.local_experts:
            # The experts' weight gradients leave through PipelinedLLEPFunction, so the linears
            # must return them rather than fuse them into ``main_grad`` themselves.
            for module in expert.modules():
                if getattr(module, "gradient_accumulation_fusion", False):
                    module.gradient_accumulation_fusion = False

    @property
    def num_local_experts(self) -> int:
        return len(self.experts.local_experts)

    def local_weights(self, j: int) -> Tuple[torch.Tensor, ...]:
        params = dict(self.experts.local_experts[j].named_parameters())
        return tuple(params[name] for name in self.names)

    def run(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
            probs: torch.Tensor) -> torch.Tensor:
        if self.apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        module = self._owner_of(weights)
        if module is not None:  # a native expert with its own parameters: call it directly
            out, bias = module(x, probs)
        else:  # a spilled expert's weights (or detached copies): run them in expert 0's code
            out, bias = torch.func.functional_call(self.experts.local_experts[0],
                                                   dict(zip(self.names, weights)), (x, probs))
        if bias is not None:  # MLP folds the bias in when given per_token_scale
            raise RuntimeError("expert MLP returned a separate bias; expected it folded in")
        return out

    @staticmethod
    def _plain_fc1(module) -> bool:
        """Whether ``linear_fc1`` is a one-rank, bias-free ColumnParallelLinear, whose output
        can be saved from forward and stand in for its GEMM in backward."""
        fc1 = module.linear_fc1
        return type(fc1) is ColumnParallelLinear and get_pg_size(fc1.tp_group) == 1 \
            and fc1.bias is None

    def run_saving(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                   probs: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``run`` plus ``linear_fc1``'s output, to save for backward (None when fc1 is not
        :meth:`_plain_fc1`: that expert is then recomputed)."""
        module = self._owner_of(weights) or self.experts.local_experts[0]
        if not self._plain_fc1(module):
            return self.run(weights, x, probs), None
        fc1, captured = module.linear_fc1, []

        def forward(*args, **kwargs):
            out = type(fc1).forward(fc1, *args, **kwargs)
            captured.append(out[0])
            return out

        fc1.forward = forward  # instance attribute: shadows the class's forward
        try:
            out = self.run(weights, x, probs)
        finally:
            del fc1.forward
        return out, captured[0]

    def run_for_grad(self, weights: Sequence[torch.Tensor], x: torch.Tensor,
                     probs: torch.Tensor, first: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``run`` for a graph that is only differentiated (backward recompute): ``linear_fc2``
        skips its forward GEMM (:class:`GradOnlyLinear`, whose backward has the formulas of
        Megatron's non-fused linear backward), and with ``first`` (from :meth:`run_saving`)
        ``linear_fc1`` returns it instead of recomputing it (:class:`SavedOutputLinear`).
        Falls back to ``run`` for any other fc2."""
        module = self._owner_of(weights) or self.experts.local_experts[0]
        fc1, fc2 = module.linear_fc1, module.linear_fc2
        if type(fc2) is not RowParallelLinear or get_pg_size(fc2.tp_group) != 1:
            return self.run(weights, x, probs)

        def forward(input_, *args, **kwargs):
            out = GradOnlyLinear.apply(input_, fc2.weight)
            if fc2.bias is not None and not fc2.skip_bias_add:
                out = out + fc2.bias
            return out, (fc2.bias if fc2.skip_bias_add else None)

        def saved_forward(input_, *args, **kwargs):
            return SavedOutputLinear.apply(input_, fc1.weight, first), None

        # Instance attributes: they shadow the classes' forward for this call.
        fc2.forward = forward
        if first is not None:
            if not self._plain_fc1(module):
                raise RuntimeError("PipelinedLLEP bug: a saved fc1 output for an fc1 that "
                                   "cannot take one")
            fc1.forward = saved_forward
        try:
            return self.run(weights, x, probs)
        finally:
            del fc2.forward
            if first is not None:
                del fc1.forward

    def _owner_of(self, weights: Sequence[torch.Tensor]):
        """The local expert module whose parameters ``weights`` are, else None.

        Called once per expert per chunk, so it compares identities against a cached tuple
        per expert; the cache is rebuilt (once per call) only when a parameter was replaced.
        """
        for attempt in range(2):
            j = self._index.get(id(weights[0]))
            if j is not None and all(a is b for a, b in zip(self._index_weights[j], weights)):
                return self.experts.local_experts[j]
            if attempt == 0:  # parameters may have been replaced since: index them again
                self._index_weights = [self.local_weights(j)
                                       for j in range(self.num_local_experts)]
                self._index = {id(own[0]): j for j, own in enumerate(self._index_weights)}
        return None


def unsupported_settings(config, layer: Optional[MoELayer] = None) -> list[str]:
    """Why the flat dispatch cannot run an MoE layer with ``config`` (empty: it can): the
    settings of :mod:`megatron_flat.megatron.moe_refusals`, and with ``layer`` its experts'
    module."""
    problems = refused_settings(config)
    if layer is not None and not isinstance(layer.experts, SequentialMLP) \
            and not GroupedExpertsBank.supports(layer.experts):
        problems.append(f"expert module {type(layer.experts).__name__} is not supported: use "
                        "SequentialMLP or grouped-GEMM experts (GroupedMLP, TEGroupedMLP)")
    return problems


def expert_bank(experts: torch.nn.Module, config):
    """The dispatch engine's bank over a layer's experts: ``SequentialMLP`` or grouped."""
    if isinstance(experts, SequentialMLP):
        return SequentialMLPBank(experts, config)
    if hasattr(experts, "weight1") and hasattr(experts, "activation_func_with_probs"):
        return GroupedMLPBank(experts, config)  # 0.16's GroupedMLP: recompute shortcuts too
    if hasattr(getattr(experts, "linear_fc1", None), "weight0"):
        return TEGroupedMLPBank(experts, config)  # TEGroupedMLP: shortcuts via its linears
    return GroupedExpertsBank(experts, config)


class FlatMoELayer(MoELayer):
    """``MoELayer`` whose dispatch is LLEP (``flat.dispatch == "llep"``) or PipelinedLLEP
    (``"pipelined"``); ``"off"`` is the stock layer.

    Accepts every ``MoELayer`` argument of the installed release (0.19 adds ``is_mtp_layer``
    and ``name``) plus ``flat``. Raises ``ValueError`` at construction, naming every setting
    the flat dispatch does not support (see :func:`unsupported_settings`).
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None,
                 pg_collection=None, flat: Optional[FlatConfig] = None, **kwargs):
        layer_kwargs_note.install_filter(FlatMoELayer)  # later layers: no "Unknown MLP type"
        if flat is None:
            from megatron_flat.megatron.state import installed

            flat = installed() or FlatConfig()
        if flat.dispatch != "off":
            # Before MoELayer builds its dispatcher: a refused one (flex) may not even build.
            self._refuse(flat, unsupported_settings(config))
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self.flat = flat
        self.flat_dispatch: Optional[PipelinedLLEP] = None
        if flat.dispatch == "off":
            return
        self._refuse(flat, unsupported_settings(config, self))
        if flat.dispatch_graph_only_recompute:
            regions.enable()  # Megatron's checkpoint re-runs open recompute regions
        self.flat_dispatch = PipelinedLLEP(
            expert_bank(self.experts, config), num_experts=config.num_moe_experts,
            topk=config.moe_router_topk, options=DispatchOptions.from_flat_config(flat),
            group=self.ep_group)

    def _issue_shared_experts(self, hidden_states: torch.Tensor) -> None:
        """``--moe-shared-expert-overlap``: the shared experts' whole forward (TP gather, fc1
        and activation, fc2, TP reduce) is issued on their own stream before routing, so on a
        GPU it runs while the router and PipelinedLLEP's first dispatch run on the main
        stream; :meth:`SharedExpertMLP.get_output` joins it after the routed experts (the
        same stages, in the same order, as Megatron's alltoall dispatcher calls them). The
        math is the shared experts' own forward: the output equals the unoverlapped one."""
        shared = self.shared_experts
        shared.pre_forward_comm(hidden_states)
        shared.linear_fc1_forward_and_act()
        shared.linear_fc2_forward()
        shared.post_forward_comm()

    @staticmethod
    def _refuse(flat: FlatConfig, problems: list) -> None:
        if problems:
            raise ValueError(f"FlatMoELayer (--flat-dispatch {flat.dispatch}) cannot run this MoE "
                             "layer:\n  - " + "\n  - ".join(problems))

    def routed_experts_flat(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                            routing_map: torch.Tensor,
                            padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dispatch, expert compute and combine of the routed experts (Megatron's
        preprocess → dispatch → routed_experts_compute → combine → postprocess)."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        # Top-k routing without token dropping or padding gives every token exactly k
        # routes: then the routes are read without waiting for the device.
        exact = self.config.moe_expert_capacity_factor is None and padding_mask is None
        known = tokens.shape[0] * self.config.moe_router_topk if exact else None
        if known is not None and self.flat.debug_checks:
            found = int(routing_map.sum())
            if found != known:
                raise RuntimeError(f"FlatMoELayer: the routing map holds {found} routes, not "
                                   f"N·k = {known}: a router that drops or pads tokens")
        token, expert = routes_from_map(routing_map, known)
        out = self.flat_dispatch(tokens, token, expert, probs[token, expert])
        return out.view(shape)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        if self.flat_dispatch is None:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if intermediate_tensors is not None:
            raise NotImplementedError("FlatMoELayer does not support partial CUDA-graph capture "
                                      "of the MoE layer (intermediate_tensors)")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError(
                "During training, performance may degrade if MoE and tensor parallelism"
                "are enabled without also enabling sequence parallelism."
            )
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def custom_forward(hidden_states, padding_mask=None):
            overlap = self.use_shared_expert and self.shared_expert_overlap
            if overlap:
                self._issue_shared_experts(hidden_states)
                shared_expert_output = None
            else:
                shared_expert_output = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            output = self.routed_experts_flat(hidden_states, probs, routing_map, padding_mask)
            if overlap:
                shared_expert_output = self.shared_experts.get_output()
            if shared_expert_output is not None:
                output = output + shared_expert_output
            return output, None

        if compat.moe_layer_recompute(self):
            return tensor_parallel.checkpoint(custom_forward, False, hidden_states, padding_mask)
        return custom_forward(hidden_states, padding_mask)


@contextlib.contextmanager
def replay_routing(layer: MoELayer, expert_ids: torch.Tensor) -> Iterator[None]:
    """Route ``layer``'s forwards inside the block to ``expert_ids`` (``[N, k]`` int64, this
    rank's tokens in ``[s * b]`` order) through Megatron's own ``RouterReplay``.

    The router still computes its logits and scores, so probabilities, aux losses and router
    gradients are Megatron's; only the top-k choice is fixed. For tests and benchmarks with
    synthetic routing profiles; the layer must be built with ``moe_enable_routing_replay=True``.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = getattr(layer.router, "router_replay", None)
    if replay is None:
        raise ValueError("replay_routing needs a layer built with moe_enable_routing_replay=True")
    replay.set_target_indices(expert_ids)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        replay.clear_indices()
        replay.clear_router_replay_action()
