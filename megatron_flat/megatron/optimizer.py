"""OffloadStreamAdamW as the inner optimizer of Megatron-Core's optimizers (0.16.1 and 0.19.x).

Megatron wraps a plain torch optimizer (its "inner" optimizer) in one of three
``MegatronOptimizer`` classes, chained per parameter kind (dense, expert):

* ``DistributedOptimizer`` — each data-parallel rank owns a shard of every gradient bucket;
  its inner optimizer holds this rank's fp32 *main param shards*;
* ``Float16OptimizerWithFloat16Params`` — bf16/fp16 model, every rank holds fp32 copies of
  all params (the main params) in its inner optimizer;
* ``FP32Optimizer`` — fp32 model; the inner optimizer holds the model params themselves.

This module makes that inner optimizer a :class:`MegatronOffloadStreamAdamW` (an
:class:`~megatron_flat.optim.OffloadStreamAdamW`), selected by ``FlatConfig.optimizer_offload``
with ``optimizer_bucket_numel`` and ``optimizer_num_slots``:

* :func:`get_megatron_offload_optimizer` — ``get_megatron_optimizer`` with the offloaded inner
  optimizer, for code that builds its optimizer itself;
* :func:`wire_optimizer_offload` — for ``megatron_flat.install``: every later
  ``get_megatron_optimizer`` call (Megatron-LM's training loop makes one) builds it;
  :func:`unwire_optimizer_offload` undoes it, :func:`optimizer_offload` is the scoped form.

Which parameters the inner optimizer holds and where the fp32 master lives, why the update
is bitwise stock's, skipped steps, checkpoints, loads without optimizer state and the device
staging: docs/optimizer.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_flat.config import FlatConfig
from megatron_flat.megatron import compat
from megatron_flat.optim import OffloadStreamAdamW
from megatron_flat.optim.offload_adamw import check_hyperparameters, check_param
from megatron_flat.runtime import memory, patching

__all__ = [
    "MegatronMasterOffloadAdamW",
    "MegatronOffloadStreamAdamW",
    "claim_sub_optimizers",
    "found_non_finite_grads",
    "get_megatron_offload_optimizer",
    "inner_optimizers",
    "master_stays_on_device",
    "offload_inner_optimizer",
    "optimizer_offload",
    "release_sub_optimizers",
    "sub_optimizers_claimed",
    "unsupported_optimizer_settings",
    "unwire_optimizer_offload",
    "wire_optimizer_offload",
]

# Keys of a stock inner optimizer's param groups that describe *its* implementation, not the
# AdamW hyperparameters or Megatron's bookkeeping (wd_mult, lr_mult, is_expert_parallel, ...,
# which are kept: Megatron's scheduler and checkpoint matching read them).
_IMPLEMENTATION_KEYS = frozenset({
    "amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable",
    "decoupled_weight_decay", "bias_correction", "adam_w_mode", "set_grad_none", "step",
    "master_weights", "use_decoupled_grad", "master_weight_dtype", "exp_avg_dtype",
    "exp_avg_sq_dtype", "store_param_remainders",
})


class MegatronOffloadStreamAdamW(OffloadStreamAdamW):
    """:class:`OffloadStreamAdamW` speaking Megatron's inner-optimizer conventions.

    Adds ``init_state`` (Megatron's ``init_state_fn``: zero state for every parameter, made
    in host memory), un-aliases ``step`` tensors on load, and mirrors the step count into
    each group of the state dict (transformer-engine FusedAdam's convention, which the
    distributed optimizer follows when TE or apex is installed); on load, entries without
    a ``step`` take their group's.
    """

    @classmethod
    def over_param_groups(cls, param_groups: List[Dict[str, Any]],
                          **kwargs: Any) -> "MegatronOffloadStreamAdamW":
        """An optimizer over ``param_groups`` *as given* (same dicts' keys, same tensors).

        Megatron's distributed optimizer hands its inner optimizer views of the parameter
        buffer (fp32 main param shards), which are not leaf tensors and so cannot pass
        ``torch.optim.Optimizer.add_param_group``; like Megatron, the groups are assigned
        directly, after the same checks OffloadStreamAdamW makes (the parameters must be
        the very tensors Megatron maps its shards to).
        """
        opt = cls([torch.zeros(1, requires_grad=True)], **kwargs)
        groups = []
        for given in param_groups:
            group = {**opt.defaults, **given, "params": list(given["params"])}
            group["betas"] = tuple(group["betas"])
            check_hyperparameters(group)
            for p in group["params"]:
                check_param(p)
            groups.append(group)
        params = [p for g in groups for p in g["params"]]
        if len(set(params)) != len(params):
            raise ValueError("a parameter appears more than once in param_groups")
        opt.param_groups = groups
        opt.state.clear()
        return opt

    def init_state(self) -> None:
        """Give every parameter without state its initial state (step 0, zero moments,
        master from the parameter), in host memory. Idempotent."""
        self.prepare()
        self._reconcile(init=[True] * len(self._params))

    def state_dict(self) -> Dict[str, Any]:
        packed = super().state_dict()
        for group in packed["param_groups"]:
            steps = {float(packed["state"][i]["step"]) for i in group["params"]
                     if i in packed["state"]}
            if len(steps) == 1:
                group["step"] = int(steps.pop())
        return packed

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        groups = state_dict.get("param_groups", [])
        group_step = {i: g["step"] for g in groups if g.get("step") is not None
                      for i in g["params"]}
        state = {}
        for key, entry in state_dict.get("state", {}).items():
            entry = dict(entry)
            step = entry.get("step")
            if step is None and entry and key in group_step:
                step = group_step[key]
            if step is not None:
                # A fresh tensor per parameter: the step is incremented in place.
                entry["step"] = torch.tensor(float(step))
            state[key] = entry
        state_dict["state"] = state
        state_dict["param_groups"] = [{k: v for k, v in g.items() if k != "step"} for g in groups]
        super().load_state_dict(state_dict)


class MegatronMasterOffloadAdamW(MegatronOffloadStreamAdamW):
    """The inner optimizer of a distributed optimizer on Megatron's precision-aware path:
    it holds the model's low-precision param shards and their fp32 masters in host memory.

    Megatron's ``DistributedOptimizer`` then gives its inner optimizer the bf16/fp16 shards
    of the model params (views of the parameter buffer that the all-gather reads) instead of
    fp32 main shards, sets each shard's gradient as ``decoupled_grad`` (the grad buffer's
    range), skips its own main→model copy, and reads and writes the optimizer state for
    checkpoints through :meth:`get_unscaled_state` / :meth:`set_scaled_state` (the contract
    of transformer-engine's FusedAdam with ``master_weights``): ``"master_param"``,
    ``"exp_avg"``, ``"exp_avg_sq"`` and ``"step"`` per shard, fp32. Checkpoints therefore
    carry fp32 masters in Megatron's usual format and load either way with the stock
    optimizer's. An fp32 shard (a parameter kept in fp32) is its own master.
    """

    master_key = "master_param"

    def _reconcile(self, init: Optional[List[bool]] = None) -> None:
        super()._reconcile(init)
        for i, p in enumerate(self._params):  # Megatron asks every shard for its master
            st = self.state.get(p)
            if st and not self._low[i]:
                st[self.master_key] = p.detach()

    def _live_state(self, param: torch.Tensor) -> Dict[str, Any]:
        if not self.state.get(param):
            self.init_state()
        st = self.state.get(param)
        if not st:
            raise KeyError("the parameter is not one this optimizer holds")
        return st

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The fp32 state ``state_name`` of ``param`` (a view of host memory; callers copy)."""
        self.synchronize()
        return self._live_state(param)[state_name]

    @torch.no_grad()
    def set_scaled_state(self, param: torch.Tensor, state_name: str,
                         unscaled_state: Any) -> None:
        """Copy ``unscaled_state`` into ``param``'s state ``state_name``.

        ``step`` and non-tensor values are ignored: Megatron passes the load template's
        per-parameter step and (0.16) a ``padding`` flag here, while the saved step count is
        re-applied from the param groups after the load. The low-precision parameter itself
        is not touched (the model checkpoint carries it), as with transformer-engine.
        """
        if state_name == "step" or not torch.is_tensor(unscaled_state):
            return
        self.synchronize()
        target = self._live_state(param).get(state_name)
        if target is None:
            raise KeyError(f"no optimizer state {state_name!r}")
        if unscaled_state.numel() != target.numel():
            raise ValueError(f"state {state_name!r} has {unscaled_state.numel()} elements, "
                             f"the parameter {target.numel()}")
        target.copy_(unscaled_state.reshape(target.shape))

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """transformer-engine FusedAdam's hook: make ``param``'s state (host memory)."""
        if store_param_remainders:
            raise ValueError("store_param_remainders (int16 master remainders) is not "
                             "supported: the host master is fp32")
        self._live_state(param)


# ------------------------------------------------------------------------------- checks
def unsupported_optimizer_settings(config: Any) -> List[str]:
    """Why an ``OptimizerConfig`` (or Megatron-LM args) cannot use the offloaded inner
    optimizer; empty when it can. Only settings present on ``config`` are checked."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(config, name, default)

    problems = []
    if get("optimizer", "adam") != "adam":
        problems.append(f"OffloadStreamAdamW implements AdamW: it needs optimizer 'adam' "
                        f"(got {get('optimizer')!r})")
    if not get("decoupled_weight_decay", True):
        problems.append("OffloadStreamAdamW applies decoupled weight decay (AdamW); "
                        "decoupled_weight_decay=False asks for Adam with L2 regularisation")
    if get("optimizer_cpu_offload", False):
        problems.append("optimizer_cpu_offload is Megatron's own optimizer offload: "
                        "use one of the two")
    if get("use_precision_aware_optimizer", False):
        problems.append("use_precision_aware_optimizer (transformer-engine FusedAdam state "
                        "dtypes) is not supported with the offloaded optimizer")
    if compat.optimizer_capturable(config):
        problems.append("optimizer_cuda_graph (a capturable optimizer step) cannot stream "
                        "host-resident state")
    if get("use_megatron_fsdp", False) or get("use_torch_fsdp2", False):
        problems.append("Megatron-FSDP / torch FSDP2 keep their own optimizer shards "
                        "(DTensors); use the distributed optimizer")
    return problems


# Megatron's precision-aware switch as its optimizer code reads it: a plain attribute that
# OptimizerConfig.__post_init__ derives from ``use_precision_aware_optimizer`` (which is the
# transformer-engine FusedAdam setting, validated against TE). Setting the attribute on a
# copy of the config takes the distributed optimizer's precision-aware path with the stock
# (torch) inner optimizer, which is then swapped for MegatronMasterOffloadAdamW.
_PRECISION_AWARE = "use_precision_aware_optimizer_no_fp8_or_ds_fp8"


def master_stays_on_device(config: Any) -> Optional[str]:
    """Why a sub-optimizer built from ``config`` keeps its fp32 master on the device (only
    the moments go to host memory), or None when the master goes to host memory too."""
    if not (getattr(config, "bf16", False) or getattr(config, "fp16", False)):
        return "fp32 model: each parameter is its own master"
    if not getattr(config, "use_distributed_optimizer", False):
        return ("the non-distributed optimizer (Float16OptimizerWithFloat16Params) keeps fp32 "
                "main params on the device; --use-distributed-optimizer moves them to host "
                "memory")
    if getattr(config, "fp8_recipe", None) is not None or \
            getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return "fp8 parameters keep Megatron's fp32 main shards"
    if not hasattr(config, _PRECISION_AWARE):
        return "this megatron-core has no precision-aware distributed optimizer"
    return None


def _master_offload_config(config: Any) -> Any:
    """A copy of ``config`` that takes the distributed optimizer's precision-aware path with
    fp32 masters (no int16 remainders); ``config`` itself is not changed."""
    config = copy.copy(config)
    setattr(config, _PRECISION_AWARE, True)
    config.store_param_remainders = False
    return config


def _fp32_decoupled_grads(wrapper: Any) -> None:
    """After Megatron points each shard's ``decoupled_grad`` at the grad buffer, make it
    fp32, as the stock path's main grads are (``main_grad.float()``): a no-op for an fp32
    buffer; for a bf16 one, unscaling, clipping and the update then see the stock values."""
    stock = wrapper._copy_model_grads_to_main_grads

    @functools.wraps(stock)
    def _copy_model_grads_to_main_grads(self, *args: Any, **kwargs: Any) -> Any:
        result = stock(*args, **kwargs)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = getattr(p, "decoupled_grad", None)
                if g is not None and g.dtype != torch.float32:
                    p.decoupled_grad = g.float()
        return result

    wrapper._copy_model_grads_to_main_grads = types.MethodType(
        _copy_model_grads_to_main_grads, wrapper)


def _no_main_params_from_checkpoint(wrapper: Any) -> None:
    """``reload_model_params(state_dict=...)`` (``--load-main-params-from-ckpt``) would load
    fp32 main params that the precision-aware path does not have: refuse it clearly."""
    stock = wrapper.reload_model_params

    @functools.wraps(stock)
    def reload_model_params(self, *args: Any, **kwargs: Any) -> None:
        if (args and args[0] is not None) or kwargs.get("state_dict") is not None:
            raise NotImplementedError(
                "reload_model_params(state_dict=...) (--load-main-params-from-ckpt) is not "
                "supported with the offloaded fp32 master; load the optimizer state instead")
        stock(*args, **kwargs)

    wrapper.reload_model_params = types.MethodType(reload_model_params, wrapper)


# ------------------------------------------------------------------------------- the swap
def inner_optimizers(megatron_optimizer: Any) -> List[torch.optim.Optimizer]:
    """The inner (torch) optimizers of a Megatron optimizer, chained or not (stubs skipped)."""
    chained = getattr(megatron_optimizer, "chained_optimizers", None)
    wrappers = chained if chained is not None else [megatron_optimizer]
    return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]


def _offload_group(group: Dict[str, Any]) -> Dict[str, Any]:
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            raise ValueError(f"the stock inner optimizer has {key}=True, which "
                             "OffloadStreamAdamW does not implement")
    if group.get("adam_w_mode") is False or group.get("bias_correction") is False:
        raise ValueError("the stock inner optimizer is not AdamW with bias correction")
    return {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}


def _init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Megatron's ``init_state_fn`` for the offloaded inner optimizer (host-resident state)."""
    opt.init_state()


def found_non_finite_grads(wrapper: Any) -> bool:
    """Whether any main grad of ``wrapper`` is inf/nan, agreed over its grad-stats group.

    Collective (every rank of the group calls it, stub optimizers too, as Megatron's own
    scaler check does). Reads the gradients only.
    """
    inner = getattr(wrapper, "optimizer", None)
    attr = getattr(inner, "grad_attr", "grad")  # precision-aware: decoupled_grad
    grads = [] if inner is None else [
        getattr(p, attr) for g in inner.param_groups for p in g["params"]
        if getattr(p, attr, None) is not None]
    # The flag lives where the group's collective reduces (param offload's gradients are
    # host tensors while the grad-stats group is NCCL's).
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, tensors in by_device.items():
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        # Megatron's own check (inv_scale 1: the grads are read, not changed); one fused
        # kernel per device and dtype.
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, local, torch.ones(1, dtype=torch.float32, device=dev))
        if dev == device and not _in_host_memory(tensors):
            found += local
        else:
            # Host gradients (param offload): their flag is host data. Added as a number it
            # is a kernel argument; local.to(device) would block the host on a GPU.
            found += local.item()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                     group=wrapper.get_grad_stats_parallel_group())
    return bool(found.item() > 0)


