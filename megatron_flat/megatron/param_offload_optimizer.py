"""Param offload's Megatron sub-optimizer: the offloaded experts stepped where they live.

With expert parallelism, Megatron builds one sub-optimizer for the expert-parallel
Parameters (the routed experts) beside the dense one, and chains them. Under param offload
those Parameters' weights and gradients are in the host tier and in no DDP buffer, so a
stock sub-optimizer cannot take them (the distributed optimizer finds no buffer range for
them, the mixed-precision one copies its fp32 masters onto the device). While param offload
is wired, Megatron's sub-optimizer builder builds :class:`ParamOffloadOptimizer` for a call
whose parameters are all offloaded, in the same place of the chain:

* its inner optimizer is an :class:`~megatron_flat.megatron.optimizer.MegatronOffloadStreamAdamW`
  over Megatron's own parameter groups (``lr_mult``, ``wd_mult``, ... kept, so the LR
  scheduler drives it), reading each expert's host ``main_grad`` (``flat_host_grad``) and
  writing the updated weights into its host-tier view, the fp32 master and both moments in
  host memory: no fp32 gradient buffer, master or moment of an expert on the device;
* ``prepare_grads`` waits for the drains (one host sync) and hands the host gradients to
  Megatron's gradient norm, clipping and zero count (``.grad`` / ``decoupled_grad``), with
  the inf/nan check of every scaler-less flat optimizer;
* ``step_with_ready_grads`` steps, then makes every slot stale and starts the first layer's
  new weights up.

Exact where Megatron's own sub-optimizer would run the same AdamW on the same gradients: the
update is element-wise, so it equals the sharded distributed optimizer's too, at any
expert-data-parallel size (every replica holds the all-reduced gradients and updates all its
experts alike). The gradient norm sums the same per-parameter norms in the same order as the
non-distributed optimizer, and in the distributed optimizer's order (its buffer's, the model's
reversed); the distributed optimizer sums per-shard norms, so the norm is the same sum where a
rank's shard holds whole parameters (expert-DP 1) and reassociated otherwise (the first
expert-DP replica adds the whole gradients, the others nothing). Megatron's zero count
(``--log-num-zeros-in-grad``) counts every replica's.

Refused (one message, before any collective): a sub-optimizer call that mixes offloaded and
resident parameters (expert parallelism 1 puts the routed experts in the dense groups), fp16
(a loss scaler), and Megatron's non-Adam optimizers.
"""

from __future__ import annotations


import torch
from megatron.core.optimizer.optimizer import FP32Optimizer

from megatron_flat.megatron.optimizer import (
    MegatronOffloadStreamAdamW,
    claim_sub_optimizers,
    found_non_finite_grads,
    release_sub_optimizers,
    sub_optimizers_claimed,
)
from megatron_flat.params import ParamOffloadError
from megatron_flat.runtime import patching

__all__ = ["ParamOffloadOptimizer", "claim", "is_wired", "unwire_optimizer", "wire_optimizer"]

GRAD_ATTR = "flat_host_grad"


class ParamOffloadOptimizer(FP32Optimizer):
    """Megatron's sub-optimizer over the offloaded experts (module docstring)."""

    def __init__(self, optimizer, config, offload, grad_stats_group,
                 counts_in_norm: bool = True) -> None:
        super().__init__(optimizer, config, init_state_fn=_init_state)
        self.offload = offload
        self.grad_stats_parallel_group = grad_stats_group
        self._scale = torch.tensor([1.0], dtype=torch.float, device=offload.device)
        # The distributed optimizer's grad-stats group spans the expert-DP replicas, which
        # all hold the whole reduced gradients: one of them adds them to the norm.
        self.counts_in_norm = counts_in_norm

    def get_main_grads_for_grad_norm(self):  # 0.16
        if not self.counts_in_norm:
            return []
        return _for_device_norm(super().get_main_grads_for_grad_norm())

    def get_grads_for_grad_norm(self, *args, **kwargs):  # 0.19
        if not self.counts_in_norm:
            return []
        return _for_device_norm(super().get_grads_for_grad_norm(*args, **kwargs))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.get_parameters():  # the host gradients are DDP's zero_grad_buffer's
            p.grad = None
            p.decoupled_grad = None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        for index, layer in enumerate(self.offload.params):
            for p, grad in zip(layer, self.offload.host_grads(index)):
                setattr(p, GRAD_ATTR, grad)
                # What Megatron's norm, clipping and zero count read: the fp32 gradient, as
                # they read a mixed-precision optimizer's fp32 main param's.
                if p.dtype != grad.dtype:
                    p.grad_dtype = None  # a bf16 weight with its fp32 gradient
                p.grad = grad
                p.decoupled_grad = grad
        return found_non_finite_grads(self)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        ok = super().step_with_ready_grads()
        self.offload.weights_updated()
        return ok

    # A checkpoint load writes the model's host views (the Parameters' data at rest) before
    # the optimizer's state: the slots are stale after either.
    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.offload.weights_updated()

    def reload_model_params(self, state_dict=None) -> None:
        """The model's weights changed outside the optimizer (``--no-load-optim``,
        ``--finetune``): the host fp32 masters follow them, and the slots are stale."""
        self.optimizer.reload_model_params()
        self.offload.weights_updated()


