"""Checkpoint crossing in a rehearsal (``rehearse --resume-at``): Megatron's torch-AdamW resume
path on CPU, and what each save and load leaves in the optimizer.

Resuming on CPU
    On a GPU, Megatron's inner optimizer is transformer-engine's (or apex's) FusedAdam, which
    keeps one step count per param group; the distributed optimizer saves that count once, in
    its param groups, and hands it back on a load. On a CPU it is ``torch.optim.AdamW`` (one
    ``step`` tensor per parameter), and Megatron's code for that case cannot resume: before a
    load ``state_dict`` asserts that the fresh optimizer's per-parameter steps agree (it has
    none), the loader gives every parameter one shared ``step`` tensor (which AdamW then
    increments once per parameter), and the ``dp_reshardable`` loader writes the load
    template's steps back over the saved one. :data:`WORKAROUND` makes that path do what the
    FusedAdam path does, for an inner ``torch.optim.Adam``/``AdamW`` only: before a load,
    every parameter gets torch's own initial state (step 0, zero moments, which AdamW would
    make at its first step anyway), and after it, every parameter gets its own tensor holding
    the step count saved in the param groups. The update arithmetic is torch's, unchanged.
    (The offloaded inner optimizer of a flat run has the same fixes of its own:
    ``megatron.optimizer``.)

What a checkpoint carried
    :func:`record_checkpoints` wraps Megatron-LM's ``save_checkpoint``/``load_checkpoint`` so
    that each save and each load of a run with an optimizer records :func:`optimizer_digest`
    (a hash per state kind over this rank's shards, in the inner optimizers' parameter order,
    which stock and flat share): the rehearsal compares the digest a stock save left with the
    one a flat load found, and the other way round. Bitwise: a checkpoint only moves data.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Dict, List

import torch

from megatron_flat.cpu.backend import Workaround
from megatron_flat.runtime import patching

DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"
CHECKPOINTING = "megatron.training.checkpointing"
# The optimizer state a digest covers: both moments, the fp32 master, the step count.
STATE_KINDS = ("exp_avg", "exp_avg_sq", "master", "step")

_EVENTS: List[Dict[str, Any]] = []


# ---------------------------------------------------------------------------- resume on CPU
def _torch_adam(inner: Any) -> bool:
    """Whether ``inner`` is torch's own Adam/AdamW (the CPU stand-in for FusedAdam)."""
    return type(inner) in (torch.optim.Adam, torch.optim.AdamW)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def initial_state(inner: torch.optim.Optimizer) -> None:
    """Give every parameter of ``inner`` without state the state torch's Adam/AdamW makes at
    its first step (step 0, zero moments); the step then finds it and skips its own."""
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state.get(p):
                inner.state[p] = {
                    "step": torch.tensor(0.0, dtype=_scalar_dtype()),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def saved_step(state_dict: Any) -> Any:
    """The one step count a distributed optimizer's state dict saved in its param groups, or
    None (none saved, or groups that disagree)."""
    groups = (state_dict.get("optimizer") or {}).get("param_groups", []) \
        if isinstance(state_dict, dict) else []
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    return steps.pop() if len(steps) == 1 else None


def _resumable_sharded_state_dict(stock_sharded):
    @functools.wraps(stock_sharded)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args,
                           **kwargs):
        inner = getattr(self, "optimizer", None)
        if is_loading and _torch_adam(inner) and not inner.state:
            initial_state(inner)
        return stock_sharded(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    return sharded_state_dict


def _resumable_load_state_dict(stock_load):
    @functools.wraps(stock_load)
    @torch.no_grad()
    def load_state_dict(self, state_dict):
        # no_grad: an fp32 model's main shards are views of its leaf params, which the
        # loaders copy into (autograd refuses an in-place write to such a view).
        inner = getattr(self, "optimizer", None)
        if not _torch_adam(inner):
            return stock_load(self, state_dict)
        initial_state(inner)
        step = saved_step(state_dict)
        result = stock_load(self, state_dict)
        for st in inner.state.values():
            if st and step is not None:  # a tensor per parameter: AdamW adds to it in place
                st["step"] = torch.tensor(step, dtype=_scalar_dtype())
        return result

    return load_state_dict


_RESUME_WHY = ("Megatron's torch-AdamW path asserts on a fresh optimizer and shares one step "
               "tensor")


def _patch_distributed_optimizer(module: Any) -> None:
    if module.__name__ != DISTRIB_OPTIMIZER or getattr(module, "DistributedOptimizer",
                                                       None) is None:
        return
    owner = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
    for attribute, wrap in (("sharded_state_dict", _resumable_sharded_state_dict),
                            ("load_state_dict", _resumable_load_state_dict)):
        patching.apply(patching.Patch(owner, attribute, wrap, expects="a method",
                                      why=_RESUME_WHY))


def _torch_path_in_use() -> bool:
    """Whether the installed distributed optimizer takes its torch-optimizer path (no
    transformer-engine or apex): the only case :data:`WORKAROUND` changes."""
    try:
        import importlib

        module = importlib.import_module(DISTRIB_OPTIMIZER)
    except ImportError:
        return False
    return not getattr(module, "HAVE_APEX_OR_TE", True)


def _apply() -> None:
    from megatron_flat.cpu import training as cpu_training

    cpu_training.on_import(_patch_distributed_optimizer)


def _per_module() -> List[patching.Patch]:
    return []  # the distributed optimizer's module is patched as it loads (then=_apply)


WORKAROUND = Workaround(
    "distributed-optimizer resume with torch's AdamW",
    "transformer-engine's FusedAdam keeps the step per param group and resumes; "
    "Megatron's torch-AdamW path asserts on a fresh optimizer and shares one step "
    "tensor; state is made before a load and the saved step restored per parameter.",
    _per_module, _torch_path_in_use, then=_apply)


# ---------------------------------------------------------------------------- digests
def _inner_optimizers(optimizer: Any) -> List[Any]:
    """The torch optimizers inside a Megatron optimizer (chained or not), or ``optimizer``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    from megatron_flat.megatron.optimizer import inner_optimizers

    return inner_optimizers(optimizer)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy().tobytes()


def optimizer_digest(optimizer: Any) -> Dict[str, str]:
    """sha256 per state kind (:data:`STATE_KINDS`) of this rank's optimizer state, over every
    inner optimizer's parameters in order. ``master``: the fp32 master (a precision-aware inner
    optimizer's ``master_param``, else the parameter the inner optimizer updates); values as
    fp32, ``step`` as the count. A parameter without state hashes as such."""
    hashes = {kind: hashlib.sha256() for kind in STATE_KINDS}
    for inner in _inner_optimizers(optimizer):
        if hasattr(inner, "synchronize"):
            inner.synchronize()
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p) or {}
                if not st:
                    for h in hashes.values():
                        h.update(b"-")
                    continue
                for kind in ("exp_avg", "exp_avg_sq"):
                    hashes[kind].update(_bytes(st[kind]))
                master = st.get("master_param")
                hashes["master"].update(_bytes(master if torch.is_tensor(master)
                                               and master.dtype == torch.float32 else p))
                hashes["step"].update(repr(float(st["step"])).encode())
    return {kind: h.hexdigest()[:16] for kind, h in hashes.items()}


def _record(op: str, iteration: Any, optimizer: Any) -> None:
    if optimizer is None or not _inner_optimizers(optimizer):
        return
    _EVENTS.append({"op": op, "iteration": int(iteration),
                    "digest": optimizer_digest(optimizer)})


def _recording_save(stock_save):
    @functools.wraps(stock_save)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        result = stock_save(iteration, model, optimizer, *args, **kwargs)
        _record("save", iteration, optimizer)
        return result

    return save_checkpoint


def _recording_load(stock_load):
    @functools.wraps(stock_load)
    def load_checkpoint(model, optimizer, *args, **kwargs):
        result = stock_load(model, optimizer, *args, **kwargs)
        iteration = result[0] if isinstance(result, tuple) else result
        _record("load", iteration, optimizer)
        return result

    return load_checkpoint


def _wrap_checkpointing(module: Any) -> None:
    if module.__name__ != CHECKPOINTING:
        return
    for attribute, wrap in (("save_checkpoint", _recording_save),
                            ("load_checkpoint", _recording_load)):
        patching.apply(patching.Patch(CHECKPOINTING, attribute, wrap, expects="a function",
                                      why="the rehearsal records each save's and load's "
                                          "optimizer state"))


def record_checkpoints() -> None:
    """Record each save and load of Megatron-LM's checkpointing from now on (before
    ``megatron.training.training`` imports the functions); :func:`events` returns them."""
    from megatron_flat.cpu import training as cpu_training

    cpu_training.on_import(_wrap_checkpointing)


def events() -> List[Dict[str, Any]]:
    """``[{"op": "save"|"load", "iteration": I, "digest": {...}}]`` in the order they ran."""
    return list(_EVENTS)


__all__ = ["WORKAROUND", "STATE_KINDS", "events", "initial_state", "optimizer_digest",
           "record_checkpoints", "saved_step"]