def _in_host_memory(tensors: List[torch.Tensor]) -> bool:
    """Whether every tensor lives in a host pool's buffer (what stands for pinned host
    memory on a CPU run: there the host and the device are one device type)."""
    return all(memory.is_host_storage(t.untyped_storage()) for t in tensors)


def _with_non_finite_check(wrapper: Any) -> None:
    """Give a scaler-less Megatron optimizer an inf/nan check in ``prepare_grads``."""
    if getattr(wrapper, "grad_scaler", None) is not None:
        return  # Megatron's own unscale-and-check runs in prepare_grads
    stock = wrapper.prepare_grads

    @functools.wraps(stock)
    def prepare_grads(self) -> bool:
        found = stock()
        return found_non_finite_grads(self) or bool(found)

    wrapper.prepare_grads = types.MethodType(prepare_grads, wrapper)


def _reloading_masters(wrapper: Any) -> None:
    """``reload_model_params`` that also refreshes the offloaded host masters."""
    stock = wrapper.reload_model_params

    @functools.wraps(stock)
    def reload_model_params(self, *args: Any, **kwargs: Any) -> None:
        stock(*args, **kwargs)
        if isinstance(getattr(self, "optimizer", None), OffloadStreamAdamW):
            self.optimizer.reload_model_params()

    wrapper.reload_model_params = types.MethodType(reload_model_params, wrapper)


