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
* ``prepare_grads`` waits for the drains (one host sync) and runs the inf/nan check of every
  scaler-less flat optimizer on the host gradients;
* Megatron's gradient norm reads them as it reads any sub-optimizer's (on a GPU, whose fused
  norm kernel reads device memory only, as one device tensor of their per-parameter norms: the
  same sum of squares, reassociated); its clipping does not see them (it scales device memory
  only): the chain hands its norm over (a declared patch of ``ChainedOptimizer.get_grad_norm``)
  and ``step_with_ready_grads`` clips them on the host by Megatron's own coefficient, steps,
  then makes every slot stale and starts the first layer's new weights up.

Exact where Megatron's own sub-optimizer would run the same AdamW on the same gradients: the
update is element-wise, so it equals the sharded distributed optimizer's too, at any
expert-data-parallel size (every replica holds the all-reduced gradients and updates all its
experts alike). The gradient norm sums the same partial norms in the same order as Megatron
would: the non-distributed optimizer's per-parameter ones; with the distributed optimizer,
the pieces its shards would hold on this rank (``distopt_layout``: the experts laid out as
DDP's expert buffer would lay them out, cut over the expert data-parallel group), in its
order, so the norm and the clipped update are bitwise at any expert-DP size. Megatron's
zero count (``--log-num-zeros-in-grad``) reads the host gradients the same way (a declared
patch of ``ChainedOptimizer.count_zeros`` shows them where the chain counts all its
parameters in one call; one expert-DP replica counts them, an integer sum).

Refused (one message, before any collective): a sub-optimizer call that mixes offloaded and
resident parameters (expert parallelism 1 puts the routed experts in the dense groups), fp16
(a loss scaler), and Megatron's non-Adam optimizers.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from megatron.core.optimizer.optimizer import FP32Optimizer

from megatron_flat.megatron.optimizer import (
    MegatronOffloadStreamAdamW,
    claim_sub_optimizers,
    found_non_finite_grads,
    release_sub_optimizers,
    sub_optimizers_claimed,
)
from megatron_flat.megatron.param_offload_shards import (
    gather_weights,
    piece_params,
    pieces_of,
    sharded_state,
)
from megatron_flat.params import ParamOffloadError
from megatron_flat.runtime import patching

__all__ = ["NORM_PATCH", "ZEROS_PATCH", "ParamOffloadOptimizer", "claim", "clip_host_grads",
           "is_wired", "release_claim", "unwire_optimizer", "wire_optimizer"]

GRAD_ATTR = "flat_host_grad"
# Marks a checkpoint state dict whose experts' state is whole tensors in model space.
_MODEL_SPACE = "param_offload_model_space"


class ParamOffloadOptimizer(FP32Optimizer):
    """Megatron's sub-optimizer over the offloaded experts (module docstring)."""

    def __init__(self, optimizer, config, offload, grad_stats_group, shards=None) -> None:
        super().__init__(optimizer, config, init_state_fn=_init_state)
        self.offload = offload
        self.grad_stats_parallel_group = grad_stats_group
        self._scale = torch.tensor([1.0], dtype=torch.float, device=offload.device)
        # Without the distributed optimizer the inner optimizer steps the whole experts
        # (every replica alike; replicas share no grad-stats group). With it, the inner optimizer's parameters are this rank's pieces of the experts
        # (param_offload_shards), and the updated pieces are all-gathered after a step.
        self.shards = shards
        self.total_grad_norm = None  # this step's, from the chain (or clip_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The host gradients are DDP's ``zero_grad_buffer``'s to zero."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self.total_grad_norm = None
        grads = {}
        for index, layer in enumerate(self.offload.params):
            for p, grad in zip(layer, self.offload.host_grads(index)):
                grads[id(p)] = grad
        for p in self.get_parameters():
            piece = getattr(p, "flat_piece", None)
            if piece is None:
                setattr(p, GRAD_ATTR, grads[id(p)])
            else:
                model, start, stop = piece
                setattr(p, GRAD_ATTR, grads[id(model)].view(-1)[start:stop])
        return found_non_finite_grads(self)

    # -- the norm: the host gradients, read as Megatron reads a sub-optimizer's ----------
    # They are shown as .grad / decoupled_grad only while Megatron's filter picks them (the
    # fp32 gradient of a bf16 weight, as a mixed-precision optimizer's main param has), so
    # Megatron's clipping, which cannot scale host memory on a GPU, never sees them; the
    # step clips them itself with the chain's norm.
    @contextlib.contextmanager
    def grads_shown(self):
        """The host gradients as ``.grad`` and ``.decoupled_grad`` inside the block."""
        params = self.get_parameters()
        for p in params:
            grad = getattr(p, GRAD_ATTR, None)
            if grad is not None and p.dtype != grad.dtype:
                p.grad_dtype = None  # a bf16 weight with its fp32 gradient
            p.grad, p.decoupled_grad = grad, grad
        try:
            yield
        finally:
            for p in params:
                p.grad, p.decoupled_grad = None, None

    def _shown(self, read):
        """What Megatron's norm reads of this optimizer: its own pick (``read``) with the
        host gradients (or this rank's pieces of them) shown."""
        with self.grads_shown():
            return _for_device_norm(read())

    def count_zeros(self) -> float:
        """Megatron's count (``--log-num-zeros-in-grad``) over the host gradients (with
        the distributed optimizer, this rank's pieces of them, as its shards)."""
        with self.grads_shown():
            return super().count_zeros()

    def get_main_grads_for_grad_norm(self):  # 0.16
        return self._shown(super().get_main_grads_for_grad_norm)

    def get_grads_for_grad_norm(self, *args, **kwargs):  # 0.19
        return self._shown(lambda: super(ParamOffloadOptimizer, self).get_grads_for_grad_norm(
            *args, **kwargs))

    def clip_grad_norm(self, clip_grad: float) -> float:
        """This optimizer stepped alone (``step``): its own norm, applied in the step."""
        self.total_grad_norm = self.get_grad_norm()
        return self.total_grad_norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if self.config.clip_grad > 0.0 and self.total_grad_norm is not None:
            grads = [getattr(p, GRAD_ATTR) for p in self.get_parameters()
                     if getattr(p, GRAD_ATTR, None) is not None]
            clip_host_grads(grads, self.config.clip_grad, self.total_grad_norm)
        ok = super().step_with_ready_grads()
        if self.shards is not None:
            gather_weights(self.shards, self.offload.device)
        self.offload.weights_updated()
        return ok

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           metadata=None):
        """Megatron's FP32Optimizer checkpoint (model-space keys, whole tensors); with the
        distributed optimizer the pieces' state is gathered into whole tensors on the
        replica that writes them (``param_offload_shards.sharded_state``), so it loads at
        any expert data-parallel size."""
        if self.shards is None:
            return super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state_dict = self.state_dict()
        step = self._extract_common_per_param_step(state_dict)
        names = ["exp_avg", "exp_avg_sq"]
        if any(p.dtype != torch.float32 for p in self.shards.params):
            names.append("master")  # OffloadStreamAdamW's fp32 copy of a 16-bit weight
        state_dict["state"] = sharded_state(
            self.shards, self.get_parameters(), state_dict["state"], names,
            model_sharded_state_dict, self.offload.device, is_loading)
        state_dict[_MODEL_SPACE] = True
        state_dict["param_groups"] = copy.deepcopy(state_dict["param_groups"])
        for group in state_dict["param_groups"]:
            group["params"] = LocalNonpersistentObject(group["params"])  # this rank's pieces
        if step:
            state_dict["state"]["common_step"] = step
        return state_dict

    # A checkpoint load writes the model's host views (the Parameters' data at rest) before
    # the optimizer's state: the slots are stale after either.
    def load_state_dict(self, state_dict) -> None:
        if state_dict.pop(_MODEL_SPACE, False):  # from sharded_state_dict: whole tensors
            state = dict(state_dict["state"])
            step = state.pop("common_step", None)
            state = pieces_of(self.shards, self.get_parameters(), state)
            if step is not None:
                for entry in state.values():
                    entry["step"] = copy.deepcopy(step)
            state_dict = {**state_dict, "state": state}
        super().load_state_dict(state_dict)
        self.offload.weights_updated()

    def reload_model_params(self, state_dict=None) -> None:
        """The model's weights changed outside the optimizer (``--no-load-optim``,
        ``--finetune``): the host fp32 masters follow them, and the slots are stale."""
        self.optimizer.reload_model_params()
        self.offload.weights_updated()


