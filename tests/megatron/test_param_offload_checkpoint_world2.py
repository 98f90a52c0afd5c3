"""Param offload's state in Megatron's checkpoints, at EP 2: train 2 steps with the experts in
the host tier, save (torch_dist, and the legacy per-rank format), load into a fresh model and
optimizer whose weights differ, train 2 more: every parameter and every loss bitwise those of
4 uninterrupted steps — the host weights, the experts' fp32 masters and moments and their step
counts go out and come back exactly, and the device slots are refilled from the loaded weights."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer
from tests.optim import _megatron_runs as runs

pytestmark = pytest.mark.world(2)

FLAT = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8, optimizer_offload=True,
                  optimizer_bucket_numel=4096, param_offload=True)
# The distributed optimizer's format that loads on CPU (tests/optim's checkpoint tests use it).
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
TINY = TinyMoE(num_experts=4, topk=2, num_layers=3, global_batch_size=4)


def _trainer(layout, overrides, shift: float = 0.0) -> Trainer:
    trainer = Trainer(TINY, layout, flat=FLAT, config_overrides=overrides)
    if shift:  # other weights, which loading must replace everywhere
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(shift)
        for chunk in trainer.optimizer.chained_optimizers:
            offload = getattr(chunk, "offload", None)
            if offload is not None:
                offload.weights_updated()
    return trainer


def _steps(trainer, steps) -> list:
    losses = []
    for step in steps:
        losses.append(trainer.forward_backward(step))
        trainer.optimizer_step()
    return losses


def _params(trainer) -> dict:
    return {n: p.data.clone() for n, p in trainer.model.named_parameters()}


def _save(trainer, fmt, path):
    from megatron.core import dist_checkpointing

    if fmt == "torch_dist":
        model_sd = trainer.model.sharded_state_dict()
        state = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(
            model_sd, metadata=METADATA)}
        with runs.dist_checkpointing_on_cpu():
            dist_checkpointing.save(state, path)
        return
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()},
               os.path.join(path, f"rank{dist.get_rank()}.pt"))
    if trainer.layout.distributed_optimizer:  # the dense sub-optimizer's parameter state
        trainer.optimizer.save_parameter_state(os.path.join(path, "distrib_optim.pt"))


def _load(trainer, fmt, path):
    from megatron.core import dist_checkpointing

    if fmt == "torch_dist":
        model_sd = trainer.model.sharded_state_dict()
        template = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=METADATA)}
        with runs.dist_checkpointing_on_cpu():
            loaded = dist_checkpointing.load(template, path)
    else:
        loaded = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    trainer.model.load_state_dict(loaded["model"])
    with torch.no_grad():
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        if fmt == "legacy" and trainer.layout.distributed_optimizer:
            trainer.optimizer.load_parameter_state(os.path.join(path, "distrib_optim.pt"))


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpoint_round_trip_continues_bitwise(megatron_cpu, fmt, dtype):
    overrides = dict(bf16=True, params_dtype=torch.bfloat16) if dtype == "bf16" else {}
    layout = Layout(ep=2, recompute="full", distributed_optimizer=dtype == "bf16")
    with megatron_layout(ep=2):
        trainer = _trainer(layout, overrides)
        want_losses = _steps(trainer, range(4))
        want = _params(trainer)
    path = runs.shared_tmpdir()
    try:
        with megatron_layout(ep=2):
            first = _trainer(layout, overrides)
            losses = _steps(first, range(2))
            _save(first, fmt, path)
            dist.barrier()
        with megatron_layout(ep=2):
            resumed = _trainer(layout, overrides, shift=0.25)
            _load(resumed, fmt, path)
            losses += _steps(resumed, range(2, 4))
            got = _params(resumed)
    finally:
        runs.remove_shared(path)
    assert losses == want_losses
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
