"""One Megatron training setup shared by the equivalence harness, the demo and benchmarks.

``Trainer`` builds this rank's model for a ``Layout`` (inside an active
``megatron_layout``), wraps it in Megatron's DDP, builds Megatron's optimizer and runs a
step with the schedule that fits the pipeline size (1F1B when PP > 1). Nothing here
hides Megatron: the attributes are the real Megatron objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_flat.testing.tiny_gpt import (
    MicroBatch,
    TinyMoE,
    build_tiny_gpt,
    dp_share,
    global_batch,
    transformer_config,
)

LR = 1e-3
CLIP_GRAD = 1.0


@dataclass(frozen=True)
class Layout:
    """How the tiny model is split over the world (DP is whatever remains)."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dispatcher: str = "alltoall"
    distributed_optimizer: bool = False
    recompute: Optional[str] = None  # None, "full" or "selective"
    recompute_method: str = "uniform"  # full recompute: "uniform" or "block"
    recompute_modules: tuple = ()  # selective recompute: Megatron's module names

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"ep{self.ep}", f"pp{self.pp}", self.dispatcher]
        if self.distributed_optimizer:
            parts.append("distopt")
        if self.recompute == "full":
            parts.append(f"recompute-full-{self.recompute_method}")
        elif self.recompute:
            parts.append("recompute-selective-" + "+".join(self.recompute_modules))
        return "-".join(parts)


def forward_step(data_iterator, model):
    """Megatron ``forward_step_func``: per-token loss, mean over the microbatch."""
    mb: MicroBatch = next(data_iterator)
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        # clone: the schedule divides the returned loss in place by the microbatch count.
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


class Trainer:
    """Model + DDP + optimizer + schedule for one layout. Call inside ``megatron_layout``."""

    def __init__(self, tiny: TinyMoE, layout: Layout, *, config_overrides: Optional[dict] = None,
                 wrap_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                 init: Optional[Callable[[torch.nn.Module], None]] = None, lr: float = LR):
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.tiny, self.layout = tiny, layout
        self.config = transformer_config(
            tiny, tp=layout.tp, ep=layout.ep, pp=layout.pp, dispatcher=layout.dispatcher,
            recompute=layout.recompute, recompute_method=layout.recompute_method,
            recompute_modules=layout.recompute_modules, **(config_overrides or {}),
        )
        model = build_tiny_gpt(tiny, self.config)
        if wrap_model is not None:
            model = wrap_model(model)
        if init is not None:
            init(model)
        self.model = model
        self.ddp = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=layout.distributed_optimizer,
            ),
            module=model,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                adam_eps=1e-8, clip_grad=CLIP_GRAD, params_dtype=torch.float32,
                use_distributed_optimizer=layout.distributed_optimizer,
            ),
            [self.ddp],
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.ddp.no_sync
        self._forward_backward = get_forward_backward_func()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    def warm_up(self) -> None:
        """One forward-only pass over step 0's batch (no grads, no optimizer state).

        Fills Megatron's one-time caches (causal mask, rotary tables) so a meter opened
        afterwards attributes only per-step memory to the components.
        """
        mine = dp_share(global_batch(self.tiny, 0), self.dp_rank, self.dp_size)
        self._forward_backward(
            forward_step_func=forward_step, data_iterator=iter(mine), model=[self.ddp],
            num_microbatches=len(mine), seq_length=self.tiny.seq_length,
            micro_batch_size=self.tiny.micro_batch_size, forward_only=True,
        )

    def forward_backward(self, step: int) -> float:
        """Zero grads, run every microbatch of this rank's share; returns the step's mean loss
        over the global batch (known on every rank). Grads are finalized (reduced)."""
        mine = dp_share(global_batch(self.tiny, step), self.dp_rank, self.dp_size)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_dicts = self._forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(mine),
            model=[self.ddp],
            num_microbatches=len(mine),
            seq_length=self.tiny.seq_length,
            micro_batch_size=self.tiny.micro_batch_size,
            forward_only=False,
        )
        return step_loss(loss_dicts)

    def optimizer_step(self) -> None:
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"{self.layout.name}: optimizer step was skipped")


def step_loss(loss_dicts: List[dict]) -> float:
    """Mean loss of the step, known on every rank (only last stages compute it)."""
    from megatron.core import parallel_state

    local = None
    if parallel_state.is_pipeline_last_stage():
        local = sum(d["loss"].item() for d in loss_dicts) / len(loss_dicts)
    values: List[Optional[float]] = [None] * dist.get_world_size()
    dist.all_gather_object(values, local)
    # Every last-stage rank reports its DP replica's mean; TP peers repeat the same value
    # equally often for every replica, so the plain mean over them is the DP mean.
    present = [v for v in values if v is not None]
    return sum(present) / len(present)


def measure_peaks(trainer: Trainer, steps: int,
                  on_step: Optional[Callable[[int, float, float], None]] = None) -> dict:
    """Train ``steps`` steps under a ``MemoryMeter`` with one section per peak component.

    A forward-only warm-up runs first, outside the meter (see ``Trainer.warm_up``); the
    first step's optimizer-state allocation is inside it, as it is in a real run.

    Returns ``{component: bytes}`` for every name in ``peaks.COMPONENTS`` plus ``"step"``
    (the whole step), each the worst rank's peak (collective over the world).
    ``on_step(step, loss, seconds)`` is called after every step.
    """
    import time

    from megatron_flat.megatron.peaks import COMPONENTS, OPTIMIZER, attach_peak_sections
    from megatron_flat.runtime.memory import MemoryMeter

    trainer.warm_up()
    with MemoryMeter() as meter:
        sections = attach_peak_sections(trainer.model, meter)
        try:
            for step in range(steps):
                start = time.perf_counter()
                with meter.section("step"):
                    loss = trainer.forward_backward(step)
                    with meter.section(OPTIMIZER):
                        trainer.optimizer_step()
                if on_step is not None:
                    on_step(step, loss, time.perf_counter() - start)
        finally:
            sections.remove()
    names = list(COMPONENTS) + ["step"]
    peaks = torch.tensor([meter.sections[n].peak_device_bytes if n in meter.sections else 0
                          for n in names], dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank binds
    return dict(zip(names, peaks.tolist()))
