"""Param offload on Megatron's MoE layers: the routed experts' Parameters follow the slots.

:func:`attach_param_offload` takes the flat MoE layers of a built model (in forward order),
hands every routed expert's Parameters (``layer.experts.parameters()``: SequentialMLP's
fc1/fc2, GroupedMLP's weight1/weight2, TEGroupedMLP's weight{j}/bias{j}) to a
:class:`ModuleParamOffload` and runs each layer's routed experts
(``FlatMoELayer.routed_experts_flat``: dispatch, experts, combine) as that offload's layer.
The router and shared experts stay where Megatron put them.

Each Parameter keeps its identity; its ``.data`` is its host-tier view at rest (so anything
that reads the model outside a layer — a checkpoint, a norm, an optimizer — reads the truth)
and its device slot's view while its layer runs; its ``main_grad`` is its gradient slot's
view, the buffer Megatron's DDP protocol adds into (``grad_added_to_main_grad``). A gradient
autograd leaves in ``.grad`` is folded into ``main_grad`` by a post-accumulate hook, as
DDP's hook does. Nothing else of Megatron's is touched here: keeping these Parameters out of
DDP's buffers and stepping them with a host-side AdamW is the optimizer glue's part.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from megatron_flat.params import ParamOffload, ParamOffloadError, offloaded_layer

__all__ = ["ModuleParamOffload", "attach_param_offload", "fold_into_main_grad",
           "offloadable_layers"]


def fold_into_main_grad(param: torch.nn.Parameter) -> None:
    """DDP's gradient hook for a Parameter outside DDP's buffers: ``main_grad += grad``
    unless the layer already added it there (its fused-accumulation flag)."""
    if param.grad is not None and not param.grad_added_to_main_grad:
        param.main_grad.add_(param.grad.data)
    param.grad = None


class ModuleParamOffload(ParamOffload):
    """A :class:`~megatron_flat.params.ParamOffload` over model Parameters (module doc):
    ``.data`` is re-pointed at the slot on :meth:`acquire` and back at the host view when
    the layer releases it."""

    def __init__(self, params: Sequence[Sequence[torch.nn.Parameter]], **kwargs) -> None:
        params = [list(layer) for layer in params]
        for layer in params:
            for p in layer:
                if not isinstance(p, torch.nn.Parameter):
                    raise TypeError(f"param offload: expected Parameters, got {type(p).__name__}")
        super().__init__([[p.detach() for p in layer] for layer in params], **kwargs)
        self.params = params
        self._hooks = []
        for index, layer in enumerate(params):
            for p, host, device in zip(layer, self.host_weights(index), self.weights(index)):
                p.data = host  # the device copy Megatron allocated is freed with its last ref
                p.main_grad = device.main_grad
                p.grad_added_to_main_grad = False
                self._hooks.append(p.register_post_accumulate_grad_hook(fold_into_main_grad))

    def acquire(self, layer: int) -> List[torch.Tensor]:
        views = super().acquire(layer)
        for p, view in zip(self.params[layer], views):
            p.data = view
        return views

    def release(self, layer: int) -> None:
        super().release(layer)
        if not self.in_use(layer):
            for p, host in zip(self.params[layer], self.host_weights(layer)):
                p.data = host

    def zero_grad(self) -> None:
        super().zero_grad()
        for layer in self.params:
            for p in layer:
                p.grad_added_to_main_grad = False


def offloadable_layers(model: torch.nn.Module) -> list:
    """The model's flat MoE layers whose dispatch is flat (``FlatMoELayer`` with
    ``--flat-dispatch`` on), in module order (forward order within a pipeline stage)."""
    from megatron_flat.megatron.moe import FlatMoELayer

    return [m for m in model.modules()
            if isinstance(m, FlatMoELayer) and m.flat_dispatch is not None]


def _route_through(layer, offload: ParamOffload, index: int) -> None:
    routed = layer.routed_experts_flat  # the bound method of the class

    def routed_experts_flat(hidden_states, probs, routing_map, padding_mask=None):
        def experts(_weights, hidden_states, probs):
            return routed(hidden_states, probs, routing_map, padding_mask)

        return offloaded_layer(offload, index, experts, hidden_states, probs)

    layer.routed_experts_flat = routed_experts_flat  # instance attribute: shadows the class's


def attach_param_offload(model: torch.nn.Module, **kwargs) -> ModuleParamOffload:
    """Offload the routed experts of every flat MoE layer of ``model`` (module doc); kwargs
    go to :class:`ModuleParamOffload` (``tier``, ``device``, slots). Raises
    :class:`~megatron_flat.params.ParamOffloadError` when the model has no flat MoE layer."""
    layers = offloadable_layers(model)
    if not layers:
        raise ParamOffloadError("param offload: the model has no flat MoE layer "
                                "(--flat-dispatch llep or pipelined) whose experts to offload")
    for layer in layers:
        if getattr(layer, "param_offload", None) is not None:
            raise ParamOffloadError("param offload: a layer is already offloaded")
    offload = ModuleParamOffload([list(layer.experts.parameters()) for layer in layers],
                                 **kwargs)
    for index, layer in enumerate(layers):
        _route_through(layer, offload, index)
        layer.param_offload = offload
    return offload
