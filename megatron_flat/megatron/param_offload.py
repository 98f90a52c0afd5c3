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

import contextlib
from typing import Iterator, List, Sequence

import torch

from megatron_flat.params import ParamOffload, ParamOffloadError, offloaded_layer
from megatron_flat.runtime import patching

__all__ = ["DDP_PATCH", "ModuleParamOffload", "OffloadedGrads", "attach_param_offload",
           "fold_into_main_grad", "megatron_problems", "offloadable_layers", "offloading",
           "unwire_ddp", "wire_ddp"]


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
                p.flat_param_offload = self  # its optimizer finds it (param_offload_optimizer)
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

    def close(self) -> None:
        """The Parameters let go of the host tier and the slots (their data an empty
        tensor, no ``main_grad``, no gradient hook), then the tier's buffer and the slots
        are given back (``ParamOffload.close``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for layer in self.params:
            for p in layer:
                p.data = torch.empty(0, dtype=p.dtype)
                for name in ("main_grad", "flat_param_offload"):
                    p.__dict__.pop(name, None)
        super().close()


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


# ------------------------------------------------------------------------------ DDP
# The offloaded Parameters stay out of Megatron's DDP buffers (no device param_data or
# grad_data for them: the point of the offload); their host gradients get what DDP gives a
# buffer's, in the same order: the scaling factor, the reduction over the same group with
# the same op, and the later scaling by 1/num_tokens.
_DDP = "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel"


class OffloadedGrads:
    """What DDP does to a buffer's gradients, done to the offloaded layers' host gradients:
    ``finish`` (after DDP's own ``finish_grad_sync``) scales each by the factor DDP gives
    its kind of parameter and reduces it over that kind's data-parallel group; ``scale``
    follows ``scale_gradients``; ``zero`` follows ``zero_grad_buffer``."""

    def __init__(self, ddp, offload: ModuleParamOffload) -> None:
        cfg = ddp.ddp_config
        if getattr(cfg, "num_distributed_optimizer_instances", 1) > 1:
            raise ParamOffloadError("param offload: --num-distributed-optimizer-instances > 1 "
                                    "is not supported (the host gradients would need the "
                                    "instances' all-reduce too)")
        self.offload = offload
        self.average = bool(cfg.average_in_collective)
        dp_cp = ddp.dp_cp_group.size()
        self.kinds = []  # per layer: (factor, group)
        for layer in offload.params:
            expert = not getattr(layer[0], "allreduce", True)
            if any((not getattr(p, "allreduce", True)) != expert for p in layer):
                raise ParamOffloadError("param offload: a layer mixes expert-parallel and "
                                        "data-parallel parameters")
            if self.average:
                factor = ddp.expt_dp_group.size() / dp_cp if expert else 1.0
            else:
                factor = 1.0 / dp_cp
            self.kinds.append((factor, ddp.intra_expt_dp_group if expert
                               else ddp.intra_dp_cp_group))

    def finish(self) -> None:
        import torch.distributed as dist

        op = dist.ReduceOp.AVG if self.average else dist.ReduceOp.SUM
        for index, (factor, group) in enumerate(self.kinds):
            flat = self.offload.host_grad_range(index)
            if factor != 1.0:
                flat.mul_(factor)  # as DDP scales a bucket before its collective
            if group.size() > 1:
                _all_reduce(flat, op, group, self.offload.device)

    def scale(self, factor) -> None:
        if isinstance(factor, torch.Tensor):
            factor = factor.item()  # a host read of a device scalar (0.19's per-token scale)
        for index in range(len(self.kinds)):
            self.offload.host_grad_range(index).mul_(factor)

    def zero(self) -> None:
        self.offload.zero_grad()


def _all_reduce(host: torch.Tensor, op, group, device: torch.device) -> None:
    """All-reduce a host tensor over ``group``: in place on a CPU backend (gloo), through a
    device copy on one that reduces device memory (NCCL)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo" or device.type == "cpu":
        dist.all_reduce(host, op=op, group=group)
        return
    staged = host.to(device, non_blocking=True)
    dist.all_reduce(staged, op=op, group=group)
    host.copy_(staged)


def _outside_buffers(params):
    """Hide ``params`` from DDP's constructor (it takes only parameters that require grad)."""
    import contextlib

    @contextlib.contextmanager
    def hidden():
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)

    return hidden()


