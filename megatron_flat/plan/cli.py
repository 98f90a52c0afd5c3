"""``python -m megatron_flat plan``: will this run fit, on which layout, with which knobs?

Searches the layouts (``plan.layouts``: TP, CP, PP, DP and EP for the GPU count, any of them
fixed with ``--layout`` or ``--tp/--cp/--pp/--ep``) and plans on the chosen one: the fastest
where megatron-flat fits ``--seq``, else the one reaching the longest context. Prints each
peak per device on that layout without and with megatron-flat, the term that binds, the
knobs ``fit`` chose (and the ``--flat-*`` flags that set them); next to each flattened peak,
the predicted time cost of those knobs on ``--device`` (the step-time model of
``plan.time`` over the per-layer counts of ``plan.costs``, scaled to the model's layers on
the worst stage); the best three layouts of every run; the longest context each run
reaches at its own best layout. ``--json`` prints the same as one JSON object.

"Without megatron-flat" is a baseline (``plan.baselines``): stock Megatron, Megatron's
optimizer CPU offload, or FSDP2 with CPU offload. Each is searched like flat and shown at
its own best layout (a fair comparison), plus FSDP2 as the paper ran it (without sequence
sharding). ``--baseline`` picks the one the peak table compares with on the chosen layout,
by default the strongest: the one reaching the longest context at its best layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_flat.config import FlatConfig
from megatron_flat.plan import launch, query_chunks
from megatron_flat.plan.baselines import (
    BASELINES,
    DESCRIPTIONS,
    PAPER_BASELINE,
    PAPER_LABEL,
    allowed,
    paper_layout,
)
from megatron_flat.plan.costs import UNITS, attn_tiles
from megatron_flat.plan.fit import (
    KNOBS,
    TECHNIQUE_NAMES,
    DoesNotFit,
    HostBinds,
    Reach,
    enabled,
    fit,
    host_budget_per_device,
    max_context,
    param_offload_host_binds,
    reach_techniques,
    tightest_report,
)
from megatron_flat.plan.layouts import (
    GPU_COUNTS,
    LAYOUT_KEYS,
    RUNS,
    SAME_SPEED,
    WITHOUT_PARAM_OFFLOAD,
    LayoutSearch,
    fewest_gpus,
    layout_sizes,
    layout_text,
    parse_layout,
    search_layouts,
    unit_times,
)
from megatron_flat.plan import published
from megatron_flat.plan.layouts import step_seconds as _step_seconds
from megatron_flat.plan.model import PAPER_GPUS, Layout, ModelSpec, PlanError, load_model
from megatron_flat.plan.peaks import COMPONENTS, DEFAULT_SKEW, PeakReport, estimate, usable
from megatron_flat.plan.query_chunks import QueryChunkAssessment
from megatron_flat.plan.time import DEVICES, Prediction, format_seconds
from megatron_flat.plan.time import device as device_model
from megatron_flat.plan.units import (
    format_bytes,
    format_tokens,
    parse_bytes,
    parse_tokens,
)

HOST_MARGIN = 0.1  # fraction of host memory kept out of the pinned pools

ROW_LABELS = {
    "dispatch": "dispatch (MoE layer transient)",
    "vocab": "vocab (projection + loss)",
    "boundaries": "checkpoint boundaries on device",
    "optimizer": "optimizer/model state",
    "other": "attention/other activations",
    "total": "step peak",
}
RUN_LABELS = {"flat": "megatron-flat"}


def build_parser(prog: str = "python -m megatron_flat plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Predict the four memory peaks of a long-context MoE step, with and "
                    "without megatron-flat; search the parallel layout; name the binding "
                    "term, choose the knobs, find the longest context that fits.",
        epilog="Sizes: tokens take K/M (binary: 1M = 1,048,576); memory takes KiB/MiB/GiB/TiB "
               "(binary) or KB/MB/GB/TB (decimal). The step peak is optimizer/model state + "
               "boundaries + max(dispatch + other, vocab).")
    p.add_argument("--model", required=True,
                   help="preset (paper-120b, paper-241b, paper-667b, gpt-oss-20b, gpt-oss-120b, "
                        "DeepSeek-V3, Qwen3-30B-A3B) or a Hugging Face config.json path")
    p.add_argument("--seq", default=None,
                   help="sequence length, e.g. 1M or 131072 (default: the longest context "
                        "megatron-flat reaches on the layout that reaches furthest)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPU count (default for the paper presets: 16, 32, 64)")
    p.add_argument("--gpu-mem", required=True, help="memory per GPU, e.g. 141GiB or 80GB")
    p.add_argument("--host-mem", default=None,
                   help="host memory per node, e.g. 2TiB (default: pinned host not limited)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing a host (default 8)")
    p.add_argument("--layout", default=None,
                   help="fix parallel sizes, e.g. tp=8,cp=2,pp=1,ep=64 (any of tp, cp, pp, ep, "
                        "dp; the others are searched)")
    for dim, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline"), ("cp", "context")):
        p.add_argument(f"--{dim}", type=int, default=None,
                       help=f"fix the {what}-parallel size (as --layout {dim}=N; default: "
                            f"searched)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--skew", type=float, default=DEFAULT_SKEW,
                   help=f"routing skew, max/mean routes per EP rank (default {DEFAULT_SKEW})")
    p.add_argument("--margin", type=float, default=0.1,
                   help="fraction of GPU memory kept free (default 0.1)")
    p.add_argument("--without", action="append", default=[], choices=KNOBS,
                   metavar="TECHNIQUE",
                   help="a technique fit and the reach may not turn on (repeatable; one of "
                        f"{', '.join(KNOBS)}), e.g. --without attn_tiles for the reach "
                        "of the four peaks' techniques alone, --without attn_replay for the "
                        "step without attention replay")
    p.add_argument("--all-on", action="store_true",
                   help="flat column: every technique at its smallest-memory setting, "
                        "attention replay (a speed knob) off (default: the fewest techniques "
                        "that fit, at their cheapest settings, and attention replay where it "
                        "fits)")
    p.add_argument("--device", default="H200", choices=sorted(DEVICES),
                   help="GPU the step-time model predicts for (default H200)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step on each GPU, for the predicted step time "
                        "(default 1); with DP searched, the layouts with the fewest DP "
                        "replicas run this many, the others the same global batch")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step, instead of --microbatches: each layout runs "
                        "global batch / (micro-batch size x DP) microbatches per replica, so "
                        "layouts with more DP compare at the same work per step")
    p.add_argument("--baseline", default="auto", choices=("auto",) + BASELINES,
                   help="what the flat column is compared with: megatron (stock), "
                        "megatron-cpu-offload (--optimizer-cpu-offload), fsdp2-offload; "
                        "default auto: the strongest (longest context at its best layout)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--fewest-gpus", action="store_true",
                   help="instead of the plan: the fewest GPUs (1, 2, 4, ... 1024) on which "
                        "flat, flat without param offload and each baseline train --seq "
                        "tokens, with the first layout that fits there (needs --seq; --gpus "
                        "and fixed sizes are ignored)")
    p.add_argument("--emit-launch", action="store_true",
                   help="print the Megatron-LM launch command of the plan instead of the table: "
                        "torchrun + pretrain_gpt.py with the model's shape, the chosen parallel "
                        "layout, the --flat-* flags (with --json: a 'launch' list in the object)")
    return p


# Which peak row each unit's time cost sits next to, and what one unit is.
UNIT_ROWS = {"dispatch": "dispatch", "vocab": "vocab", "boundaries": "boundaries",
             "optimizer": "optimizer", "parameters": "optimizer"}
UNIT_LABELS = {
    "dispatch": "MoE layers (experts + all-to-all)",
    "vocab": "projection + loss",
    "boundaries": "attention + SCO copies",
    "optimizer": "optimizer step (per step)",
    "parameters": "parameters (FSDP2, param offload)",
}


def step_seconds(times: Dict[str, Dict[str, Prediction]], variant: str, microbatches: int,
                 stages: int = 1) -> float:
    """Predicted step of ``variant`` (``"baseline"`` or ``"flat"``) from ``predict_units``
    (``layouts.step_seconds``: every unit once per microbatch on the worst stage, PP − 1
    more for the pipeline's fill and drain, the optimizer once)."""
    return _step_seconds({u: pair[variant] for u, pair in times.items()}, microbatches, stages)


def published_beside(res: "PlanResult") -> List[dict]:
    """The recorded runs of this model at this length on these GPUs (``plan.published``),
    each with the planner's ``fsdp2-cp`` prediction of it under its own configuration and
    megatron-flat's predicted peak and step on the chosen layout (same length, same GPUs)."""
    runs = published.matching(res.model, res.layout.gpus, res.seq_len, res.device)
    if not runs:  # most plans: no recorded run to time flat against
        return []
    out = []
    flat_step = step_seconds(predict_units(res), "flat", res.microbatches, res.layout.pp)
    for pub in runs:
        lay = Layout(**pub.point["layout"])
        predicted = _step_seconds(unit_times(res.model, lay, pub.report, None, res.device), 1)
        out.append({"id": pub.point["id"], "source": pub.point["source"],
                    "layout": layout_sizes(lay), "measured_peak_bytes": pub.peak_bytes,
                    "measured_step_s": pub.point.get("step_s"),
                    "predicted_peak_bytes": pub.report.total, "predicted_step_s": predicted,
                    "flat_peak_bytes": res.flat_report.total, "flat_step_s": flat_step,
                    "flat_fits": res.error is None and res.fits(res.flat_report)})
    return out


def predict_units(res: "PlanResult") -> Dict[str, Dict[str, Prediction]]:
    """Predicted time of each unit, the table's baseline and flat, on the chosen layout and
    ``res.device`` (per microbatch on the worst stage; the optimizer per step)."""
    base = unit_times(res.model, res.layout, res.baseline, None, res.device)
    flat = unit_times(res.model, res.layout, res.flat_report, res.flat, res.device)
    return {u: {"baseline": base[u], "flat": flat[u]} for u in UNITS}


def _cost(base: float, flat: float) -> str:
    """The flat run's extra predicted seconds over the baseline's, for tables."""
    delta = flat - base
    if abs(delta) < 5e-7:
        return "+0"
    sign = "+" if delta > 0 else "-"
    ratio = flat / base if base else float("inf")
    rel = f" ({delta / base:+.0%})" if ratio < 10 else f" (x{ratio:.0f})" if base else ""
    return f"{sign}{format_seconds(abs(delta))}{rel}"


def _knob_summary(report: PeakReport, flat: FlatConfig,
                  replay_why: Optional[str] = None) -> List[str]:
    lines = []
    if flat.dispatch == "pipelined":
        lines.append(f"{TECHNIQUE_NAMES['dispatch']}: c = {flat.dispatch_chunk_tokens:,} tokens, "
                     f"K_max = {flat.dispatch_max_chunks} (K = {report.num_chunks} chunks of "
                     f"{report.chunk_tokens:,} tokens per source), routing skew after LLEP "
                     f"{report.skew:g}")
    elif flat.dispatch == "llep":
        lines.append(f"LLEP (unchunked): routing skew {report.skew:g} after LLEP")
    if flat.vocab:
        lines.append(f"{TECHNIQUE_NAMES['vocab']}: mode {flat.vocab_mode} "
                     f"(moves {report.vocab_mode})")
    if flat.sco:
        replay = (f"; {format_bytes(report.replay_host)} of it attention replay's"
                  if report.replay_kept else "")
        lines.append(f"{TECHNIQUE_NAMES['sco']}: host budget {flat.sco_host_budget_gib:.3f} GiB "
                     f"per GPU ({report.boundaries_offloaded} of {report.boundaries_held} "
                     f"boundaries of {format_bytes(report.boundary_bytes)} on host{replay}), "
                     f"prefetch {flat.sco_prefetch}")
    if flat.optimizer_offload:
        lines.append(f"{TECHNIQUE_NAMES['optimizer_offload']}: bucket "
                     f"{flat.optimizer_bucket_numel:,} params x {flat.optimizer_num_slots} "
                     f"slot{'s' if flat.optimizer_num_slots != 1 else ''} "
                     f"({format_bytes(report.optimizer_device)} staging, "
                     f"{format_bytes(report.optimizer_host)} pinned host per GPU)")
    if flat.param_offload:
        lines.append(f"{TECHNIQUE_NAMES['param_offload']}: the routed experts' weights and fp32 "
                     f"gradients ({report.params_offloaded:,} params) in the host tier "
                     f"({format_bytes(report.params_host)} pinned host per GPU); on the "
                     f"device 2 weight + 2 gradient slots of one MoE layer "
                     f"({format_bytes(report.params_slots)}), fetched one layer ahead")
    if flat.attn_tiles:
        lines.append(f"{TECHNIQUE_NAMES['attn_tiles']}: {flat.attn_tiles:,} gathered tokens a "
                     f"tile ({attn_tiles(report.layout, report.tokens, flat)} tiles per "
                     "projection)")
    if report.replay_kept:
        lines.append(f"{TECHNIQUE_NAMES['attn_replay']}: O + LSE of {report.replay_kept} "
                     f"layer{'s' if report.replay_kept != 1 else ''} of "
                     f"{format_bytes(report.replay_bytes)} kept on host "
                     f"({format_bytes(report.replay_host)} per GPU, in SCO's budget), one "
                     "restored ahead of its layer; the recompute skips each layer's core "
                     "attention (transformer-engine's fused backend, or the project's flash "
                     "attention; TE's flash-attn backend recomputes as stock, with a warning; "
                     "under CP every ring step's partial is kept)")
    elif lines:
        why = replay_why or report.replay_off or "off"
        lines.append(f"{TECHNIQUE_NAMES['attn_replay']}: off ({why})")
    return lines or ["none needed: the baseline fits"]


def flat_flags(flat: FlatConfig) -> str:
    """The ``--flat-*`` flags that reproduce ``flat`` (enabled techniques' knobs only)."""
    groups = {
        "dispatch": ("dispatch_chunk_tokens", "dispatch_max_chunks"),
        "vocab": ("vocab_mode",),
        "sco": ("sco_host_budget_gib", "sco_prefetch"),
        "optimizer_offload": ("optimizer_bucket_numel", "optimizer_num_slots"),
        "param_offload": (),
        "attn_tiles": (),
        "attn_replay": (),
    }
    out = []
    for switch, knobs in groups.items():
        if not enabled(flat, switch):
            continue
        if switch == "dispatch":
            out.append(f"--flat-dispatch {flat.dispatch}")
            if flat.dispatch != "pipelined":
                continue  # chunk knobs only matter when chunking
        elif switch == "attn_tiles":
            out.append(f"--flat-attn-tiles {flat.attn_tiles}")  # the switch is the tile size
        else:
            out.append("--flat-" + switch.replace("_", "-"))
        for knob in knobs:
            value = getattr(flat, knob)
            value = format(value, ".6g") if isinstance(value, float) else value
            out.append(f"--flat-{knob.replace('_', '-')} {value}")
    return " ".join(out)


def _binds(p: Prediction) -> str:
    parts = {"compute": p.compute_s, "exposed transfers": p.exposed_comm_s + p.exposed_copy_s,
             "sync stalls and host planning": p.stall_s}
    if p.launch_bound:
        parts["launches"] = parts.pop("compute")
    return max(parts, key=parts.get) if any(parts.values()) else "nothing"


@dataclass
class RunAt:
    """One baseline on one layout: its peaks at the plan's sequence length (``report``;
    None with ``why`` when the layout cannot run it or split the length), its ``reach``
    there and its predicted step with ``microbatches`` per DP replica."""

    name: str
    layout: Layout
    report: Optional[PeakReport]
    reach: int
    step_s: Optional[float]
    microbatches: int
    why: Optional[str] = None
    at_best: bool = True     # the run's own best layout (False: it fits no length anywhere)

    @property
    def sequences(self) -> int:
        """Sequences one predicted step trains (microbatches × micro-batch size × DP)."""
        return self.microbatches * self.layout.micro_batch_size * self.layout.dp


@dataclass
class PlanResult:
    """Everything the CLI prints (``to_json`` is the ``--json`` object)."""

    model: ModelSpec
    layout: Layout           # the chosen layout (``search.chosen``)
    search: LayoutSearch
    chosen: List[str]        # layout sizes the planner chose (not given)
    seq_len: int
    seq_asked: bool          # False: seq_len is flat's reach on the chosen layout
    skew: float
    device_bytes: int
    budget: int              # usable device bytes
    host_bytes: Optional[int]  # per node; None: not limited
    baseline: PeakReport     # the baseline the table compares with, on the chosen layout
    flat_report: PeakReport
    flat: FlatConfig
    reach: Reach             # every run's reach on the chosen layout
    error: Optional[str]     # why nothing fits (flat_report is then the smallest setting)
    all_on: bool = False     # flat = every technique at its smallest-memory setting
    device: str = "H200"     # what the step-time model predicts for
    microbatches: int = 1    # per step on each GPU of the chosen layout
    global_batch: int = 1    # sequences per step
    baseline_name: str = "megatron"
    # every baseline at its own best layout (at the chosen one when it fits nowhere)
    runs: Dict[str, RunAt] = field(default_factory=dict)
    paper: Optional[RunAt] = None   # PAPER_LABEL
    # would query-chunked core attention pay here (``plan.query_chunks``); None: no reach
    query_chunks: Optional[QueryChunkAssessment] = None
    not_allowed: Dict[str, str] = field(default_factory=dict)  # on the chosen layout
    # where the node's host memory keeps param offload from adding reach (None: it does not)
    param_offload_host: Optional[HostBinds] = None
    attn_replay_why: Optional[str] = None   # why attention replay is off (None: on)
    flat_without_replay: Optional[FlatConfig] = None  # fit's knobs before replay (when on)

    @property
    def strongest(self) -> Optional[str]:
        return self.search.strongest()

    def fits(self, report: PeakReport) -> bool:
        """The criterion ``fit`` uses: total within the usable device bytes, pinned host
        need within the node's memory less ``HOST_MARGIN``, shared by its GPUs."""
        host = host_budget_per_device(report.layout, self.host_bytes, HOST_MARGIN)
        return report.total <= self.budget and (host is None or report.host_per_device <= host)

    def replay_saving(self, times: Dict[str, Dict[str, Prediction]]) -> Optional[dict]:
        """The flat step with and without attention replay (``times``: ``predict_units``),
        on the chosen layout; None when replay is off."""
        if self.flat_without_replay is None:
            return None
        report = estimate(self.model, self.layout, self.seq_len, self.flat_without_replay,
                          skew=self.skew)
        without = unit_times(self.model, self.layout, report, self.flat_without_replay,
                             self.device)
        lay = self.layout
        step = step_seconds(times, "flat", self.microbatches, lay.pp)
        before = _step_seconds(without, self.microbatches, lay.pp)
        return {"step_s": step, "step_s_without": before, "saved_s": before - step}

    def replay_json(self, times: Dict[str, Dict[str, Prediction]]) -> dict:
        """The ``attn_replay`` object of ``--json``."""
        r = self.flat_report
        out = {"on": bool(r.replay_kept), "why_off": None if r.replay_kept else
               (self.attn_replay_why or r.replay_off or "off"),
               "bytes_per_layer": r.replay_bytes, "layers_kept": r.replay_kept,
               "host_bytes_per_device": r.replay_host,
               "prefetch_device_bytes": r.replay_device}
        saving = self.replay_saving(times)
        out.update(saving or {"step_s": None, "step_s_without": None, "saved_s": 0.0})
        return out

    def _run_json(self, run: RunAt) -> dict:
        if run.report is None:
            return {"allowed": False, "why": run.why, "layout": layout_sizes(run.layout)}
        return {"layout": layout_sizes(run.layout), "at_best_layout": run.at_best,
                "total": run.report.total, "fits": self.fits(run.report),
                "max_context": run.reach, "host_bytes": run.report.host_per_device,
                "host_pinned_bytes": run.report.host_pinned, "predicted_step_s": run.step_s,
                "microbatches": run.microbatches, "sequences_per_step": run.sequences,
                "describes": DESCRIPTIONS[run.name]}

    def to_json(self) -> dict:
        lay, flat, r, search = self.layout, self.flat, self.flat_report, self.search
        knobs = flat.to_dict()
        knobs.update(enabled=[t for t in TECHNIQUE_NAMES if enabled(flat, t)],
                     num_chunks=r.num_chunks, chunk_tokens=r.chunk_tokens,
                     vocab_mode_used=r.vocab_mode, boundaries_offloaded=r.boundaries_offloaded,
                     boundaries_held=r.boundaries_held, flags=flat_flags(flat))
        out = {
            "model": self.model.name,
            "model_description": self.model.describe(),
            "layout": {"gpus": lay.gpus, "tp": lay.tp, "ep": lay.ep, "pp": lay.pp, "cp": lay.cp,
                       "dp": lay.dp, "sp": lay.sp, "micro_batch_size": lay.micro_batch_size,
                       "microbatches_in_flight": lay.in_flight,
                       "gpus_per_node": lay.gpus_per_node, "chosen": self.chosen,
                       "chosen_by": search.chosen_by, "fixed": search.fixed,
                       "candidates": search.candidates},
            "layouts": {run: [x.as_dict() for x in search.reach.get(run, [])] for run in RUNS},
            "layouts_fastest": [x.as_dict() for x in search.fastest],
            "seq_len": self.seq_len,
            "seq_len_from": "asked" if self.seq_asked else "flat's max context on the layout",
            "tokens_per_rank": self.baseline.tokens,
            "skew": self.skew,
            "device_bytes": self.device_bytes,
            "usable_bytes": self.budget,
            "baseline": self.baseline.components(),
            "flat": r.components(),
            "binding": {"baseline": self.baseline.binding, "flat": r.binding},
            "fits": {"baseline": self.fits(self.baseline),
                     "flat": self.error is None and self.fits(r)},
            "flat_is": "smallest-memory settings" if self.all_on or self.error else
                       "fewest techniques that fit",
            "knobs": knobs,
            "host_bytes": {"baseline": self.baseline.host_per_node, "flat": r.host_per_node,
                           "flat_per_device": r.host_per_device, "available": self.host_bytes},
            "max_context": {"baseline": search.best_reach(self.baseline_name),
                            "flat": search.best_reach("flat"),
                            "flat_without_attn_tiles": self.reach.flat_without_attn_tiles,
                            "flat_without_param_offload":
                                self.reach.flat_without_param_offload},
            "max_context_on_layout": {"baseline": self.reach.baselines.get(self.baseline_name,
                                                                           0),
                                      "flat": self.reach.flat,
                                      "flat_without_attn_tiles":
                                          self.reach.flat_without_attn_tiles,
                                      "flat_without_param_offload":
                                          self.reach.flat_without_param_offload},
            "max_context_granularity": self.reach.granularity,
            "param_offload_host_binds": (self.param_offload_host.as_dict()
                                         if self.param_offload_host is not None else None),
            "query_chunked_attention": (self.query_chunks.as_dict()
                                        if self.query_chunks is not None else None),
            "baseline_name": self.baseline_name,
            "baselines": {name: self._run_json(run) for name, run in self.runs.items()},
            "paper_baseline": dict(self._run_json(self.paper), name=PAPER_BASELINE,
                                   label=PAPER_LABEL) if self.paper else None,
            "strongest_baseline": self.strongest,
            "reach_ratio": search.ratio(),
            "published": published_beside(self),
        }
        times = predict_units(self)
        out["predicted_time"] = {
            "device": self.device,
            "note": "predicted by the step-time model (megatron_flat.plan.time), not measured;"
                    " seconds per microbatch on the worst stage, the optimizer per step",
            "units": {u: {v: p.as_dict() for v, p in pair.items()} for u, pair in times.items()},
            "cost_s": {u: pair["flat"].total_s - pair["baseline"].total_s
                       for u, pair in times.items()},
            "microbatches": self.microbatches,
            "global_batch": self.global_batch,
            "step_s": {v: step_seconds(times, v, self.microbatches, lay.pp)
                       for v in ("baseline", "flat")},
        }
        out["attn_replay"] = self.replay_json(times)
        if self.error:
            out["error"] = self.error
        return out


def _fixed_sizes(args: argparse.Namespace) -> Dict[str, int]:
    """``--tp/--cp/--pp/--ep`` and ``--layout`` merged; ``PlanError`` when they disagree."""
    fixed = {d: getattr(args, d) for d in ("tp", "cp", "pp", "ep")
             if getattr(args, d) is not None}
    for key, value in (parse_layout(args.layout) if args.layout is not None else {}).items():
        if fixed.get(key, value) != value:
            raise PlanError(f"--{key} {fixed[key]} and --layout {key}={value} disagree")
        fixed[key] = value
    return fixed


def _microbatches(global_batch: int, layout: Layout) -> Optional[int]:
    """Microbatches per replica of ``layout`` for ``global_batch`` sequences per step;
    None when its micro-batch size × DP does not divide the batch."""
    per_step = layout.micro_batch_size * layout.dp
    return global_batch // per_step if global_batch % per_step == 0 else None


def _run_at(name: str, model: ModelSpec, layout: Layout, seq: int, reach: int, args,
            global_batch: int, at_best: bool = True) -> RunAt:
    """Baseline ``name`` on ``layout`` at ``seq`` tokens: peaks and predicted step. A
    layout whose DP does not divide the global batch is timed with one microbatch per
    replica (a step of micro-batch size × DP sequences)."""
    mb = _microbatches(global_batch, layout) or 1
    why = allowed(name, layout)
    if why:
        return RunAt(name, layout, None, 0, None, mb, why=why, at_best=at_best)
    try:
        report = estimate(model, layout, seq, None, skew=args.skew, baseline=name)
    except PlanError as err:
        return RunAt(name, layout, None, reach, None, mb, why=str(err), at_best=at_best)
    times = unit_times(model, layout, report, None, device_model(args.device).name)
    return RunAt(name, layout, report, reach, _step_seconds(times, mb, layout.pp), mb,
                 at_best=at_best)


def plan(args: argparse.Namespace) -> PlanResult:
    """Search the layouts, then evaluate everything the CLI prints on the chosen one."""
    model = load_model(args.model)
    seq = parse_tokens(args.seq) if args.seq is not None else None
    device = parse_bytes(args.gpu_mem)
    host = parse_bytes(args.host_mem) if args.host_mem is not None else None
    if args.microbatches is not None and args.microbatches < 1:
        raise PlanError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.global_batch is not None:
        if args.microbatches is not None:
            raise PlanError("give --microbatches or --global-batch, not both")
        if args.global_batch < 1:
            raise PlanError(f"--global-batch must be >= 1, got {args.global_batch}")
    gpus = args.gpus if args.gpus is not None else PAPER_GPUS.get(model.name)
    if gpus is None:
        raise PlanError(f"give --gpus for {model.name} (only the paper presets have a default)")
    fixed = _fixed_sizes(args)
    # --all-on runs no speed knob, so its layout is ranked by the step it runs.
    without = set(args.without) | ({"attn_replay"} if args.all_on else set())
    if model.mla is not None:
        # Multi-latent attention: its projections are tiled (install() takes the knob), but
        # the attention-block peak term is written for one QKV projection of the hidden
        # states, not MLA's latents, and attention replay has no equivalence test with MLA
        # yet: the plan neither counts on them nor puts them in a launch line.
        without |= {"attn_tiles", "attn_replay"}
    if model.sinks or model.window:
        # Attention replay keeps the flash kernel's output and log-sum-exp; with sinks or a
        # window it has no equivalence test yet (the CPU flash attention refuses both).
        without |= {"attn_replay"}
    kw = dict(margin=args.margin, host_margin=HOST_MARGIN, skew=args.skew,
              allow=tuple(t for t in KNOBS if t not in without))
    dev = device_model(args.device).name
    search = search_layouts(model, gpus, device, host, fixed=fixed, seq_len=seq, device=dev,
                            microbatches=args.microbatches or 1,
                            global_batch=args.global_batch, gpus_per_node=args.gpus_per_node,
                            micro_batch_size=args.micro_batch_size, **kw)
    layout = search.chosen
    microbatches = _microbatches(search.global_batch, layout)
    if microbatches is None:
        raise PlanError(f"the global batch of {search.global_batch} sequences does not split "
                        f"over DP {layout.dp} x micro-batch size {layout.micro_batch_size}; "
                        f"give --global-batch a multiple of {layout.dp * layout.micro_batch_size}")
    reach = max_context(model, layout, device, host, **kw)
    seq_asked = seq is not None
    if seq is None:
        seq = reach.flat or reach.granularity  # the longest context flat fits here
    error = None
    without_replay = None
    if args.all_on:
        flat_report = tightest_report(model, layout, seq, host, host_margin=HOST_MARGIN,
                                      skew=args.skew, allow=kw["allow"])
        flat = flat_report.flat or FlatConfig()
        replay_why = "--all-on shows the smallest-memory settings"
    else:
        try:
            result = fit(model, layout, seq, device, host, device=dev, **kw)
            flat_report, flat = result.report, result.flat
            replay_why, without_replay = result.attn_replay_why, result.without_replay
        except DoesNotFit as err:
            error = str(err)
            flat_report = err.best
            flat = flat_report.flat or FlatConfig()
            replay_why = "the step does not fit"
    on_layout: Dict[str, Optional[PeakReport]] = {}
    not_allowed: Dict[str, str] = {}
    runs: Dict[str, RunAt] = {}
    for name in BASELINES:
        why = allowed(name, layout)
        if why:
            on_layout[name], not_allowed[name] = None, why
        else:
            on_layout[name] = estimate(model, layout, seq, None, skew=args.skew, baseline=name)
        best = search.best(name)
        runs[name] = _run_at(name, model, best.layout if best else layout, seq,
                             best.reach if best else reach.baselines.get(name, 0), args,
                             search.global_batch, at_best=best is not None)
    lay_p = paper_layout(model, gpus, gpus_per_node=args.gpus_per_node,
                         micro_batch_size=args.micro_batch_size)
    paper = _run_at(PAPER_BASELINE, model, lay_p, seq,
                    max_context(model, lay_p, device, host, **kw).baselines[PAPER_BASELINE],
                    args, search.global_batch)
    name = args.baseline
    if name == "auto":
        name = search.strongest() or "megatron"
        if on_layout.get(name) is None:
            name = "megatron"
    elif on_layout.get(name) is None:
        raise PlanError(f"--baseline {name}: {not_allowed[name]}")
    return PlanResult(model=model, layout=layout, search=search,
                      chosen=[d.upper() for d in search.searched], seq_len=seq,
                      seq_asked=seq_asked, skew=args.skew, device_bytes=device,
                      budget=usable(device, args.margin), host_bytes=host,
                      baseline=on_layout[name], flat_report=flat_report, flat=flat, reach=reach,
                      error=error, all_on=args.all_on, device=dev, microbatches=microbatches,
                      global_batch=search.global_batch, baseline_name=name, runs=runs,
                      paper=paper, not_allowed=not_allowed,
                      attn_replay_why=replay_why, flat_without_replay=without_replay,
                      param_offload_host=param_offload_host_binds(
                          model, layout, device, host, reach, **kw),
                      query_chunks=query_chunks.assess(
                          model, layout, reach.flat, host, host_margin=HOST_MARGIN,
                          skew=args.skew, allow=reach_techniques(reach, kw["allow"])))


def _tokens(n: int) -> str:
    return format_tokens(n) if n else "none"


def _chose_why(res: PlanResult) -> str:
    """Why the chosen layout, for the layout line."""
    s = res.search
    n = f"{s.candidates} layout{'s' if s.candidates != 1 else ''} searched"
    if s.chosen_by == "fastest":
        return (f"the fastest predicted step where flat fits {format_tokens(res.seq_len)}, "
                f"longest reach among those within {SAME_SPEED:.0%}; {n}")
    if s.chosen_by == "reach":
        where = "nowhere fits " + format_tokens(res.seq_len) + "; " if res.seq_asked else ""
        return f"{where}flat's longest reach; {n}"
    return f"nothing fits at any length; the preferred of {n}"


def _layouts_section(res: PlanResult) -> List[str]:
    """The best three layouts of every run (and flat's fastest at the asked length)."""
    s = res.search
    fastest = f"{RUN_LABELS['flat']}, fastest at {format_tokens(res.seq_len)}"
    width = max(len(label) for label in [fastest, *BASELINES]) + 2
    lines = [f"layouts: {s.candidates} searched for {s.gpus} GPUs"
             + (f" ({', '.join(f'{k.upper()} {v}' for k, v in s.fixed.items())} fixed)"
                if s.fixed else "")
             + "; each run's best three by max context",
             f"  {'run':{width}s}{'layout':28s}{'max context':>12s}{'predicted step':>16s}"]

    def rows(label: str, ranked, timed: bool = False) -> None:
        for i, r in enumerate(ranked):
            step = format_seconds(r.step_s) if timed and r.step_s is not None else ""
            mark = "  <- this layout" if timed and r.layout == res.layout else ""
            lines.append(f"  {label if i == 0 else '':{width}s}{layout_text(r.layout):28s}"
                         f"{_tokens(r.reach):>12s}{step:>16s}{mark}".rstrip())

    for run in RUNS:
        label = RUN_LABELS.get(run, run)
        ranked = s.reach.get(run, [])
        if ranked:
            rows(label, ranked)
        else:
            lines.append(f"  {label:{width}s}fits no length at any layout")
        if run == "flat" and s.fastest:
            rows(fastest, s.fastest, timed=True)
    if s.fastest:
        lines.append(f"  (fastest: predicted steps of {s.global_batch} sequence"
                     f"{'s' if s.global_batch != 1 else ''}; steps within {SAME_SPEED:.0%} of "
                     "the fastest count as equal and the longer reach ranks first, since the "
                     "step-time model does not price TP's and CP's collectives)")
    return lines


def _baselines_section(res: PlanResult) -> List[str]:
    """Every baseline at its own best layout, the paper's row, the strongest."""
    yes = {True: "yes", False: "NO"}
    s, mc = res.search, res.reach
    best = s.best("flat")
    where = f" at its best layout, {layout_text(best.layout)}" if best else ""
    lines = [f"max context: flat {_tokens(s.best_reach('flat'))}{where}; on this layout "
             f"{_tokens(mc.flat)} (multiples of {mc.granularity:,} tokens)"]
    hb = res.param_offload_host
    if hb is not None:
        lines.append(f"param offload: host memory binds on this layout: "
                     f"{_tokens(hb.reach)} with or without it at "
                     f"{format_bytes(hb.host_bytes)} per node; with host memory unlimited "
                     f"flat would reach {_tokens(hb.unlimited_with)} with it "
                     f"({_tokens(hb.unlimited_without)} without), pinning "
                     f"{format_bytes(hb.host_per_node_needed)} per node")
    if mc.flat_without_param_offload != mc.flat:
        lines.append(f"param offload: on this layout {_tokens(mc.flat)} with it, "
                     f"{_tokens(mc.flat_without_param_offload)} without it "
                     f"({mc.flat / max(mc.flat_without_param_offload, 1):.2f}x)")
    qc = res.query_chunks
    if qc is not None:
        verdict = "pays" if qc.pays else f"below the {qc.min_gain:.0%} bar: not built"
        lines.append(f"query-chunked core attention: {qc.reach_gain:+.1%} reach on this layout "
                     f"({qc.saving_per_token:,.0f} of {qc.slope:,.0f} B/token); {verdict}")
    lines += [
             "baselines (what runs without megatron-flat), each at its own best layout, at "
             f"{format_tokens(res.seq_len)}:",
             f"  {'baseline':22s}{'layout':28s}{'step peak':>11s}{'fits':>6s}{'max context':>13s}"
             f"{'host/GPU':>12s}{'predicted step':>16s}"]

    def row(label: str, run: RunAt) -> str:
        if run.report is None:
            return f"  {label:22s}{layout_text(run.layout):28s}not run here: {run.why}"
        step = format_seconds(run.step_s) if run.step_s is not None else "n/a"
        return (f"  {label:22s}{layout_text(run.layout):28s}{format_bytes(run.report.total):>11s}"
                f"{yes[res.fits(run.report)]:>6s}{_tokens(run.reach):>13s}"
                f"{format_bytes(run.report.host_per_device):>12s}{step:>16s}")

    nowhere = []
    for name, run in res.runs.items():
        lines.append(row(name, run))
        if not run.at_best:
            nowhere.append(name)
    if nowhere:
        lines.append(f"  ({', '.join(nowhere)}: fits no length at any layout; shown on this "
                     "layout)")
    if res.paper is not None:
        lines.append(f"  {PAPER_LABEL}:")
        lines.append(row(PAPER_BASELINE, res.paper))
        if res.paper.sequences != res.global_batch:
            lines.append(f"  (DP {res.paper.layout.dp}: its predicted step trains "
                         f"{res.paper.sequences} sequences)")
    strongest, ratio = s.strongest(), s.ratio()
    if strongest is not None:
        text = (f"flat reaches {ratio:.2f}x its context, each at its own best layout"
                if ratio is not None else "no baseline fits at any length")
        lines.append(f"  strongest: {strongest}; {text}")
    for pub in published_beside(res):
        step = pub["measured_step_s"]
        lines.append(f"  published run at this length and GPU count ({pub['id']}, "
                     f"{layout_text(Layout(**pub['layout']))}; --json: its source):")
        lines.append(
            f"    measured {pub['measured_peak_bytes'] / 1e9:.1f} GB"
            + (f", {step:,} s a step" if step else "")
            + f"; predicted as fsdp2-cp {pub['predicted_peak_bytes'] / 1e9:.1f} GB, "
            f"{format_seconds(pub['predicted_step_s'])}; megatron-flat on this layout "
            f"{pub['flat_peak_bytes'] / 1e9:.1f} GB, {format_seconds(pub['flat_step_s'])} "
            f"(predicted{'' if pub['flat_fits'] else ', does not fit'}; compare prediction "
            "with prediction)")
    return lines


def render_table(res: PlanResult) -> str:
    lay, base, r = res.layout, res.baseline, res.flat_report
    chosen = f" (chose {', '.join(res.chosen)}: {_chose_why(res)})" if res.chosen else ""
    host = res.host_bytes
    seq_note = "" if res.seq_asked else ", flat's max context on this layout"
    lines = [
        f"megatron-flat plan: {res.model.name} - {res.model.describe()}",
        f"layout: {lay.describe()}{chosen}",
        f"sequence: {format_tokens(res.seq_len)} = {res.seq_len:,} tokens{seq_note} "
        f"({base.tokens:,} per CP rank, {base.tokens_sp:,} per TP rank); routing skew "
        f"{res.skew:g}",
        f"device: {format_bytes(res.device_bytes)}, usable {format_bytes(res.budget)}; host: "
        + (f"{format_bytes(host)} per node of {min(lay.gpus_per_node, lay.gpus)} GPUs"
           if host else "not limited"),
        f"baseline: {res.baseline_name} ({DESCRIPTIONS[res.baseline_name]}), on this layout",
        "",
        f"{'peak per GPU':34s}{'baseline':>14s}{'flat':>14s}",
    ]
    times = predict_units(res)
    sums: Dict[str, List[float]] = {}
    for u, pair in times.items():
        row = sums.setdefault(UNIT_ROWS[u], [0.0, 0.0])
        row[0] += pair["baseline"].total_s
        row[1] += pair["flat"].total_s
    by_row = {row: _cost(base_s, flat_s) for row, (base_s, flat_s) in sums.items()}
    lines[-1] += f"   predicted time cost ({res.device})"
    bc, fc = base.components(), r.components()
    dense = not res.model.experts
    for name in COMPONENTS + ("total",):
        if name == "dispatch" and dense:  # a dense model has no MoE layer to dispatch
            lines.append(f"  {ROW_LABELS[name]:32s}{'none':>14s}{'none':>14s}"
                         "   dense model: no experts, no dispatch (PipelinedLLEP and param "
                         "offload do not apply)")
            continue
        lines.append(f"  {ROW_LABELS[name]:32s}{format_bytes(bc[name]):>14s}"
                     f"{format_bytes(fc[name]):>14s}"
                     + (f"   {by_row[name]}" if name in by_row else ""))
    yes = {True: "yes", False: "NO"}
    flat_fits = res.error is None and res.fits(r)
    lines.append(f"  {'fits':32s}{yes[res.fits(base)]:>14s}{yes[flat_fits]:>14s}")
    lines.append(f"  {'binding term':32s}{base.binding:>14s}{r.binding:>14s}")
    lines.append(f"  {'host memory per node':32s}{format_bytes(base.host_per_node):>14s}"
                 f"{format_bytes(r.host_per_node):>14s}"
                 + (f"  (of {format_bytes(host)})" if host else ""))
    lines.append("")
    if res.error is not None:
        lines.append("knobs (flat at its smallest-memory setting, which does not fit):")
    elif res.all_on:
        lines.append("knobs (flat: every technique at its smallest-memory setting):")
    else:
        lines.append("knobs (flat: the fewest techniques that fit, at their cheapest settings):")
    lines += ["  " + s for s in _knob_summary(r, res.flat, res.attn_replay_why)]
    flags = flat_flags(res.flat)
    if flags:
        lines.append("  flags: " + flags)
    lines.append("")
    lines += _layouts_section(res)
    lines.append("")
    lines += _baselines_section(res)
    if not res.reach.baselines.get(res.baseline_name) and base.optimizer > res.budget:
        lines.append(f"  ({res.baseline_name} on this layout: the optimizer/model state alone, "
                     f"{format_bytes(base.optimizer)}, exceeds the usable "
                     f"{format_bytes(res.budget)})")
    lines.append("step peak = optimizer/model state + boundaries + max(dispatch + other, vocab)")
    lines += ["", f"predicted time on {res.device} (a model of counted FLOPs, bytes, syncs and "
                  "launches, not a measurement;", "  per microbatch on the worst stage, the "
                  "optimizer per step):",
              f"  {'unit':36s}{'baseline':>12s}{'flat':>12s}   cost, what binds (flat)"]
    for unit in UNITS:
        pair = times[unit]
        if unit == "parameters" and not any(p.total_s for p in pair.values()):
            continue  # only FSDP2 gathers parameters
        if unit == "dispatch" and dense:
            continue  # no MoE layers
        lines.append(f"  {UNIT_LABELS[unit]:36s}{format_seconds(pair['baseline'].total_s):>12s}"
                     f"{format_seconds(pair['flat'].total_s):>12s}   "
                     f"{_cost(pair['baseline'].total_s, pair['flat'].total_s)}, "
                     f"{_binds(pair['flat'])}")
    step = {v: step_seconds(times, v, res.microbatches, lay.pp) for v in ("baseline", "flat")}
    label = f"step ({res.microbatches} microbatch{'es' if res.microbatches != 1 else ''})"
    lines.append(f"  {label:36s}{format_seconds(step['baseline']):>12s}"
                 f"{format_seconds(step['flat']):>12s}   "
                 f"{_cost(step['baseline'], step['flat'])}")
    saving = res.replay_saving(times)
    if saving is not None:
        lines.append(f"  {'of which attention replay':36s}{'':12s}"
                     f"{'-' + format_seconds(saving['saved_s']):>12s}   flat without it "
                     f"{format_seconds(saving['step_s_without'])} "
                     f"({-saving['saved_s'] / saving['step_s_without']:+.0%}): one core-"
                     "attention forward per layer less")
    if res.error:
        lines += ["", "does not fit: " + res.error]
    return "\n".join(lines)


def fewest(args: argparse.Namespace) -> dict:
    """``--fewest-gpus``: the JSON object (``layouts.fewest_gpus`` for every run)."""
    if args.seq is None:
        raise PlanError("--fewest-gpus needs --seq (the sequence length to train)")
    if args.emit_launch:
        raise PlanError("--fewest-gpus prints no launch line; drop --emit-launch")
    model = load_model(args.model)
    seq = parse_tokens(args.seq)
    device = parse_bytes(args.gpu_mem)
    host = parse_bytes(args.host_mem) if args.host_mem is not None else None
    allow = tuple(t for t in KNOBS if t not in set(args.without))
    found = fewest_gpus(model, seq, device, host, gpus_per_node=args.gpus_per_node,
                        micro_batch_size=args.micro_batch_size, allow=allow,
                        margin=args.margin, host_margin=HOST_MARGIN, skew=args.skew)
    return {"model": model.name, "seq_len": seq, "device_bytes": device, "host_bytes": host,
            "gpus_per_node": args.gpus_per_node, "gpu_counts": list(GPU_COUNTS),
            "fewest_gpus": {run: f.as_dict() for run, f in found.items()}}


def render_fewest(out: dict) -> str:
    host = format_bytes(out["host_bytes"]) if out["host_bytes"] else "not limited"
    lines = [f"fewest GPUs for {format_tokens(out['seq_len'])} tokens of {out['model']} "
             f"({format_bytes(out['device_bytes'])} per GPU, host {host} per node of "
             f"{out['gpus_per_node']}; tried {', '.join(map(str, out['gpu_counts']))}):"]
    labels = {"flat": "megatron-flat", WITHOUT_PARAM_OFFLOAD: "megatron-flat, no param offload"}
    for run, row in out["fewest_gpus"].items():
        where = (f"{row['gpus']:>5d}   {layout_text(Layout(**{k: row[k] for k in LAYOUT_KEYS}))}"
                 if row["gpus"] else f"{'none':>5s}   fits on none of them")
        lines.append(f"  {labels.get(run, run):33s}{where}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None, prog: str = "python -m megatron_flat plan") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.fewest_gpus:
        try:
            out = fewest(args)
        except PlanError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        print(json.dumps(out, indent=2) if args.json else render_fewest(out))
        return 0
    try:
        out = plan(args)
        if args.emit_launch:
            if out.error:
                raise PlanError(f"--emit-launch: the plan does not fit ({out.error}); no "
                                "launch line")
            groups = launch_groups_of(out)
    except PlanError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if args.emit_launch:
        if args.json:
            print(json.dumps({**out.to_json(), "launch": launch.launch_args(groups)}, indent=2))
        else:
            lay = out.layout
            print(launch.render(groups, gpus=lay.gpus, gpus_per_node=lay.gpus_per_node,
                                comment=f"{out.model.name} at {format_tokens(out.seq_len)} "
                                        f"tokens per sequence on {lay.gpus} {out.device} "
                                        "(python -m megatron_flat plan)"))
        return 0
    if args.json:
        print(json.dumps(out.to_json(), indent=2))
    else:
        print(render_table(out))
    return 0


def launch_groups_of(res: PlanResult) -> List[launch.Group]:
    """The plan's ``pretrain_gpt.py`` arguments (``plan.launch``)."""
    return launch.launch_groups(res.model, res.layout, seq_len=res.seq_len,
                                global_batch=res.global_batch, flat=res.flat,
                                flat_flags=flat_flags(res.flat))
