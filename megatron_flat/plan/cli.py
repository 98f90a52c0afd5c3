"""``python -m megatron_flat plan``: will this run fit, and with which knobs?

Prints each peak per device without and with megatron-flat, the term that binds, the knobs
``fit`` chose (and the ``--flat-*`` flags that set them) and the longest context that fits;
next to each flattened peak, the predicted time cost of those knobs on ``--device`` (the
step-time model of ``plan.time`` over the per-layer counts of ``plan.costs``, scaled to the
model's layers on the worst stage); ``--json`` prints the same as one JSON object.

"Without megatron-flat" is a baseline (``plan.baselines``): stock Megatron, Megatron's
optimizer CPU offload, or FSDP2 with CPU offload. Every baseline the layout allows is
evaluated (peak, host bytes, reach, predicted step); ``--baseline`` picks the one the table
compares with, by default the strongest: the one reaching the longest context.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_flat.config import FlatConfig
from megatron_flat.plan.fit import (
    TECHNIQUE_NAMES,
    DoesNotFit,
    Reach,
    enabled,
    fit,
    host_budget_per_device,
    max_context,
    tightest_report,
)
from megatron_flat.plan.model import (
    PAPER_GPUS,
    Layout,
    ModelSpec,
    PlanError,
    default_layout,
    load_model,
)
from megatron_flat.plan.baselines import BASELINES, DESCRIPTIONS, allowed
from megatron_flat.plan.costs import UNITS, unit_costs
from megatron_flat.plan.peaks import COMPONENTS, DEFAULT_SKEW, PeakReport, estimate, usable
from megatron_flat.plan.time import DEVICES, Prediction, format_seconds, predict
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


def build_parser(prog: str = "python -m megatron_flat plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Predict the four memory peaks of a long-context MoE step, with and "
                    "without megatron-flat; name the binding term, choose the knobs, find the "
                    "longest context that fits.",
        epilog="Sizes: tokens take K/M (binary: 1M = 1,048,576); memory takes KiB/MiB/GiB/TiB "
               "(binary) or KB/MB/GB/TB (decimal). The step peak is optimizer/model state + "
               "boundaries + max(dispatch + other, vocab).")
    p.add_argument("--model", required=True,
                   help="preset (paper-120b, paper-241b, paper-667b, gpt-oss-20b, gpt-oss-120b, "
                        "DeepSeek-V3, Qwen3-30B-A3B) or a Hugging Face config.json path")
    p.add_argument("--seq", required=True, help="sequence length, e.g. 1M or 131072")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPU count (default for the paper presets: 16, 32, 64)")
    p.add_argument("--gpu-mem", required=True, help="memory per GPU, e.g. 141GiB or 80GB")
    p.add_argument("--host-mem", default=None,
                   help="host memory per node, e.g. 2TiB (default: pinned host not limited)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing a host (default 8)")
    for dim, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline"), ("cp", "context")):
        p.add_argument(f"--{dim}", type=int, default=None,
                       help=f"{what}-parallel size (default: chosen for the GPU count)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--skew", type=float, default=DEFAULT_SKEW,
                   help=f"routing skew, max/mean routes per EP rank (default {DEFAULT_SKEW})")
    p.add_argument("--margin", type=float, default=0.1,
                   help="fraction of GPU memory kept free (default 0.1)")
    p.add_argument("--all-on", action="store_true",
                   help="flat column: all four techniques at their smallest-memory settings "
                        "(default: the fewest techniques that fit, at their cheapest settings)")
    p.add_argument("--device", default="H200", choices=sorted(DEVICES),
                   help="GPU the step-time model predicts for (default H200)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step on each GPU (global batch / (micro-batch "
                        "size x DP)), for the predicted step time (default 1)")
    p.add_argument("--baseline", default="auto", choices=("auto",) + BASELINES,
                   help="what the flat column is compared with: megatron (stock), "
                        "megatron-cpu-offload (--optimizer-cpu-offload), fsdp2-offload; "
                        "default auto: the strongest the layout allows (longest context)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


# Which peak row each unit's time cost sits next to, and what one unit is.
UNIT_ROWS = {"dispatch": "dispatch", "vocab": "vocab", "boundaries": "boundaries",
             "optimizer": "optimizer", "parameters": "optimizer"}
UNIT_LABELS = {
    "dispatch": "MoE layers (experts + all-to-all)",
    "vocab": "projection + loss",
    "boundaries": "attention + SCO copies",
    "optimizer": "optimizer step (per step)",
    "parameters": "parameter gathers (FSDP2)",
}


def step_seconds(times: Dict[str, Dict[str, Prediction]], variant: str,
                 microbatches: int) -> float:
    """Predicted step: every unit once per microbatch, the optimizer once per step (units
    are disjoint: experts in dispatch, attention in boundaries, the output layer in vocab;
    norms, embeddings and the pipeline schedule are left out)."""
    per_mb = sum(times[u][variant].total_s for u in UNITS if u != "optimizer")
    return microbatches * per_mb + times["optimizer"][variant].total_s


def predict_units(res: "PlanResult", baseline: Optional[PeakReport] = None
                  ) -> Dict[str, Dict[str, Prediction]]:
    """Predicted time of each unit, baseline and flat, on ``res.device`` (per microbatch on
    the worst stage; the optimizer per step). ``baseline``: another baseline's report in
    place of the table's."""
    out: Dict[str, Dict[str, Prediction]] = {}
    for variant, report, flat in (("baseline", baseline or res.baseline, None),
                                  ("flat", res.flat_report, res.flat)):
        for unit, (counts, overlap) in unit_costs(res.model, res.layout, report, flat).items():
            out.setdefault(unit, {})[variant] = predict(counts, overlap, res.device)
    return out