def _ddp_init(original):
    def __init__(self, config, ddp_config, module, *args, **kwargs):
        if not offloadable_layers(module) or any(
                getattr(m, "param_offload", None) is not None for m in module.modules()):
            return original(self, config, ddp_config, module, *args, **kwargs)
        offload = attach_param_offload(module)
        offload.shards = None  # the distributed optimizer's cut, when there is one (below)
        if kwargs.get("full_param_layout") is not None:
            kwargs["full_param_layout"] = None  # laid out with the offloaded Parameters in it
        with _outside_buffers([p for layer in offload.params for p in layer]):
            original(self, config, ddp_config, module, *args, **kwargs)
        if self.ddp_config.use_distributed_optimizer:
            from megatron_flat.megatron.param_offload_shards import expert_shards

            offload.shards = expert_shards(self, module, offload)
        _follow_buffers(self, OffloadedGrads(self, offload))
    return __init__


def _follow_buffers(ddp, grads: OffloadedGrads) -> None:
    """This DDP's finish_grad_sync, scale_gradients and zero_grad_buffer also serve the host
    gradients (instance methods: they live with this DDP, whatever is patched later)."""
    import types

    ddp.flat_param_offload = grads
    finish, scale, zero = ddp.finish_grad_sync, ddp.scale_gradients, ddp.zero_grad_buffer

    def finish_grad_sync(self, *args, **kwargs):
        out = finish(*args, **kwargs)
        grads.finish()
        return out

    def scale_gradients(self, scaling_factor, *args, **kwargs):
        out = scale(scaling_factor, *args, **kwargs)
        grads.scale(scaling_factor)
        return out

    def zero_grad_buffer(self, *args, **kwargs):
        out = zero(*args, **kwargs)
        grads.zero()
        return out

    for method in (finish_grad_sync, scale_gradients, zero_grad_buffer):
        setattr(ddp, method.__name__, types.MethodType(method, ddp))


DDP_PATCH = patching.Patch(
    _DDP, "__init__", _ddp_init, expects="DistributedDataParallel.__init__",
    why="param offload: the flat MoE layers' routed experts go to the host tier and stay out "
        "of DDP's device buffers")


@contextlib.contextmanager
def offloading(flat) -> Iterator[None]:
    """Within the block, DDPs built offload their flat MoE layers' experts and the optimizer
    chain steps them (what ``install`` wires for the whole process; nests with it)."""
    from megatron_flat.megatron import param_offload_optimizer as optimizer

    wired = patching.is_applied(DDP_PATCH), optimizer.is_wired()
    wire_ddp()
    optimizer.wire_optimizer()
    try:
        yield
    finally:
        if not wired[1]:
            optimizer.release_claim()  # the built chain keeps its norm hand-over
        if not wired[0]:
            unwire_ddp()


def wire_ddp() -> None:
    """Every DDP built from now on offloads its module's flat MoE layers' experts."""
    patching.apply(DDP_PATCH)


def unwire_ddp() -> None:
    """DDPs built later keep their experts in their buffers (built ones keep theirs out)."""
    patching.revert(DDP_PATCH)


def _get(megatron, *names, default=None):
    for name in names:
        value = getattr(megatron, name, None)
        if value is not None:
            return value
    return default


def megatron_problems(megatron) -> list:
    """Megatron settings param offload cannot honour (Megatron-LM args or a
    TransformerConfig; only settings present are checked)."""
    problems = []
    if (_get(megatron, "expert_model_parallel_size", default=1) or 1) < 2:
        problems.append("needs --expert-model-parallel-size > 1: with EP 1 Megatron builds one "
                        "optimizer for the routed experts and the dense parameters together, "
                        "and the offloaded experts need their own")
    if _get(megatron, "fp16", default=False):
        problems.append("--fp16: its loss scaler is not supported (use --bf16)")
    if _get(megatron, "data_parallel_random_init", default=False):
        problems.append("--data-parallel-random-init broadcasts every parameter with NCCL, "
                        "which cannot read the host-tier weights")
    for flag, name in (("--use-torch-fsdp2", "use_torch_fsdp2"),
                       ("--use-megatron-fsdp", "use_megatron_fsdp"),
                       ("--use-custom-fsdp", "use_custom_fsdp")):
        if _get(megatron, name, default=False):
            problems.append(f"{flag}: param offload works with Megatron's DDP")
    if (_get(megatron, "num_distributed_optimizer_instances", default=1) or 1) > 1:
        problems.append("--num-distributed-optimizer-instances > 1 is not supported")
    return problems
