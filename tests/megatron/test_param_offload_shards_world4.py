"""Param offload with the distributed optimizer at expert-DP 2 (4 ranks, EP 2): each replica
keeps and steps only its pieces of the experts' fp32 state (the distributed optimizer's
cut), the updated weights reach every replica, and checkpoints carry the state across
expert data-parallel sizes.

* Host bytes: each replica's inner optimizer holds 12 bytes per element it owns (bf16
  weights: fp32 master and two moments), the two replicas together 12 bytes per expert
  element, no more: half of what each held before the state was sharded.
* Training: bitwise the run with the experts in DDP's buffers (also
  test_param_offload_ddp_worlds.py's expert-DP 2 cases, which all shard now).
* Checkpoints (torch_dist): 2 steps at EP 2 (expert-DP 2), save; load at EP 4 (expert-DP 1:
  every rank owns whole experts, a different cut of the same state), save again; load at
  EP 2 into other weights, 2 more steps: every loss and parameter bitwise those of 4
  uninterrupted steps. And the legacy per-rank format round trip at expert-DP 2.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer
from tests.megatron import test_param_offload_checkpoint_world2 as ckpt
from tests.optim import _megatron_runs as runs

pytestmark = pytest.mark.world(4)

FLAT = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8, optimizer_offload=True,
                  optimizer_bucket_numel=4096, param_offload=True)
TINY = TinyMoE(num_experts=4, topk=2, num_layers=3, global_batch_size=8)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16)


def _layout(ep: int) -> Layout:
    return Layout(ep=ep, recompute="full", distributed_optimizer=True)


def _experts_optimizer(trainer):
    from megatron_flat.megatron.param_offload_optimizer import ParamOffloadOptimizer

    (found,) = [o for o in trainer.optimizer.chained_optimizers
                if isinstance(o, ParamOffloadOptimizer)]
    return found


def test_each_replica_holds_its_share_of_the_host_state(megatron_cpu):
    with megatron_layout(ep=2):
        trainer = Trainer(TINY, _layout(2), flat=FLAT, config_overrides=BF16)
        trainer.forward_backward(0)
        trainer.optimizer_step()
        experts = _experts_optimizer(trainer)
        shards = experts.shards
        assert shards.world == 2
        owned = sum(p.numel() for p in experts.get_parameters())
        total = sum(p.numel() for p in shards.params)
        held = experts.optimizer.host_bytes
        both = torch.tensor([held, owned])
        dist.all_reduce(both, group=shards.group)
    assert held == 12 * owned  # fp32 master + exp_avg + exp_avg_sq per owned element
    assert both.tolist() == [12 * total, total]  # the replicas' pieces cover each element once
    assert 0 < owned < total


def _round_trip(paths, fmt, first_ep, second_ep):
    """2 steps at EP first_ep, save; (load at EP second_ep into other weights, save
    again;) load at EP first_ep into other weights, 2 more steps."""
    with megatron_layout(ep=first_ep):
        first = ckpt._trainer(_layout(first_ep), BF16)
        losses = ckpt._steps(first, range(2))
        ckpt._save(first, fmt, paths[0])
        dist.barrier()
    if second_ep is not None:
        with megatron_layout(ep=second_ep):
            other = ckpt._trainer(_layout(second_ep), BF16, shift=0.5)
            ckpt._load(other, fmt, paths[0])
            ckpt._save(other, fmt, paths[1])
            dist.barrier()
        paths = paths[1:]
    with megatron_layout(ep=first_ep):
        resumed = ckpt._trainer(_layout(first_ep), BF16, shift=0.25)
        ckpt._load(resumed, fmt, paths[0])
        losses += ckpt._steps(resumed, range(2, 4))
        return losses, ckpt._params(resumed)


@pytest.mark.parametrize("fmt, second_ep", [("torch_dist", None), ("legacy", None),
                                             ("torch_dist", 4)])
def test_checkpoints_carry_the_sharded_state(megatron_cpu, monkeypatch, fmt, second_ep):
    monkeypatch.setattr(ckpt, "FLAT", FLAT)
    monkeypatch.setattr(ckpt, "TINY", TINY)
    with megatron_layout(ep=2):
        trainer = ckpt._trainer(_layout(2), BF16)
        want_losses = ckpt._steps(trainer, range(4))
        want = ckpt._params(trainer)
    paths = [runs.shared_tmpdir(), runs.shared_tmpdir()]
    try:
        losses, got = _round_trip(paths, fmt, 2, second_ep)
    finally:
        for path in paths:
            runs.remove_shared(path)
    assert losses == want_losses
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