def _inner_of(wrapper: Any) -> Optional["MegatronOffloadStreamAdamW"]:
    inner = getattr(wrapper, "optimizer", None)
    return inner if isinstance(inner, MegatronOffloadStreamAdamW) else None


# Distributed optimizer: host-resident placeholders before a load, and the step after.
# * Before loading, Megatron's distributed optimizer reads a step count from every parameter's
#   state (``sharded_state_dict(is_loading=True)`` calls ``state_dict``) and, when the inner
#   optimizer has no state yet, allocates placeholder moments on the device. The Float16/FP32
#   wrappers call ``init_state_fn`` there instead; the patches below do the same for the
#   distributed optimizer, so the placeholders are the host state itself.
# * The distributed optimizer saves the step count once, in its param groups. Its
#   per-parameter state loaders were written for transformer-engine's FusedAdam, which has no
#   per-parameter ``step``; with torch's AdamW layout (ours) the ``dp_reshardable`` format
#   writes back the *template's* per-parameter step (a local, non-persistent object) after
#   ``load_state_dict`` has set the saved one, and the legacy ``load_parameter_state``
#   (dp_zero) fails on the ``step`` key its files do not carry
#   (``_set_main_param_and_optimizer_states`` copies every state key). A missing ``step``
#   keeps the current one, and the saved step is re-applied after every load.
def _placeholders_on_host(wrapper: Any) -> None:
    stock = wrapper.sharded_state_dict

    @functools.wraps(stock)
    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           *args: Any, **kwargs: Any) -> Any:
        inner = _inner_of(self)
        if is_loading and inner is not None and not inner.state:
            inner.init_state()
        return stock(model_sharded_state_dict, is_loading, *args, **kwargs)

    wrapper.sharded_state_dict = types.MethodType(sharded_state_dict, wrapper)


