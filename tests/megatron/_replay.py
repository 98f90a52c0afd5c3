"""Shared by the attention replay tests: train a tiny GPT for a few steps under full recompute
with a FlatConfig, counting the attention kernels per step."""

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class Run:
    losses: List[float]
    grads: List[torch.Tensor]  # the first step's main grads
    calls: List[int]  # the ledger's attention forwards, per step
    stats: Optional[object]  # replay's host-tier counters (None without replay)
    pool_used: int  # SCO's pool bytes still in use after the steps
    modules: set  # class names in the model


def train(tiny, layout, flat, steps: int = 2) -> Run:
    """``steps`` steps of ``Trainer(tiny, layout, flat=flat)`` from the tiny model's seed."""
    from megatron_flat.runtime.ledger import CostLedger
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Trainer

    with megatron_layout(layout.tp, layout.ep, layout.pp, cp=layout.cp, seed=tiny.seed):
        trainer = Trainer(tiny, layout, flat=flat)
        losses, grads, calls = [], None, []
        for step in range(steps):
            with CostLedger() as ledger:
                losses.append(trainer.forward_backward(step))
            calls.append(ledger.attention_forward_calls)
            if grads is None:
                grads = [p.main_grad.clone() for p in trainer.model.parameters()]
            trainer.optimizer_step()
        trainer.sco.synchronize()
        stores = trainer.replay_stores
        return Run(losses, grads, calls, stores[0].host.stats if stores else None,
                   trainer.sco.pool.stats()["used_bytes"],
                   {type(m).__name__ for m in trainer.model.modules()})
