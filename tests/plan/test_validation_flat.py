"""The planner's flat terms against the memory meter on the tiny Megatron MoE GPT (CPU).

Each case is one shape with exactly one technique on (``Trainer(..., flat=FlatConfig)``,
world of one, full recompute, fp32) and trains one step under ``measure``. bf16 dispatch
and vocabulary cases run the forward and backward only, under the same meter sections
(this Trainer's fp32-only optimizer refuses bf16 parameters); the bf16 optimizer case
steps Megatron's mixed-precision optimizer around the offloaded one. The planner is called as
``estimate(model, Layout(fused_kernels=False, overlap=False, distributed_optimizer=False),
seq, flat=...)`` — Megatron's unfused reference path, nothing overlapping, Megatron's plain
optimizer — and its figures in the meter's definitions (``PeakReport.sections``, METER_*)
must be within 10% of the measured ones. What each comparison includes, as bytes above
the live set when the section opens (worst entry):

- PipelinedLLEP (``dispatch="pipelined"``; chunk cap c, and once K_max, chosen so that each
  layer runs 3–6 chunks, checked on every layer: ``flat_dispatch.last.num_chunks`` equals
  the planner's K): the ``expert dispatch`` section — one MoE layer's forward (router,
  route plan, chunk by chunk: the chunk's rows, expert by expert compute without autograd,
  combine) and backward (per chunk: rows with their output grads, then expert by expert the
  recomputed graph and its ``autograd.grad``), recompute included — against
  ``sections[METER_DISPATCH]``. The planner takes the hottest expert of a chunk at its
  bound (every token of the chunk routed to it), which routing below that bound does not
  reach, so this comparison is skewed: the prediction may be up to ``DISPATCH_SLACK`` above
  the measurement (and, as everywhere, 10% below).
- Ring-DTP (``vocab=True``, ``vocab_block_size`` below V: 4–6 strips): the ``vocabulary
  projection + loss`` section — the blocked single-rank version: one fp32 strip at a time,
  online state, fp32 dX, the weight gradient returned by the autograd Function — against
  ``sections[METER_VOCAB]``.
- SCO (``sco=True``; a host budget holding every boundary, or only the first 2 or 3 of 4):
  device: the ``checkpoint boundaries`` held bytes (live bytes at the decoder's exit minus
  its entry: the layer inputs past the budget and the final norm's part) against
  ``sections[METER_BOUNDARIES]``; device, in backward: the most boundaries restored at
  once (SCO's ``stats.max_restored_on_device`` × boundary bytes, a count SCO keeps, not a
  meter figure) against the planner's min(offloaded, prefetch + 1) boundaries; host: the
  pinned bytes the boundaries hold at the decoder's exit (``measure(...).host``'s
  ``checkpoint boundaries``) and the host pool's peak over the whole step (``step``: SCO
  is its only user, so restores add nothing) against the offloaded boundaries' bytes, and
  the pool's size (allocated whole at the first offload) against ``boundaries_host``; the MoE
  layer's ``expert dispatch`` section against ``sections[METER_DISPATCH]``, which SCO
  leaves at the stock formula (SCO runs Megatron's own reentrant checkpoint inside its
  hooks, so nothing but the boundary changes place).
- OffloadStreamAdamW (``optimizer_offload=True``; buckets of 8K–50K elements, far below
  the parameter count; 1–3 slots; at EP = 1 Megatron builds one sub-optimizer): device: the
  ``optimizer step`` section of the first step (staging slots allocated there, the AdamW
  kernel's scratch, and before them Megatron's CPU gradient clipping temporaries, which
  bind in one case) against ``sections[METER_OPTIMIZER]``; host: the host pool's peak in
  that section (m and v; each buffer rounded up to the pool's 512-byte alignment) against
  ``optimizer_host``. bf16: the same two, and the device bytes the optimizer holds after
  its first step against ``optimizer_device``, for Megatron's
  ``Float16OptimizerWithFloat16Params`` (its fp32 main params, the master, stay on the
  device: m and v on host) and for its distributed optimizer (precision-aware path: the
  fp32 master, m and v on host, only the staging slots on the device).
- Dispatch and vocabulary cases: the planner predicts no pinned host bytes and the step
  uses none.

Excluded: the all-to-all, LLEP spills and borrowed experts, received-row regrouping, the
Ring-DTP ring and sub-optimizers per parameter kind (all need EP or TP > 1; a world of one
runs the identity), overlap of communication with compute (CUDA only), fused GPU kernels,
allocator rounding/caching/fragmentation (the CPU meter counts storage bytes exactly; on
CUDA these belong in the fit margin), scratch inside single kernels, and the composed
step peak (``total`` adds terms that the meter's sections measure relative to different
entries).
"""

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple

import pytest
import torch

from megatron_flat.config import GIB, FlatConfig
from megatron_flat.plan import Layout, PeakReport, estimate
from megatron_flat.plan.peaks import (
    METER_BOUNDARIES,
    METER_DISPATCH,
    METER_OPTIMIZER,
    METER_VOCAB,
)
from megatron_flat.runtime.memory import format_bytes

TOLERANCE = 0.10
# PipelinedLLEP's term holds the hottest expert of a chunk at its bound (one route of every
# token of the chunk); the tiny model's router spreads a chunk's routes over its experts.
DISPATCH_SLACK = 0.30

HOST_STEP = "step"  # measure(...)'s whole-step section
# Row names of the figures that are not a device section's peak.
RESTORED = "boundaries restored in backward"
BOUNDARIES_HOST = "checkpoint boundaries (pinned host)"
STEP_HOST = "whole step (pinned host)"
POOL_HOST = "SCO's pool (host, allocated)"
OPTIMIZER_HOST = "optimizer step (pinned host)"
OPTIMIZER_HELD = "optimizer state held on device"

SWITCH = {"dispatch": dict(dispatch="pipelined"), "vocab": dict(vocab=True),
          "sco": dict(sco=True), "optimizer": dict(optimizer_offload=True)}

# (name, TinyMoE overrides): tokens, hidden, experts, top-k, FFN, vocabulary, depth.
SHAPES = {
    "seq128-v1024": dict(seq_length=128, vocab_size=1024),
    "seq128-h128-e8-v2048": dict(seq_length=128, hidden_size=128, num_experts=8,
                                 vocab_size=2048),
    "seq128x2-e8-k4-f32-v512": dict(seq_length=128, micro_batch_size=2, global_batch_size=2,
                                    num_experts=8, topk=4, moe_ffn_hidden_size=32,
                                    vocab_size=512),
    "seq128-f256-v512": dict(seq_length=128, moe_ffn_hidden_size=256, vocab_size=512),
    "seq64-h128-v4096": dict(seq_length=64, hidden_size=128, vocab_size=4096),
    "l4-seq128-v256": dict(num_layers=4, seq_length=128, vocab_size=256),
    "l4-seq64-h128-v256": dict(num_layers=4, seq_length=64, hidden_size=128, vocab_size=256),
}

# Bytes of one boundary (N·H fp32) of the two SCO shapes with 4 layers.
_B_L4 = 128 * 64 * 4
_B_L4_H128 = 64 * 128 * 4


@dataclass(frozen=True)
class Case:
    """One shape with one technique on (``technique``: a key of ``SWITCH``)."""

    shape: str
    technique: str
    knobs: dict = field(default_factory=dict)  # FlatConfig fields besides the switch
    dtype: str = "fp32"
    distopt: bool = False  # bf16 optimizer cases: Megatron's distributed optimizer

    @property
    def name(self) -> str:
        knobs = ",".join(_short(k, v) for k, v in self.knobs.items())
        return (f"{self.shape}/{self.technique}({knobs})"
                + ("/bf16" if self.dtype == "bf16" else "") + ("/distopt" if self.distopt else ""))


_SHORT = {"dispatch_chunk_tokens": "c", "dispatch_max_chunks": "K_max",
          "dispatch_saved_chunks": "kept", "vocab_block_size": "block",
          "sco_host_budget_gib": "budget", "sco_prefetch": "prefetch",
          "optimizer_bucket_numel": "bucket", "optimizer_num_slots": "slots"}


def _short(knob: str, value) -> str:
    if knob == "sco_host_budget_gib":
        value = format_bytes(round(value * GIB)).replace(".00", "").replace(" ", "")
    return f"{_SHORT.get(knob, knob)}={value}"


