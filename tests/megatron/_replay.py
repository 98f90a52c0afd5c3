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
    dtypes: set  # the model's parameter dtypes


def bf16() -> dict:
    """Trainer settings for Megatron's bf16 training: bf16 parameters, the model under
    ``Float16Module`` (inputs cast on the way in, the loss back to fp32), Megatron's
    mixed-precision optimizer."""
    from megatron.core.transformer.module import Float16Module

    return dict(config_overrides={"bf16": True, "params_dtype": torch.bfloat16,
                                  "pipeline_dtype": torch.bfloat16},  # PP's p2p buffers
                wrap_model=lambda model: Float16Module(model.config, model))


def train(tiny, layout, flat, steps: int = 2, **trainer) -> Run:
    """``steps`` steps of ``Trainer(tiny, layout, flat=flat, **trainer)`` from the tiny
    model's seed."""
    from megatron_flat.runtime.ledger import CostLedger
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Trainer

    with megatron_layout(layout.tp, layout.ep, layout.pp, cp=layout.cp, seed=tiny.seed):
        trainer = Trainer(tiny, layout, flat=flat, **trainer)
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
                   {type(m).__name__ for m in trainer.model.modules()},
                   {p.dtype for p in trainer.model.parameters()})