def _cost(base: float, flat: float) -> str:
    """The flat run's extra predicted seconds over the baseline's, for tables."""
    delta = flat - base
    if abs(delta) < 5e-7:
        return "+0"
    sign = "+" if delta > 0 else "-"
    ratio = flat / base if base else float("inf")
    rel = f" ({delta / base:+.0%})" if ratio < 10 else f" (x{ratio:.0f})" if base else ""
    return f"{sign}{format_seconds(abs(delta))}{rel}"


def _knob_summary(report: PeakReport, flat: FlatConfig) -> List[str]:
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
        lines.append(f"{TECHNIQUE_NAMES['sco']}: host budget {flat.sco_host_budget_gib:.3f} GiB "
                     f"per GPU ({report.boundaries_offloaded} of {report.boundaries_held} "
                     f"boundaries of {format_bytes(report.boundary_bytes)} on host), prefetch "
                     f"{flat.sco_prefetch}")
    if flat.optimizer_offload:
        lines.append(f"{TECHNIQUE_NAMES['optimizer_offload']}: bucket "
                     f"{flat.optimizer_bucket_numel:,} params x {flat.optimizer_num_slots} "
                     f"slot{'s' if flat.optimizer_num_slots != 1 else ''} "
                     f"({format_bytes(report.optimizer_device)} staging, "
                     f"{format_bytes(report.optimizer_host)} pinned host per GPU)")
    return lines or ["none needed: the baseline fits"]


def flat_flags(flat: FlatConfig) -> str:
    """The ``--flat-*`` flags that reproduce ``flat`` (enabled techniques' knobs only)."""
    groups = {
        "dispatch": ("dispatch_chunk_tokens", "dispatch_max_chunks"),
        "vocab": ("vocab_mode",),
        "sco": ("sco_host_budget_gib", "sco_prefetch"),
        "optimizer_offload": ("optimizer_bucket_numel", "optimizer_num_slots"),
    }
    out = []
    for switch, knobs in groups.items():
        if not enabled(flat, switch):
            continue
        if switch == "dispatch":
            out.append(f"--flat-dispatch {flat.dispatch}")
            if flat.dispatch != "pipelined":
                continue  # chunk knobs only matter when chunking
        else:
            out.append("--flat-" + switch.replace("_", "-"))
        for knob in knobs:
            value = getattr(flat, knob)
            value = format(value, ".6g") if isinstance(value, float) else value
            out.append(f"--flat-{knob.replace('_', '-')} {value}")
    return " ".join(out)