CASES: List[Case] = [
    # PipelinedLLEP: K = 4, 4, 6 (uneven chunks of 43 tokens), 3 (K_max caps c = 16).
    Case("seq128-v1024", "dispatch", dict(dispatch_chunk_tokens=32)),
    Case("seq128-h128-e8-v2048", "dispatch", dict(dispatch_chunk_tokens=32)),
    Case("seq128x2-e8-k4-f32-v512", "dispatch", dict(dispatch_chunk_tokens=50)),
    Case("seq128-f256-v512", "dispatch", dict(dispatch_chunk_tokens=16, dispatch_max_chunks=3)),
    Case("seq128x2-e8-k4-f32-v512", "dispatch", dict(dispatch_chunk_tokens=50), "bf16"),
    # The first 2 of 4 chunks keep their expert graphs for backward.
    Case("seq128-v1024", "dispatch", dict(dispatch_chunk_tokens=32, dispatch_saved_chunks=2)),
    # Ring-DTP on one rank: 4 strips of 256, 6 of 85–86, 5 of 819–820.
    Case("seq128-v1024", "vocab", dict(vocab_block_size=256)),
    Case("seq128x2-e8-k4-f32-v512", "vocab", dict(vocab_block_size=96)),
    Case("seq64-h128-v4096", "vocab", dict(vocab_block_size=1000)),
    Case("seq128-v1024", "vocab", dict(vocab_block_size=256), "bf16"),
    # SCO: every boundary fits; 2 of 4 fit (budget 2.5 boundaries); 3 of 4 with prefetch 2.
    Case("seq128-v1024", "sco", dict(sco_host_budget_gib=1.0)),
    Case("l4-seq128-v256", "sco", dict(sco_host_budget_gib=2.5 * _B_L4 / GIB)),
    Case("l4-seq64-h128-v256", "sco", dict(sco_host_budget_gib=3 * _B_L4_H128 / GIB,
                                           sco_prefetch=2)),
    # OffloadStreamAdamW: 14 buckets x 2 slots; 65 x 2 (clipping binds); 25 x 3; 6 x 1.
    Case("seq128-v1024", "optimizer", dict(optimizer_bucket_numel=20_000,
                                           optimizer_num_slots=2)),
    Case("seq128-v1024", "optimizer", dict(optimizer_bucket_numel=4096,
                                           optimizer_num_slots=2)),
    Case("seq128x2-e8-k4-f32-v512", "optimizer", dict(optimizer_bucket_numel=8192,
                                                      optimizer_num_slots=3)),
    Case("seq128-v1024", "optimizer", dict(optimizer_bucket_numel=50_000,
                                           optimizer_num_slots=1)),
    # bf16 model, Megatron's mixed-precision optimizers around OffloadStreamAdamW: the
    # Float16 one (fp32 master on the device, m and v on host) and the distributed one
    # (precision-aware path: master, m and v on host).
    Case("seq128-v1024", "optimizer", dict(optimizer_bucket_numel=20_000,
                                           optimizer_num_slots=2), "bf16"),
    Case("seq128-v1024", "optimizer", dict(optimizer_bucket_numel=20_000,
                                           optimizer_num_slots=2), "bf16", distopt=True),
]

# ----------------------------------------------------------------------------- the planner


def tiny_model(case: Case):
    """The case's ``TinyMoE`` (one microbatch per step unless the shape says otherwise)."""
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE(**{"micro_batch_size": 1, "global_batch_size": 1, **SHAPES[case.shape]})


def flat_config(case: Case) -> FlatConfig:
    """The FlatConfig with only the case's technique on."""
    return FlatConfig(**{**SWITCH[case.technique], **case.knobs})


def planner_layout(tiny, distopt: bool = False) -> Layout:
    """World of one on CPU: unfused kernels, nothing overlaps, Megatron's plain optimizer
    (or its distributed one, over a data-parallel group of one)."""
    return Layout(micro_batch_size=tiny.micro_batch_size, fused_kernels=False, overlap=False,
                  distributed_optimizer=distopt)


def plan(case: Case) -> PeakReport:
    tiny = tiny_model(case)
    return estimate(tiny.planner_spec(case.dtype), planner_layout(tiny, case.distopt),
                    tiny.seq_length, flat=flat_config(case))


# ---------------------------------------------------------------------------- the meter


@dataclass
class Measured:
    """Peaks by meter section (device and host pool) and what the technique reported."""

    device: Dict[str, int]
    host: Dict[str, int]
    facts: Dict[str, object]


def _facts(trainer, case: Case) -> Dict[str, object]:
    """What the technique itself says it did: chunks per layer, SCO's most boundaries
    restored at once, buckets and staging bytes per inner optimizer."""
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.optimizer import inner_optimizers

    if case.technique == "dispatch":
        layers = [m for m in trainer.model.modules() if isinstance(m, FlatMoELayer)]
        return {"chunks": [m.flat_dispatch.last.num_chunks for m in layers],
                "kept": [m.flat_dispatch.last.saved_chunks for m in layers]}
    if case.technique == "sco":
        return {"max_restored": trainer.sco.stats.max_restored_on_device,
                "pool_bytes": trainer.sco.pool.stats()["capacity_bytes"]}
    if case.technique == "optimizer":
        inner = inner_optimizers(trainer.optimizer)
        return {"buckets": [len(o.plan.buckets) for o in inner],
                "staging": [o.staging_bytes for o in inner]}
    return {}


_BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def _bf16_step(tiny, case: Case) -> Measured:
    """Forward + backward of a bf16 model under the meter's peak sections (no optimizer)."""
    from megatron_flat.megatron.peaks import attach_peak_sections
    from megatron_flat.runtime.memory import MemoryMeter
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer

    trainer = Trainer(tiny, TrainLayout(recompute="full"), flat=flat_config(case),
                      config_overrides=_BF16)
    trainer.warm_up()
    with MemoryMeter("cpu") as meter:
        sections = attach_peak_sections(trainer.model, meter)
        try:
            trainer.forward_backward(0)
        finally:
            sections.remove()
    device = {k: s.peak_device_bytes for k, s in meter.sections.items()}
    host = {k: s.peak_host_bytes for k, s in meter.sections.items()}
    host[HOST_STEP] = meter.peak_host_bytes
    return Measured(device, host, _facts(trainer, case))


def _bf16_optimizer_step(tiny, case: Case) -> Measured:
    """A bf16 model's first step with Megatron's mixed-precision optimizer (fp32 main
    params) around the case's offloaded inner optimizer (this Trainer builds an fp32-only
    optimizer, so it is replaced here, before any step): the ``optimizer step`` section,
    and the device bytes the optimizer holds after the step (live after it minus live
    before the optimizer was built; gradients live in DDP's buffers, built before)."""
    import gc

    from megatron.core.optimizer import OptimizerConfig

    from megatron_flat.megatron.optimizer import get_megatron_offload_optimizer
    from megatron_flat.runtime.memory import MemoryMeter
    from megatron_flat.testing.training import CLIP_GRAD, LR
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer

    trainer = Trainer(tiny, TrainLayout(recompute="full", distributed_optimizer=case.distopt),
                      config_overrides=_BF16)
    trainer.warm_up()
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, adam_beta1=0.9,
                             adam_beta2=0.999, adam_eps=1e-8, clip_grad=CLIP_GRAD, bf16=True,
                             params_dtype=torch.bfloat16,
                             use_distributed_optimizer=case.distopt)
    # The Trainer's own (fp32) optimizer is freed before metering, with the fp32 main
    # shards a distributed optimizer hangs on the model params (``main_param``).
    trainer.optimizer = None
    for param in trainer.ddp.parameters():
        if getattr(param, "main_param", None) is not None:
            param.main_param = None
    gc.collect()
    with MemoryMeter("cpu") as meter:
        trainer.optimizer = get_megatron_offload_optimizer(config, [trainer.ddp],
                                                           flat=flat_config(case))
        built = meter.current_device_bytes()
        trainer.forward_backward(0)
        gc.collect()
        # What the forward-backward leaves behind (caches, gradients) is not optimizer state.
        before_step = meter.current_device_bytes()
        with meter.section(METER_OPTIMIZER) as step:
            trainer.optimizer_step()
        gc.collect()
        held = built + meter.current_device_bytes() - before_step
    device = {METER_OPTIMIZER: step.peak_device_bytes, OPTIMIZER_HELD: held}
    return Measured(device, {METER_OPTIMIZER: step.peak_host_bytes}, _facts(trainer, case))


def measure_case(case: Case) -> Measured:
    """Build the case's trainer (world of one) and measure one step. Needs the process
    group and Megatron's CPU backend (fixture ``megatron_cpu``)."""
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer, measure

    tiny = tiny_model(case)
    with megatron_layout(seed=tiny.seed):
        if case.dtype == "bf16" and case.technique == "optimizer":
            return _bf16_optimizer_step(tiny, case)
        if case.dtype == "bf16":
            return _bf16_step(tiny, case)
        trainer = Trainer(tiny, TrainLayout(recompute="full"), flat=flat_config(case))
        report = measure(trainer, steps=1)
        return Measured(report.device, report.host, _facts(trainer, case))


# -------------------------------------------------------------------------- comparison


class Row(NamedTuple):
    case: str
    component: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        """Relative error of the prediction (+: the planner predicts more)."""
        return self.predicted / self.measured - 1 if self.measured else float("inf")