def clip_host_grads(grads, max_norm: float, total_norm: float) -> None:
    """Megatron's clipping by a total norm (``clip_grad_by_total_norm_fp32``): every
    gradient times ``max_norm / (total_norm + 1e-6)`` when that is below 1, in place (the
    same fp32 products its scale kernel makes)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for grad in grads:
            grad.mul_(coeff)


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


def _recording_norm(original):
    """``ChainedOptimizer.get_grad_norm`` that also hands the norm to its param offload
    sub-optimizers (they clip their host gradients with it in their step)."""
    def get_grad_norm(self, *args, **kwargs):
        norm = original(self, *args, **kwargs)
        for optimizer in getattr(self, "chained_optimizers", ()):
            if isinstance(optimizer, ParamOffloadOptimizer):
                optimizer.total_grad_norm = norm
        return norm
    return get_grad_norm


NORM_PATCH = patching.Patch(
    "megatron.core.optimizer.optimizer.ChainedOptimizer", "get_grad_norm", _recording_norm,
    expects="ChainedOptimizer.get_grad_norm",
    why="param offload: the experts' sub-optimizer clips its host gradients with the chain's "
        "norm")


def _counting_zeros(original):
    """``ChainedOptimizer.count_zeros`` that shows its param offload sub-optimizers' host
    gradients where the chain counts every parameter's ``.grad`` in one call (its
    sub-optimizers share one grad-stats group), bypassing their ``count_zeros``; otherwise
    each sub-optimizer counts its own."""
    def count_zeros(self, *args, **kwargs):
        with contextlib.ExitStack() as shown:
            if self.grads_states_parallel_group_is_shared():
                for optimizer in self.chained_optimizers:
                    if isinstance(optimizer, ParamOffloadOptimizer):
                        shown.enter_context(optimizer.grads_shown())
            return original(self, *args, **kwargs)
    return count_zeros


ZEROS_PATCH = patching.Patch(
    "megatron.core.optimizer.optimizer.ChainedOptimizer", "count_zeros", _counting_zeros,
    expects="ChainedOptimizer.count_zeros",
    why="param offload: --log-num-zeros-in-grad counts the experts' host gradients")


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


def _build(config, param_groups, offload, grad_stats_group, flat):
    problems = []
    if getattr(config, "optimizer", "adam") != "adam":
        problems.append(f"--optimizer {config.optimizer}: the offloaded experts step with AdamW")
    if getattr(config, "fp16", False):
        problems.append("--fp16: a loss scaler is not supported with param offload (use bf16)")
    if problems:
        raise ParamOffloadError("param offload cannot build the experts' optimizer:\n  - "
                                + "\n  - ".join(problems))
    groups = [dict(g) for g in param_groups]
    shards = None
    if getattr(config, "use_distributed_optimizer", False):
        # The distributed optimizer's cut: this rank steps its pieces of the experts, in the
        # distributed optimizer's order (param_offload_shards).
        shards = getattr(offload, "shards", None)
        if shards is None:
            raise ParamOffloadError(
                "param offload with the distributed optimizer: the experts' DDP laid out no "
                "shards (build the DDP while param offload is wired)")
        group_of = {id(p): g for g, group in enumerate(param_groups) for p in group["params"]}
        pieces = piece_params(shards, shards.owned(group_of, len(param_groups)))
        for group, owned in zip(groups, pieces):
            group["params"] = owned
    inner = MegatronOffloadStreamAdamW.over_param_groups(
        groups, lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
        weight_decay=config.weight_decay, bucket_numel=flat.optimizer_bucket_numel,
        num_slots=flat.optimizer_num_slots, grad_attr=GRAD_ATTR, device=offload.device)
    return ParamOffloadOptimizer(inner, config, offload, grad_stats_group, shards)


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
    return _build(config, param_groups, offloads[0], group, flat)


def is_wired() -> bool:
    return sub_optimizers_claimed(claim)


def wire_optimizer() -> None:
    """While OffloadStreamAdamW is wired (--flat-optimizer-offload), every sub-optimizer
    over offloaded experts is a :class:`ParamOffloadOptimizer`, and Megatron's clipping
    takes host gradients."""
    claim_sub_optimizers(claim)
    patching.apply(NORM_PATCH)
    patching.apply(ZEROS_PATCH)


def release_claim() -> None:
    """Later sub-optimizer calls are Megatron's again; optimizers built keep their chain's
    norm handed over (the patch stays: it only acts for a ParamOffloadOptimizer)."""
    release_sub_optimizers(claim)


def unwire_optimizer() -> None:
    release_claim()
    patching.revert(ZEROS_PATCH)
    patching.revert(NORM_PATCH)