@dataclass
class PlanResult:
    """Everything the CLI prints (``to_json`` is the ``--json`` object)."""

    model: ModelSpec
    layout: Layout
    chosen: List[str]        # layout sizes the planner chose (not given)
    seq_len: int
    skew: float
    device_bytes: int
    budget: int              # usable device bytes
    host_bytes: Optional[int]  # per node; None: not limited
    baseline: PeakReport     # the baseline the table compares with (``baseline_name``)
    flat_report: PeakReport
    flat: FlatConfig
    reach: Reach
    error: Optional[str]     # why nothing fits (flat_report is then the smallest setting)
    all_on: bool = False     # flat = every technique at its smallest-memory setting
    device: str = "H200"     # what the step-time model predicts for
    microbatches: int = 1    # per step on each GPU, for the predicted step time
    baseline_name: str = "megatron"
    # every baseline: its report at seq_len (None when the layout cannot run it) and why not
    baselines: Dict[str, Optional[PeakReport]] = field(default_factory=dict)
    not_allowed: Dict[str, str] = field(default_factory=dict)

    @property
    def strongest(self) -> Optional[str]:
        return self.reach.strongest()

    def baseline_step_s(self, name: str) -> float:
        """Predicted step seconds of baseline ``name`` (as ``step_seconds``)."""
        times = predict_units(self, self.baselines[name])
        return step_seconds(times, "baseline", self.microbatches)

    def fits(self, report: PeakReport) -> bool:
        """The criterion ``fit`` uses: total within the usable device bytes, pinned host
        need within the node's memory less ``HOST_MARGIN``, shared by its GPUs."""
        host = host_budget_per_device(self.layout, self.host_bytes, HOST_MARGIN)
        return report.total <= self.budget and (host is None or report.host_per_device <= host)

    def to_json(self) -> dict:
        lay, flat, r = self.layout, self.flat, self.flat_report
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
                       "gpus_per_node": lay.gpus_per_node, "chosen": self.chosen},
            "seq_len": self.seq_len,
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
            "max_context": {"baseline": self.reach.baselines.get(self.baseline_name, 0),
                            "flat": self.reach.flat},
            "max_context_granularity": self.reach.granularity,
            "baseline_name": self.baseline_name,
            "baselines": {
                name: ({"total": rep.total, "fits": self.fits(rep),
                        "max_context": self.reach.baselines.get(name, 0),
                        "host_bytes": rep.host_per_device,
                        "host_pinned_bytes": rep.host_pinned,
                        "predicted_step_s": self.baseline_step_s(name),
                        "describes": DESCRIPTIONS[name]}
                       if rep is not None else {"allowed": False,
                                                "why": self.not_allowed[name]})
                for name, rep in self.baselines.items()},
            "strongest_baseline": self.strongest,
            "reach_ratio": self.reach.ratio(),
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
            "step_s": {v: step_seconds(times, v, self.microbatches)
                       for v in ("baseline", "flat")},
        }
        if self.error:
            out["error"] = self.error
        return out


def plan(args: argparse.Namespace) -> PlanResult:
    """Evaluate everything the CLI prints."""
    model = load_model(args.model)
    seq = parse_tokens(args.seq)
    device = parse_bytes(args.gpu_mem)
    host = parse_bytes(args.host_mem) if args.host_mem is not None else None
    if args.microbatches < 1:
        raise PlanError(f"--microbatches must be >= 1, got {args.microbatches}")
    gpus = args.gpus if args.gpus is not None else PAPER_GPUS.get(model.name)
    if gpus is None:
        raise PlanError(f"give --gpus for {model.name} (only the paper presets have a default)")
    given = {d: getattr(args, d) for d in ("tp", "ep", "pp", "cp")}
    layout = default_layout(model, gpus, gpus_per_node=args.gpus_per_node,
                            micro_batch_size=args.micro_batch_size, **given)
    chosen = [d.upper() for d, v in given.items() if v is None]
    kw = dict(margin=args.margin, host_margin=HOST_MARGIN, skew=args.skew)
    error = None
    if args.all_on:
        flat_report = tightest_report(model, layout, seq, host, host_margin=HOST_MARGIN,
                                      skew=args.skew)
        flat = flat_report.flat or FlatConfig()
    else:
        try:
            result = fit(model, layout, seq, device, host, **kw)
            flat_report, flat = result.report, result.flat
        except DoesNotFit as err:
            error = str(err)
            flat_report = err.best
            flat = flat_report.flat or FlatConfig()
    reach = max_context(model, layout, device, host, **kw)
    reports: Dict[str, Optional[PeakReport]] = {}
    not_allowed: Dict[str, str] = {}
    for name in BASELINES:
        why = allowed(name, layout)
        if why:
            reports[name], not_allowed[name] = None, why
        else:
            reports[name] = estimate(model, layout, seq, None, skew=args.skew, baseline=name)
    name = args.baseline
    if name == "auto":
        name = reach.strongest() or "megatron"
    elif reports.get(name) is None:
        raise PlanError(f"--baseline {name}: {not_allowed[name]}")
    return PlanResult(model=model, layout=layout, chosen=chosen, seq_len=seq, skew=args.skew,
                      device_bytes=device, budget=usable(device, args.margin), host_bytes=host,
                      baseline=reports[name], flat_report=flat_report, flat=flat, reach=reach,
                      error=error, all_on=args.all_on, device=device_model(args.device).name,
                      microbatches=args.microbatches, baseline_name=name, baselines=reports,
                      not_allowed=not_allowed)