def _on_host(grad: torch.Tensor) -> bool:
    """A gradient in host memory while the model trains on a GPU (param offload's), which
    Megatron's fused norm and scale kernels cannot read. On a CPU-only run nothing is."""
    return grad.device.type == "cpu" and torch.cuda.is_available()


def _for_device_norm(grads: list, device=None) -> list:
    """The gradients Megatron's norm reads, the host ones as one device tensor of their
    per-parameter fp32 norms: its sum of squares is theirs (reassociated: the fused kernel
    would have summed their elements in its own order)."""
    host = [g for g in grads if _on_host(g)]
    if not host:
        return grads
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in host])
    device = device or torch.device("cuda", torch.cuda.current_device())
    return [g for g in grads if not _on_host(g)] + [norms.to(device, non_blocking=True)]


def _clipping(original):
    """Megatron's ``clip_grad_by_total_norm_fp32`` with host gradients scaled on the host by
    the same coefficient (``max_norm / (total_norm + 1e-6)``, when below 1) and the others
    passed on; on a CPU-only run everything is passed on."""
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, *args, **kwargs):
        decoupled = kwargs.get("use_decoupled_grad", args[0] if args else False)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)

        def grad_of(p):
            return getattr(p, "decoupled_grad", None) if decoupled else p.grad

        host = [p for p in params if grad_of(p) is not None and _on_host(grad_of(p))]
        if host:
            coeff = max_norm / (total_norm + 1.0e-6)
            if coeff < 1.0:
                for p in host:
                    grad_of(p).mul_(coeff)
            params = [p for p in params if not any(p is h for h in host)]
        return original(params, max_norm, total_norm, *args, **kwargs)
    return clip_grad_by_total_norm_fp32


CLIP_PATCH = patching.Patch(
    "megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32", _clipping,
    expects="Megatron's gradient clipping by a total norm",
    why="param offload: the experts' host gradients are clipped on the host (Megatron's "
        "fused scale kernel reads device memory)")


def _init_state(optimizer, config=None) -> None:
    optimizer.init_state()


def _offloaded(param_groups) -> tuple:
    params = [p for g in param_groups for p in g["params"]]
    offloads = {id(getattr(p, "flat_param_offload", None)): getattr(p, "flat_param_offload",
                                                                   None) for p in params}
    offloads.pop(id(None), None)
    return params, list(offloads.values())


def _argument(args, kwargs, index: int, name: str, default=None):
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else default)


def _build(config, param_groups, offload, grad_stats_group, flat, counts_in_norm=True):
    problems = []
    if getattr(config, "optimizer", "adam") != "adam":
        problems.append(f"--optimizer {config.optimizer}: the offloaded experts step with AdamW")
    if getattr(config, "fp16", False):
        problems.append("--fp16: a loss scaler is not supported with param offload (use bf16)")
    if problems:
        raise ParamOffloadError("param offload cannot build the experts' optimizer:\n  - "
                                + "\n  - ".join(problems))
    groups = [dict(g) for g in param_groups]
    if getattr(config, "use_distributed_optimizer", False):
        # The distributed optimizer lists a group's parameters in its buffer's order, which
        # is the model's reversed (DDP lays buffers out for the backward); the gradient norm
        # sums their norms in that order.
        for group in groups:
            group["params"] = list(reversed(group["params"]))
    inner = MegatronOffloadStreamAdamW.over_param_groups(
        groups, lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
        weight_decay=config.weight_decay, bucket_numel=flat.optimizer_bucket_numel,
        num_slots=flat.optimizer_num_slots, grad_attr=GRAD_ATTR, device=offload.device)
    return ParamOffloadOptimizer(inner, config, offload, grad_stats_group, counts_in_norm)


def claim(args, kwargs, flat):
    """The sub-optimizer builder's claim (optimizer.claim_sub_optimizers): a call whose
    parameters are offloaded experts gets a :class:`ParamOffloadOptimizer`; None otherwise."""
    param_groups = _argument(args, kwargs, 2, "param_groups", [])
    params, offloads = _offloaded(param_groups)
    if not offloads:
        return None
    if len(offloads) > 1 or any(getattr(p, "flat_param_offload", None) is None for p in params):
        raise ParamOffloadError(
            "param offload: Megatron builds one optimizer for offloaded and resident "
            "parameters together; the routed experts need their own (expert parallelism > 1, "
            "--expert-model-parallel-size)")
    config = _argument(args, kwargs, 0, "config")
    distributed = bool(getattr(config, "use_distributed_optimizer", False))
    group = (_argument(args, kwargs, 8, "intra_dist_opt_group") if distributed
             else _argument(args, kwargs, 4, "model_parallel_group"))
    replicas = _argument(args, kwargs, 5, "data_parallel_group")
    first = replicas is None or replicas.rank() == 0
    return _build(config, param_groups, offloads[0], group, flat,
                  counts_in_norm=first or not distributed)


def is_wired() -> bool:
    return sub_optimizers_claimed(claim)


def wire_optimizer() -> None:
    """While OffloadStreamAdamW is wired (--flat-optimizer-offload), every sub-optimizer
    over offloaded experts is a :class:`ParamOffloadOptimizer`, and Megatron's clipping
    takes host gradients."""
    claim_sub_optimizers(claim)
    patching.apply(CLIP_PATCH)


def unwire_optimizer() -> None:
    release_sub_optimizers(claim)
    patching.revert(CLIP_PATCH)
