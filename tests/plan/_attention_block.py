"""The planner's attention-block term against the memory meter (shared by the world-1 and
world-2 tests and ``benchmarks/planner_scale.py``).

One Megatron MoE GPT step (fp32, full recompute, flash-style core attention:
``cpu.flash_attention``, the ``O(N)``-per-head kernel the planner models; Megatron's
local attention would add its N² scores) under ``testing.training.measure``, with the
layout's TP and sequence parallelism, stock or with ``FlatConfig(attn_tiles=...)``
(optionally with Ring-DTP). Two figures, each the worst rank's:

- ``attention block``: the meter's section around every layer's ``SelfAttention`` (forward,
  the recompute included, and backward; bytes above those live when it opened) against
  ``PeakReport.sections[METER_ATTENTION]`` (``plan.peaks.attention_block_section``);
- ``SP gather buffer``: the bytes of Megatron's persistent sequence-parallel gather buffer
  after the step (``parallel_state.get_global_memory_buffer()``; stock's gathered N × H
  lives there, sized by the first gather and never freed, so no section sees it rise)
  against ``sections[METER_GATHER_BUFFER]`` (``plan.peaks.sp_gather_buffer``).

The planner is called as in the other validations: Megatron's unfused reference path,
nothing overlapping, Megatron's plain optimizer.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_flat.config import FlatConfig
from megatron_flat.plan import Layout, estimate
from megatron_flat.plan.peaks import METER_ATTENTION, METER_GATHER_BUFFER

FIGURES = (METER_ATTENTION, METER_GATHER_BUFFER)


def tiny_model(**overrides):
    from megatron_flat.testing.tiny_gpt import TinyMoE

    base = dict(micro_batch_size=1, global_batch_size=1, attention="flash")
    return TinyMoE(**{**base, **overrides})


def planned(tiny, tp: int, flat: Optional[FlatConfig]) -> Dict[str, int]:
    layout = Layout(tp=tp, sp=tp > 1, micro_batch_size=tiny.micro_batch_size,
                    fused_kernels=False, overlap=False, distributed_optimizer=False)
    report = estimate(tiny.planner_spec(), layout, tiny.seq_length, flat=flat)
    return {name: report.sections[name] for name in FIGURES}


def measured(tiny, tp: int, flat: Optional[FlatConfig]) -> Dict[str, int]:
    """One step in a fresh Megatron layout over the whole world (TP = world size)."""
    import torch
    import torch.distributed as dist

    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer, gather_buffer_bytes, measure

    if dist.get_world_size() != tp:
        raise ValueError(f"TP {tp} runs on {tp} rank(s), this world has "
                         f"{dist.get_world_size()}")
    with megatron_layout(seed=tiny.seed, tp=tp):
        report = measure(Trainer(tiny, TrainLayout(recompute="full", tp=tp), flat=flat),
                         steps=1)
        buffer = torch.tensor([gather_buffer_bytes()], dtype=torch.int64)
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    return {METER_ATTENTION: report.device[METER_ATTENTION],
            METER_GATHER_BUFFER: int(buffer.item())}


def rows(case: str, tiny, tp: int, flat: Optional[FlatConfig]):
    """``[(case, figure, predicted, measured)]`` for one run."""
    plan, got = planned(tiny, tp, flat), measured(tiny, tp, flat)
    return [(case, name, plan[name], got[name]) for name in FIGURES]


def error(predicted: int, measured: int) -> float:
    """predicted / measured − 1; 0 when both are 0 (a buffer that never exists)."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1


def format_table(table) -> str:
    out = [f"{'case':34s} {'figure':18s} {'predicted':>12s} {'measured':>12s} {'error':>7s}"]
    out += [f"{c:34s} {f:18s} {p:>12,d} {m:>12,d} {error(p, m):>+7.1%}"
            for c, f, p, m in table]
    return "\n".join(out)