def _state_dict_without_copies(wrapper: Any) -> None:
    """``state_dict`` whose inner state dict holds views of the host state, not copies.

    Megatron's distributed optimizer keeps only the param groups (and reads each step) of its
    inner optimizer's state dict; the per-parameter state it saves separately, from the live
    state (``sharded_state_dict``, ``get_parameter_state_*``). The inner optimizer's compact
    copies were 12 B per parameter of host memory made and dropped on every save (and on every
    load, which calls ``state_dict`` first)."""
    stock = wrapper.state_dict

    @functools.wraps(stock)
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        inner = _inner_of(self)
        if inner is None:
            return stock(*args, **kwargs)
        with inner.state_dict_views():
            return stock(*args, **kwargs)

    wrapper.state_dict = types.MethodType(state_dict, wrapper)


def _saved_step_after_load(wrapper: Any) -> None:
    stock = wrapper.load_state_dict

    @functools.wraps(stock)
    def load_state_dict(self, state_dict: Any) -> Any:
        inner = _inner_of(self)
        if inner is not None and not inner.state:
            inner.init_state()
        groups = (state_dict.get("optimizer") or {}).get("param_groups", []) \
            if isinstance(state_dict, dict) else []
        steps = {float(g["step"]) for g in groups if g.get("step") is not None}
        result = stock(state_dict)
        if inner is not None and len(steps) == 1:
            step = steps.pop()
            for st in inner.state.values():
                if st:
                    st["step"] = torch.tensor(step)
        return result

    wrapper.load_state_dict = types.MethodType(load_state_dict, wrapper)


