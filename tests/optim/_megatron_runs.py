"""Shared pieces of the Megatron-integration tests of OffloadStreamAdamW.

Training runs of the tiny MoE GPT through Megatron's DDP and ``get_megatron_optimizer``,
with Megatron's stock inner optimizer or the offloaded one, plus byte-exact snapshots of
what an optimizer owns. Every function that gathers is a collective over the world.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig
from megatron_flat.testing.training import LR, Layout, Trainer

# Small buckets: the tiny model's shards (~70K elements per rank at DP=2) span several
# buckets and parameters are split across bucket boundaries.
FLAT = FlatConfig(optimizer_offload=True, optimizer_bucket_numel=10_000, optimizer_num_slots=2)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
FP16 = dict(fp16=True, params_dtype=torch.float16, pipeline_dtype=torch.float16)
# fp16's loss scaling: Megatron's DynamicGradScaler (OptimizerConfig.loss_scale=None). The
# initial scale keeps the tiny model's scaled fp16 gradients (max ~250) far from fp16's
# 65504, so no step of these runs overflows by itself (with Megatron's default 2**32 every
# early step would, and be skipped until the scale had backed off); hysteresis 1 backs the
# scale off on the first overflow, so a skipped step shows in the scale.
FP16_SCALER = dict(loss_scale=None, initial_loss_scale=2.0 ** 12, min_loss_scale=1.0,
                   loss_scale_window=1000, hysteresis=1)
WEIGHT_DECAY = 0.1

LAYOUTS = {
    "distopt": Layout(distributed_optimizer=True),
    "no-distopt": Layout(),
}


def make_trainer(tiny, layout: Layout, *, offload: bool, bf16: bool = False,
                 fp16: bool = False,
                 init: Optional[Dict[str, torch.Tensor]] = None) -> Trainer:
    """A Trainer whose optimizer has Megatron's stock inner optimizer or the offloaded one.

    bf16: the model in bf16 and Megatron's optimizer built for it (``OptimizerConfig.bf16``,
    so fp32 main params: Float16OptimizerWithFloat16Params or the distributed optimizer's
    fp32 shards). fp16: the same for an fp16 model, with Megatron's loss scaling: a
    DynamicGradScaler (``FP16_SCALER``) that the optimizer unscales and checks the
    gradients with, and the loss scaled before backward as Megatron-LM's training loop
    does (``config.grad_scale_func = optimizer.scale_loss``). ``init``: full initial
    weights to load.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_flat.megatron.optimizer import get_megatron_offload_optimizer
    from megatron_flat.testing.equivalence import load_full

    load = None if init is None else (lambda model: load_full([model], init))
    if bf16 and fp16:
        raise ValueError("bf16 or fp16, not both")
    if not (bf16 or fp16):
        return Trainer(tiny, layout, init=load, flat=FLAT if offload else None)
    trainer = Trainer(tiny, layout, init=load, config_overrides=BF16 if bf16 else FP16)
    precision = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else \
        dict(fp16=True, params_dtype=torch.float16, **FP16_SCALER)
    config = dataclasses.replace(trainer.optimizer.chained_optimizers[0].config, **precision)
    trainer.optimizer = (get_megatron_offload_optimizer(config, [trainer.ddp], FLAT) if offload
                         else get_megatron_optimizer(config, [trainer.ddp]))
    if fp16:  # the schedule scales the loss before backward (Megatron-LM's training loop)
        trainer.config.grad_scale_func = trainer.optimizer.scale_loss
    return trainer


def loss_scale(trainer: Trainer) -> float:
    """The optimizer's current loss scale (1.0 without a grad scaler)."""
    return float(trainer.optimizer.get_loss_scale().item())


def schedule(trainer: Trainer, step: int) -> None:
    """What Megatron's OptimizerParamScheduler does before a step: per-group lr and weight
    decay written into the param groups (here a decaying lr, decay on weight matrices)."""
    for group in trainer.optimizer.param_groups:
        group["lr"] = LR * group.get("lr_mult", 1.0) * (1.0 - 0.1 * step)
        group["weight_decay"] = WEIGHT_DECAY * group.get("wd_mult", 1.0)


def train(trainer: Trainer, steps) -> List[float]:
    losses = []
    for step in steps:
        schedule(trainer, step)
        losses.append(trainer.forward_backward(step))
        trainer.optimizer_step()
    return losses


def inner_optimizers(trainer: Trainer) -> list:
    from megatron_flat.megatron.optimizer import inner_optimizers as inners

    return inners(trainer.optimizer)


def state_bytes(trainer: Trainer) -> List[torch.Tensor]:
    """This rank's optimizer-owned values as raw bytes, in param-group order: each shard's
    fp32 master, step and moments. The master is the inner optimizer's param (Megatron's fp32
    main param) unless its state names one (``master_param``: the precision-aware path, whose
    params are the bf16 model shards), so stock and offloaded runs compare like for like."""
    out = []
    for inner in inner_optimizers(trainer):
        for group in inner.param_groups:
            for p in group["params"]:
                st = dict(inner.state.get(p, {}))
                master = st.pop("master_param", p)
                assert master.dtype == torch.float32, master.dtype
                out.append(master.detach())
                for key in sorted(st):
                    out.append(st[key].detach())
    return [t.contiguous().view(-1).view(torch.uint8).clone() for t in out]


def model_bytes(trainer: Trainer) -> List[torch.Tensor]:
    """This rank's model parameters as raw bytes."""
    return [p.detach().contiguous().view(-1).view(torch.uint8).clone()
            for p in trainer.model.parameters()]


def same_bytes(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def everywhere(flag: bool) -> bool:
    """True when ``flag`` holds on every rank (collective)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def equal_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """Keys whose tensors differ in any bit (full tensors, gathered)."""
    return sorted(k for k in set(a) | set(b)
                  if k not in a or k not in b or not torch.equal(a[k], b[k]))


# --------------------------------------------------------------------- checkpoint helpers
_DIST_CKPT_TORCH_MODULES = (
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
)


@contextlib.contextmanager
def dist_checkpointing_on_cpu() -> Iterator[None]:
    """Megatron's ``torch_dist`` checkpoint strategy on this CPU machine, for the block.

    Two environment shims, no-ops where they are not needed, undone on exit: the strategy
    modules call ``torch.cuda.synchronize()/current_device()`` unconditionally (given the
    CPU view of ``torch.cuda`` that ``megatron_flat.cpu.backend`` gives Megatron's training
    modules), and the async file writer measures its memory with ``psutil``, which is not
    installed here. Checkpoint contents and the save/load logic are Megatron's.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_flat.cpu import backend as cpu

    with pytest_monkeypatch() as mp:
        if not torch.cuda.is_available():
            proxy = cpu.torch_proxy()
            for name in _DIST_CKPT_TORCH_MODULES:
                module = importlib.import_module(name)
                if getattr(module, "torch", None) is torch:
                    mp.setattr(module, "torch", proxy)
        if not getattr(filesystem_async, "HAVE_PSUTIL", True):
            mp.setattr(filesystem_async, "_process_memory", lambda: 0)
        yield


def pytest_monkeypatch():
    import pytest

    return pytest.MonkeyPatch.context()


def shared_tmpdir() -> str:
    """A fresh directory, the same path on every rank (collective)."""
    import tempfile

    path = [tempfile.mkdtemp(prefix="flat-optim-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def remove_shared(path: str) -> None:
    import shutil

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