def compare(case: Case, report: PeakReport, got: Measured) -> List[Row]:
    """The (predicted, measured) pairs of the case's technique, bytes."""
    name = case.name
    if case.technique == "dispatch":
        return [Row(name, METER_DISPATCH, report.sections[METER_DISPATCH],
                    got.device[METER_DISPATCH])]
    if case.technique == "vocab":
        return [Row(name, METER_VOCAB, report.sections[METER_VOCAB], got.device[METER_VOCAB])]
    if case.technique == "sco":
        restored = min(report.boundaries_offloaded, flat_config(case).sco_prefetch + 1)
        return [Row(name, METER_BOUNDARIES, report.sections[METER_BOUNDARIES],
                    got.device[METER_BOUNDARIES]),
                Row(name, RESTORED, restored * report.boundary_bytes,
                    got.facts["max_restored"] * report.boundary_bytes),
                Row(name, BOUNDARIES_HOST, report.boundaries_host_in_use,
                    got.host[METER_BOUNDARIES]),
                Row(name, STEP_HOST, report.boundaries_host_in_use, got.host[HOST_STEP]),
                Row(name, POOL_HOST, report.boundaries_host, got.facts["pool_bytes"]),
                Row(name, METER_DISPATCH, report.sections[METER_DISPATCH],
                    got.device[METER_DISPATCH])]
    rows = [Row(name, METER_OPTIMIZER, report.sections[METER_OPTIMIZER],
                got.device[METER_OPTIMIZER]),
            Row(name, OPTIMIZER_HOST, report.optimizer_host, got.host[METER_OPTIMIZER])]
    if OPTIMIZER_HELD in got.device:
        rows.append(Row(name, OPTIMIZER_HELD, report.optimizer_device,
                        got.device[OPTIMIZER_HELD]))
    return rows


def format_table(rows: List[Row]) -> str:
    out = [f"{'case':60s} {'component':36s} {'predicted':>10s} {'measured':>10s} {'error':>7s}"]
    out += [f"{r.case:60s} {r.component:36s} {r.predicted:>10,d} {r.measured:>10,d} "
            f"{r.error:>+7.1%}" for r in rows]
    return "\n".join(out)


def _check(rows: List[Row]) -> None:
    bad = [r for r in rows if not abs(r.error) <= TOLERANCE]
    assert not bad, "planner off by more than 10%:\n" + format_table(bad)


# ------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def measured(megatron_cpu):
    assert len({case.name for case in CASES}) == len(CASES), "case names must differ"
    return {case.name: (case, plan(case), measure_case(case)) for case in CASES}


def _of(measured, technique: str):
    """The measured cases of ``technique`` that the planner must match."""
    got = [v for v in measured.values() if v[0].technique == technique]
    assert got, f"no {technique} case"
    return got


def test_pipelined_dispatch_matches_the_meter(measured):
    rows = []
    for case, report, got in _of(measured, "dispatch"):
        chunks = got.facts["chunks"]
        assert len(chunks) == tiny_model(case).num_layers, case.name
        assert report.num_chunks > 1 and chunks == [report.num_chunks] * len(chunks), \
            f"{case.name}: layers ran {chunks} chunks, planner K = {report.num_chunks}"
        kept = min(case.knobs.get("dispatch_saved_chunks", 0), report.num_chunks)
        assert got.facts["kept"] == [kept] * len(chunks), case.name
        rows += compare(case, report, got)
    bad = [r for r in rows if not -TOLERANCE <= r.error <= DISPATCH_SLACK]
    assert not bad, (f"planner more than {TOLERANCE:.0%} below the meter or more than "
                     f"{DISPATCH_SLACK:.0%} above it:\n" + format_table(bad))


def test_ring_dtp_matches_the_meter(measured):
    rows = []
    for case, report, got in _of(measured, "vocab"):
        assert case.knobs["vocab_block_size"] < tiny_model(case).vocab_size  # several strips
        rows += compare(case, report, got)
    _check(rows)


def test_sco_boundaries_match_the_meter_on_device_and_host(measured):
    rows = []
    for case, report, got in _of(measured, "sco"):
        assert report.boundaries_offloaded >= 2, case.name  # the budget holds two or more
        rows += compare(case, report, got)
    _check(rows)


def test_offload_optimizer_matches_the_meter_on_device_and_host(measured):
    rows = []
    for case, report, got in _of(measured, "optimizer"):
        assert got.facts["buckets"] and min(got.facts["buckets"]) > 1, case.name
        rows += compare(case, report, got)
    _check(rows)


def test_no_pinned_host_without_sco_or_offload(measured):
    for case, report, got in list(_of(measured, "dispatch")) + list(_of(measured, "vocab")):
        assert report.host_per_device == 0, case.name
        assert got.host[HOST_STEP] == 0, f"{case.name}: {got.host[HOST_STEP]} pinned bytes"