def _step_kept_by_state_loads(wrapper: Any) -> None:
    stock = wrapper._set_main_param_and_optimizer_states

    @functools.wraps(stock)
    def _set_main_param_and_optimizer_states(self, model_param: Any, tensors: Any) -> Any:
        inner = _inner_of(self)
        if inner is not None and "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = inner.param_groups[group_index]["params"][group_order]
            step = inner.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return stock(model_param, tensors)

    wrapper._set_main_param_and_optimizer_states = types.MethodType(
        _set_main_param_and_optimizer_states, wrapper)


@dataclass(frozen=True)
class WrapperPatch:
    """One method of a Megatron optimizer wrapper replaced on the instance.

    ``params``: the parameters of Megatron's method (after ``self``) the replacement calls it
    with, by position and name (checked against the installed release by the tests);
    ``when``: which wrappers get it — ``always``, ``offloaded`` (the inner optimizer was
    swapped), ``distributed`` (offloaded, a DistributedOptimizer) or ``precision_aware``
    (offloaded, bf16/fp16 shards with the master on the host).
    """

    method: str
    params: Tuple[str, ...]
    when: str
    apply: Callable[[Any], None]
    why: str


# Every patch of a Megatron optimizer instance, in the order they are applied (a later one
# wraps an earlier one on the same method).
WRAPPER_PATCHES: Tuple[WrapperPatch, ...] = (
    WrapperPatch("reload_model_params", ("state_dict",), "offloaded", _reloading_masters,
                 "the offloaded host masters follow reloaded model params"),
    WrapperPatch("sharded_state_dict", ("model_sharded_state_dict", "is_loading"), "distributed",
                 _placeholders_on_host,
                 "placeholders for a load are the host state, not device moments"),
    WrapperPatch("state_dict", (), "distributed", _state_dict_without_copies,
                 "no host copy of the optimizer state on a save (Megatron drops it)"),
    WrapperPatch("load_state_dict", ("state_dict",), "distributed",
                 _saved_step_after_load, "the saved step survives the load"),
    WrapperPatch("_set_main_param_and_optimizer_states", ("model_param", "tensors"),
                 "distributed", _step_kept_by_state_loads,
                 "per-parameter state loads without a step keep the current one"),
    WrapperPatch("_copy_model_grads_to_main_grads", (), "precision_aware",
                 _fp32_decoupled_grads, "decoupled grads are fp32, as stock"),
    WrapperPatch("reload_model_params", ("state_dict",), "precision_aware",
                 _no_main_params_from_checkpoint,
                 "no fp32 main params to load from a checkpoint: refused"),
    WrapperPatch("prepare_grads", (), "always", _with_non_finite_check,
                 "an inf/nan check when Megatron has no grad scaler"),
)