def _binds(p: Prediction) -> str:
    parts = {"compute": p.compute_s, "exposed transfers": p.exposed_comm_s + p.exposed_copy_s,
             "sync stalls and host planning": p.stall_s}
    if p.launch_bound:
        parts["launches"] = parts.pop("compute")
    return max(parts, key=parts.get) if any(parts.values()) else "nothing"


def render_table(res: PlanResult) -> str:
    lay, base, r = res.layout, res.baseline, res.flat_report
    chosen = f" (chose {', '.join(res.chosen)} for {lay.gpus} GPUs)" if res.chosen else ""
    host = res.host_bytes
    lines = [
        f"megatron-flat plan: {res.model.name} - {res.model.describe()}",
        f"layout: {lay.describe()}{chosen}",
        f"sequence: {format_tokens(res.seq_len)} = {res.seq_len:,} tokens ({base.tokens:,} per "
        f"CP rank, {base.tokens_sp:,} per TP rank); routing skew {res.skew:g}",
        f"device: {format_bytes(res.device_bytes)}, usable {format_bytes(res.budget)}; host: "
        + (f"{format_bytes(host)} per node of {min(lay.gpus_per_node, lay.gpus)} GPUs"
           if host else "not limited"),
        f"baseline: {res.baseline_name} ({DESCRIPTIONS[res.baseline_name]})",
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
    for name in COMPONENTS + ("total",):
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
    lines += ["  " + s for s in _knob_summary(r, res.flat)]
    flags = flat_flags(res.flat)
    if flags:
        lines.append("  flags: " + flags)
    mc = res.reach

    def tokens(n: int) -> str:
        return format_tokens(n) if n else "none"

    lines.append(f"max context: flat {tokens(mc.flat)} (multiples of {mc.granularity:,} "
                 "tokens); baselines (what runs without megatron-flat):")
    lines.append(f"  {'baseline':22s}{'step peak':>12s}{'fits':>6s}{'max context':>13s}"
                 f"{'host/GPU':>12s}{'predicted step':>16s}")
    for name, rep in res.baselines.items():
        if rep is None:
            lines.append(f"  {name:22s}not for this layout: {res.not_allowed[name]}")
            continue
        lines.append(f"  {name:22s}{format_bytes(rep.total):>12s}{yes[res.fits(rep)]:>6s}"
                     f"{tokens(mc.baselines.get(name, 0)):>13s}"
                     f"{format_bytes(rep.host_per_device):>12s}"
                     f"{format_seconds(res.baseline_step_s(name)):>16s}")
    best, ratio = res.strongest, mc.ratio()
    if best is not None:
        reach_text = (f"flat reaches {ratio:.2f}x its context" if ratio is not None
                      else "no baseline fits at any length")
        lines.append(f"  strongest: {best}; {reach_text}")
    if not mc.baselines.get(res.baseline_name) and base.optimizer > res.budget:
        lines.append(f"  ({res.baseline_name}: the optimizer/model state alone, "
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
        lines.append(f"  {UNIT_LABELS[unit]:36s}{format_seconds(pair['baseline'].total_s):>12s}"
                     f"{format_seconds(pair['flat'].total_s):>12s}   "
                     f"{_cost(pair['baseline'].total_s, pair['flat'].total_s)}, "
                     f"{_binds(pair['flat'])}")
    step = {v: step_seconds(times, v, res.microbatches) for v in ("baseline", "flat")}
    label = f"step ({res.microbatches} microbatch{'es' if res.microbatches != 1 else ''})"
    lines.append(f"  {label:36s}{format_seconds(step['baseline']):>12s}"
                 f"{format_seconds(step['flat']):>12s}   "
                 f"{_cost(step['baseline'], step['flat'])}")
    if res.error:
        lines += ["", "does not fit: " + res.error]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None, prog: str = "python -m megatron_flat plan") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        out = plan(args)
    except PlanError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out.to_json(), indent=2))
    else:
        print(render_table(out))
    return 0