# The wrappers offload_inner_optimizer has done (the one "already done" record; nothing is
# written on the wrapper itself but the patched methods).
_OFFLOADED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _apply_wrapper_patches(wrapper: Any, applies: Dict[str, bool]) -> None:
    for patch in WRAPPER_PATCHES:
        if applies[patch.when]:
            patch.apply(wrapper)


def offload_inner_optimizer(wrapper: Any, flat: FlatConfig) -> Any:
    """Replace the inner optimizer of one Megatron optimizer (not chained) by
    :class:`MegatronOffloadStreamAdamW` over the same param groups; returns ``wrapper``.

    Called right after Megatron built ``wrapper`` (its inner optimizer has no state yet),
    so the params are Megatron's final main params. A stub (no params on this rank) keeps
    no inner optimizer but still gets the inf/nan check (a collective).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(wrapper, "chained_optimizers", None) is not None:
        raise TypeError("offload_inner_optimizer takes one Megatron optimizer, not a chain")
    if wrapper in _OFFLOADED:
        return wrapper
    problems = unsupported_optimizer_settings(wrapper.config)
    if getattr(getattr(wrapper, "ddp_config", None), "use_megatron_fsdp", False):
        problems.append("Megatron-FSDP keeps its own optimizer shards (DTensors); "
                        "use the distributed optimizer")
    if problems:
        raise ValueError("OffloadStreamAdamW cannot be Megatron's inner optimizer here:\n  - "
                         + "\n  - ".join(problems))
    inner = getattr(wrapper, "optimizer", None)
    if inner is not None and not isinstance(inner, OffloadStreamAdamW):
        if inner.state:
            raise ValueError("the inner optimizer already has state; swap it before training")
        defaults = inner.defaults
        kernel = _stock_kernel(inner)
        precision_aware = isinstance(wrapper, DistributedOptimizer) and \
            bool(getattr(wrapper.config, _PRECISION_AWARE, False))
        cls, extra = MegatronOffloadStreamAdamW, {}
        if precision_aware:  # the inner groups hold bf16/fp16 model shards
            cls, extra = MegatronMasterOffloadAdamW, {"grad_attr": "decoupled_grad"}
        wrapper.optimizer = cls.over_param_groups(
            [_offload_group(g) for g in inner.param_groups],
            lr=defaults["lr"], betas=tuple(defaults["betas"]), eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            bucket_numel=flat.optimizer_bucket_numel, num_slots=flat.optimizer_num_slots,
            **kernel, **extra,
        )
        wrapper.init_state_fn = _init_state_fn
        offloaded = True
    else:
        offloaded, precision_aware = False, False
    distributed = offloaded and isinstance(wrapper, DistributedOptimizer)
    _apply_wrapper_patches(wrapper, {"always": True, "offloaded": offloaded,
                                     "distributed": distributed,
                                     "precision_aware": precision_aware})
    _OFFLOADED.add(wrapper)
    return wrapper


def _stock_kernel(inner: Any) -> Dict[str, Optional[bool]]:
    """The AdamW kernel arguments that keep the offloaded step bitwise equal to the stock
    inner optimizer: a ``torch.optim.AdamW``'s own choice, resolved as torch resolves it
    (unset means foreach on CUDA), so the offloaded step runs the same kernel; none for
    transformer-engine's or apex's FusedAdam (their arithmetic is not torch's anyway), so
    OffloadStreamAdamW's default applies: torch's fused kernel on CUDA."""
    if not isinstance(inner, torch.optim.AdamW):
        return {}
    foreach, fused = inner.defaults.get("foreach"), inner.defaults.get("fused")
    if foreach is None and fused is None:
        on_cuda = any(p.is_cuda for g in inner.param_groups for p in g["params"])
        foreach = True if on_cuda else None
    return {"foreach": foreach, "fused": fused}


# ------------------------------------------------------------------------------- wiring
# Megatron builds each sub-optimizer (inner optimizer + wrapper) in one module-level function
# of ``megatron.core.optimizer`` that ``get_megatron_optimizer`` calls by its global name
# (compat.inner_optimizer_builder). Wrapping that name swaps the inner optimizer of every
# sub-optimizer built while a FlatConfig with ``optimizer_offload`` is active.
_WIRED: Optional[FlatConfig] = None
_ACTIVE: List[FlatConfig] = []
_BUILDER: List[patching.Patch] = []  # the builder's patch once declared (its seam is compat's)


# Sub-optimizer calls other glue takes over (param offload's experts): each claim is called
# with the builder's (args, kwargs, flat) and returns the sub-optimizer it built, or None.
_CLAIMS: List[Callable[..., Any]] = []


def claim_sub_optimizers(claim: Callable[..., Any]) -> None:
    """Let ``claim`` build the sub-optimizers it recognises (before OffloadStreamAdamW
    replaces a stock one's inner optimizer); :func:`release_sub_optimizers` undoes it."""
    if claim not in _CLAIMS:
        _CLAIMS.append(claim)


def sub_optimizers_claimed(claim: Callable[..., Any]) -> bool:
    return claim in _CLAIMS


def release_sub_optimizers(claim: Callable[..., Any]) -> None:
    if claim in _CLAIMS:
        _CLAIMS.remove(claim)


def _active_flat() -> Optional[FlatConfig]:
    flat = _ACTIVE[-1] if _ACTIVE else _WIRED
    return flat if flat is not None and flat.optimizer_offload else None


def _offloading_builder(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def build(*args: Any, **kwargs: Any) -> Any:
        flat = _active_flat()
        if flat is None or compat.builder_returns_unwrapped(kwargs):
            return stock(*args, **kwargs)
        config = kwargs["config"] if "config" in kwargs else args[0]
        reason = master_stays_on_device(config)
        if reason is None:  # the fp32 master goes to host memory too
            config = _master_offload_config(config)
            if "config" in kwargs:
                kwargs["config"] = config
            else:
                args = (config,) + tuple(args[1:])
        elif not (getattr(config, "bf16", False) or getattr(config, "fp16", False)):
            pass  # fp32: nothing more to offload
        else:
            warnings.warn(f"--flat-optimizer-offload: the fp32 master stays on the device "
                          f"({reason}); the Adam moments go to host memory", stacklevel=2)
        for claim in _CLAIMS:  # with the config every sub-optimizer of the chain gets
            claimed = claim(args, kwargs, flat)
            if claimed is not None:
                return claimed
        return offload_inner_optimizer(stock(*args, **kwargs), flat)

    return build


def builder_patch() -> patching.Patch:
    """The declared patch of Megatron's sub-optimizer builder (at compat's seam)."""
    if not _BUILDER:
        module, name = compat.inner_optimizer_builder()
        _BUILDER.append(patching.Patch(
            patching.path_of(module), name, _offloading_builder,
            expects="Megatron's sub-optimizer builder (inner optimizer + wrapper)",
            why="OffloadStreamAdamW replaces the inner optimizer of every sub-optimizer "
                "built while --flat-optimizer-offload is on"))
    return _BUILDER[0]


def _patch_builder() -> None:
    patching.apply(builder_patch())


def _unpatch_builder() -> None:
    if _BUILDER and not _ACTIVE and _WIRED is None:
        # False when someone wrapped the builder after us: ours stays in their chain, inert
        # while nothing is active (and a later patch reuses it).
        patching.revert(_BUILDER[0])


@contextlib.contextmanager
def optimizer_offload(flat: FlatConfig) -> Iterator[None]:
    """Within the block, ``get_megatron_optimizer`` builds offloaded inner optimizers when
    ``flat.optimizer_offload`` (nests; Megatron's builder is restored on exit)."""
    compat.check_supported()
    _patch_builder()
    _ACTIVE.append(flat)
    try:
        yield
    finally:
        _ACTIVE.pop()
        _unpatch_builder()


def get_megatron_offload_optimizer(config: Any, model_chunks: List[torch.nn.Module],
                                   flat: FlatConfig, **kwargs: Any) -> Any:
    """``megatron.core.optimizer.get_megatron_optimizer(config, model_chunks, **kwargs)`` with
    every inner optimizer an offloaded AdamW per ``flat`` (stock when
    ``flat.optimizer_offload`` is off). Raises ``ValueError`` for settings it cannot run."""
    from megatron.core.optimizer import get_megatron_optimizer

    if flat.optimizer_offload:
        problems = unsupported_optimizer_settings(config)
        if problems:
            raise ValueError("OffloadStreamAdamW cannot be Megatron's inner optimizer here:\n"
                             "  - " + "\n  - ".join(problems))
    with optimizer_offload(flat):
        return get_megatron_optimizer(config, model_chunks, **kwargs)


def wire_optimizer_offload(flat: FlatConfig, megatron: Any = None) -> None:
    """``megatron_flat.install`` wiring for ``--flat-optimizer-offload``: from now on every
    ``get_megatron_optimizer`` call builds offloaded inner optimizers per ``flat``.

    ``megatron``: Megatron-LM args or an ``OptimizerConfig`` (optional); its optimizer
    settings are checked first. Raises ``FlatConfigError`` (a ``ValueError``) listing every
    problem, before anything is patched. Undo with :func:`unwire_optimizer_offload`.
    """
    global _WIRED
    from megatron_flat.megatron.state import FlatConfigError

    compat.check_supported()
    problems = unsupported_optimizer_settings(megatron) if megatron is not None else []
    if problems:
        raise FlatConfigError("megatron-flat cannot be installed:\n  - --flat-optimizer-offload: "
                              + "\n  - --flat-optimizer-offload: ".join(problems))
    _WIRED = flat
    _patch_builder()


def unwire_optimizer_offload() -> None:
    """Undo :func:`wire_optimizer_offload` (optimizers already built keep their inner one)."""
    global _WIRED
    _WIRED = None
    _unpatch_builder()
