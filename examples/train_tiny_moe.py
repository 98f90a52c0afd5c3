"""The main job: a small MoE GPT trained with Megatron-Core on CPU, stock and with the four
megatron-flat techniques and param offload on, from the same weights; measures each peak
both ways, and the model state the trainer holds between steps.

Run with ``make demo`` (2 ranks, gloo) or directly::

    torchrun --standalone --nproc-per-node 2 examples/train_tiny_moe.py --steps 6 \\
        --json results/demo.json --timeline results/demo_timeline.png \\
        --sweep 256 512 1024 2048 4096 --sweep-plot results/demo_sweep.png

One definition of **peak** throughout (the table, the timeline and the sweep): the most
device bytes live at once, above the bytes live when the measured part began — for a
component, its own start (so it is what the component adds); for the whole step, the
lowest level before it, i.e. the model and its gradient buffers (the optimizer state the
first step allocates counts in every later step) — on the worst rank, over the steps run.
The timeline plots live device bytes above that level, so its maximum is the whole-step
peak; boundaries are the bytes held from forward to backward (live at the decoder's exit
above its entry).

The context sweep (``--sweep``) trains two steps stock and two flat at each sequence length
from the same weights and plots every peak against tokens: measured as solid lines, the
planner's prediction for the same layout (``megatron_flat.plan.estimate``, in the same
definitions: ``PeakReport.sections``) dashed.

``--tp 2`` runs TP 2 with sequence parallelism × EP 2 (experts' TP 1, DP 1) and adds the
attention tiles (the fifth technique, ``--flat-attn-tiles``, 128 tokens unless given) to
the flat run; its sweep also trains the flat run without the tiles, adds the attention
block's panel, and prints each run's whole-step slope in bytes per token.

Layout: EP=2 (DP=2 for the dense part; ``--cp 2``: CP 2, DP 1), full recompute, Megatron's
distributed optimizer, grouped-GEMM experts (``--no-moe-grouped-gemm``: SequentialMLP),
synthetic zipf tokens. The baseline is stock Megatron; the flat run turns on PipelinedLLEP
(chunk-capped expert dispatch), Ring-DTP (the vocabulary projection + loss in strips), SCO
(checkpoint boundaries in the pinned host pool), OffloadStreamAdamW (AdamW moments in host
memory, streamed in buckets) and param offload (the routed experts' weights and fp32 gradients
in the host tier, two layers' slots on the device). Any ``--flat-*`` flag overrides the demo's
settings (e.g. ``--no-flat-sco``). Prints one line per step for each run, then per component
the worst rank's peak (device bytes above the live set when the component starts; boundaries as
the bytes held from forward to backward) for both runs, the pinned host bytes the flat run used
instead, the model state each trainer holds between steps ("model state": weights, gradient
buffers, optimizer state on the device, param offload's slots), the loss agreement, and writes
a memory-timeline PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from megatron_flat.config import FlatConfig, add_flat_args
from megatron_flat.cpu.backend import enable_cpu_backend
from megatron_flat.runtime.memory import format_bytes
from megatron_flat.testing.distributed import init_distributed, megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer, measure

DEMO_MODEL = TinyMoE(
    attention="flash",  # O(N) attention, as on a GPU (cpu.flash_attention)
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    ffn_hidden_size=256,
    num_experts=8,
    topk=2,
    moe_ffn_hidden_size=128,
    vocab_size=8192,
    seq_length=512,
    micro_batch_size=1,
    global_batch_size=4,
    data="zipf",
)

# The demo is the paper's model shrunk by hidden 7168 -> 128. Ring-DTP's token tile shrinks as
# benchmarks/vocab.py shrinks it: its tokens and its strip's width both divide by the scale,
# its bytes by the scale squared (128 MiB -> 42 KiB, 10 tokens of a 1024-row fp32 strip).
# Unscaled, one 128 MiB tile would hold every token of every sweep point, and the vocabulary
# line would grow with context as whole strips do instead of staying flat.
DEMO_SCALE = 7168 / 128
DEMO_VOCAB_TILE_BYTES = int(FlatConfig().vocab_tile_bytes / DEMO_SCALE**2)

# All four on and param offload, sized to the demo model: 1024 routed tokens per rank and
# layer go out in chunks of at most 128 per source; the 8192-entry vocabulary is folded in
# strips of 1024 (the ring has one rank at TP=1) and token tiles of DEMO_VOCAB_TILE_BYTES;
# the boundaries' host budget holds every layer's input; the optimizer streams buckets of
# 64K elements through 2 slots; param offload keeps the routed experts' state in the host
# tier.
DEMO_FLAT = FlatConfig(
    dispatch="pipelined", dispatch_chunk_tokens=128, dispatch_max_chunks=16,
    vocab=True, vocab_mode="auto", vocab_block_size=1024,
    vocab_tile_bytes=DEMO_VOCAB_TILE_BYTES,
    sco=True, sco_host_budget_gib=0.03125, sco_prefetch=1,
    optimizer_offload=True, optimizer_bucket_numel=65_536, optimizer_num_slots=2,
    param_offload=True,
)
LAYOUT = Layout(ep=2, distributed_optimizer=True, recompute="full")
DEMO_ATTN_TILE = 128  # tokens per attention tile with --tp 2 (4 tiles at the default 512)


def layout_for(args) -> Layout:
    """The demo's layout with ``--cp`` context parallelism (CP 2 at 2 ranks: DP 1, each rank
    holds two load-balanced chunks of every sequence, the experts' EP 2 spans the CP peers,
    and the distributed optimizer shards over the data- × context-parallel group)."""
    import dataclasses

    tp = getattr(args, "tp", 1)
    return dataclasses.replace(LAYOUT, cp=getattr(args, "cp", 1), tp=tp,
                               etp=1 if tp > 1 else None)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-length", type=int, default=DEMO_MODEL.seq_length)
    p.add_argument("--cp", type=int, default=1, choices=(1, 2),
                   help="context-parallel size (2: the sequence split over both ranks, "
                        "attention through the CPU backend's ContextParallelCoreAttention)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2),
                   help="tensor-parallel size (2: TP 2 with sequence parallelism x EP 2, "
                        "and the attention tiles in the flat run)")
    p.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=True,
                   help="grouped-GEMM experts in both runs, as most Megatron MoE runs use "
                        "(GroupedMLP on 0.16, TEGroupedMLP on 0.19; on CPU through the "
                        "reference grouped GEMM); --no-moe-grouped-gemm: SequentialMLP")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--json", default=None, help="write the measured peaks here")
    p.add_argument("--timeline", default="results/demo_timeline.png",
                   help="memory-timeline PNG of rank 0 (empty to skip)")
    p.add_argument("--sweep", type=int, nargs="*", default=[],
                   help="sequence lengths of the context sweep (two steps each, stock and "
                        "flat; none: no sweep)")
    p.add_argument("--sweep-plot", default="results/demo_sweep.png",
                   help="the sweep's PNG (one panel per peak and one for the whole step)")
    add_flat_args(p)
    p.set_defaults(**{"flat_" + k: v for k, v in DEMO_FLAT.to_dict().items()})
    args = p.parse_args()
    if args.tp > 1 and args.cp > 1:
        p.error("--tp 2 and --cp 2 need 4 ranks; the demo runs on 2: give one")
    if args.tp > 1 and not any(a.startswith("--flat-attn-tiles") for a in sys.argv):
        args.flat_attn_tiles = DEMO_ATTN_TILE
    return args


def run(tiny, flat, args, rank, label, init=None, quiet=False, model_state=False):
    """Train one run under the meter; returns (PeakReport, losses, initial full weights).
    ``model_state``: also meter what the trainer holds between steps (the ``"model state"``
    row: the storages its model and optimizer reach)."""
    from megatron_flat.testing.equivalence import full_tensors, load_full
    from megatron_flat.testing.training import record_model_state

    losses = []

    def report(step: int, loss: float, seconds: float) -> None:
        # No wall time: a CPU's step time is per-op overhead (the flat run's chunked ops
        # multiply it) and says nothing of a GPU's; docs/costs.md has what the ledger
        # predicts there.
        losses.append(loss)
        if rank == 0 and not quiet:
            print(f"{label:8s} step {step + 1:3d} | loss {loss:.6f}", flush=True)

    layout = layout_for(args)
    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed, etp=layout.etp,
                         cp=layout.cp):
        load = None if init is None else (lambda model: load_full([model], init))
        trainer = Trainer(tiny, layout, lr=args.lr, flat=flat, init=load)
        initial = full_tensors([trainer.model])
        peaks = measure(trainer, args.steps, on_step=report, timeline=bool(args.timeline))
        if model_state:
            record_model_state(peaks, trainer)  # what the trainer holds between steps
        trainer.release()  # the next run's meter starts from what this one leaves: nothing
        del trainer
    return peaks, losses, initial


PEAK_DEFINITION = ("peak: the most device bytes live at once, above those live when the "
                   "measured part began (a component: its own start; the whole step: the "
                   "model and its gradients, so the optimizer state counts), worst rank, any "
                   "step; boundaries: bytes held from forward to backward")


def print_table(base, flat, tiles: bool = False) -> None:
    from megatron_flat.megatron.peaks import ATTENTION, BOUNDARIES, COMPONENTS
    from megatron_flat.testing.training import MODEL_STATE

    print(f"\nmeasured peaks (MemoryMeter); {PEAK_DEFINITION}")
    print(f"{'component':34s} {'baseline':>11s} {'flat':>11s} {'flat/base':>10s} "
          f"{'pinned host (flat)':>19s}")
    # The attention block (the fifth term) where the flat run tiles it (--tp 2).
    extra = [ATTENTION] if tiles else []
    state = [MODEL_STATE] if MODEL_STATE in base.device and MODEL_STATE in flat.device else []
    for name in list(COMPONENTS) + extra + state + ["step"]:
        label = {"step": "whole step (total peak)", MODEL_STATE: "model state (between steps)",
                 BOUNDARIES: BOUNDARIES + " (held)"}.get(name, name)
        b, f = base.device[name], flat.device[name]
        ratio = f"{f / b:9.1%}" if b else "      n/a"
        print(f"{label:34s} {format_bytes(b):>11s} {format_bytes(f):>11s} {ratio:>10s} "
              f"{format_bytes(flat.host[name]):>19s}")


def plot_timeline(path, base, flat, title="tiny MoE GPT, EP=2, rank 0") -> None:
    """Device memory over time of rank 0, both runs (max per pixel column, so peaks show)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for samples, label in ((base.timeline, "baseline (stock Megatron)"),
                           (flat.timeline, "megatron-flat (all four on)")):
        if not samples:
            continue
        t, b = _envelope(samples, 2000)
        floor = _floor_before_peak(samples)
        ax.plot(t, [(x - floor) / 2**20 for x in b], label=label, linewidth=0.8)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("live device MiB above the run's low\n(its maximum: the whole-step peak)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _floor_before_peak(samples) -> int:
    """The lowest live level before the highest one (the whole-step peak's reference)."""
    top = max(range(len(samples)), key=lambda i: samples[i][1])
    return min(v for _, v in samples[:top + 1])


def _envelope(samples, columns):
    """Down-sample ``(t, bytes)`` samples to at most ``columns`` points, keeping each
    column's maximum."""
    step = max(1, len(samples) // columns)
    times, values = [], []
    for i in range(0, len(samples), step):
        chunk = samples[i:i + step]
        times.append(chunk[0][0])
        values.append(max(v for _, v in chunk))
    return times, values


# The sweep's panels: (meter section, title).
SWEEP_PANELS = (("expert dispatch", "expert dispatch"),
                ("vocabulary projection + loss", "vocabulary projection + loss"),
                ("checkpoint boundaries", "checkpoint boundaries (held)"),
                ("optimizer step", "optimizer step"),
                ("step", "whole step"))
ATTENTION_PANEL = ("attention block", "attention block")  # with the tiles (--tp 2)
# The sweep's runs: (key, colour, label). The third only when the flat run has the tiles.
SWEEP_RUNS = (("stock", "tab:red", "stock Megatron"),
              ("flat", "tab:blue", "megatron-flat"),
              ("flat_without_tiles", "tab:green", "megatron-flat without attention tiles"))


def sweep_panels(points):
    with_tiles = any("flat_without_tiles" in p["measured"] for p in points)
    return SWEEP_PANELS[:4] + ((ATTENTION_PANEL,) if with_tiles else ()) + SWEEP_PANELS[4:]


def sweep_runs(points):
    return [r for r in SWEEP_RUNS if all(r[0] in p["measured"] for p in points)]


def slopes(points, kind: str = "measured"):
    """Whole-step bytes per token from the first to the last sweep point, per run."""
    first, last = points[0], points[-1]
    span = last["seq"] - first["seq"]
    return {run: (last[kind][run]["step"] - first[kind][run]["step"]) / span
            for run, _, _ in sweep_runs(points)}


def planner_layout(cp: int = 1, tp: int = 1):
    """The demo's layout as the planner sees it: 2 ranks, EP 2 (DP 2 / CP / TP for the dense
    part: CP ``cp``, TP ``tp`` with sequence parallelism), distributed optimizer, fp32
    gradients, Megatron's unfused CPU path, nothing overlapping."""
    from megatron_flat.plan import Layout as PlanLayout

    return PlanLayout(ep=2, cp=cp, tp=tp, dp=2 // (cp * tp), distributed_optimizer=True,
                      fused_kernels=False, overlap=False)


def flat_for_sweep(flat, sweep_lengths):
    """The demo's FlatConfig with chunks that stay at ``dispatch_chunk_tokens`` over the
    whole sweep (enough chunks allowed for the longest sequence: each rank routes its own
    sequence, micro-batch 1)."""
    import dataclasses
    import math

    if flat.dispatch != "pipelined" or not sweep_lengths:
        return flat
    need = math.ceil(max(sweep_lengths) / flat.dispatch_chunk_tokens)
    return dataclasses.replace(flat, dispatch_max_chunks=max(flat.dispatch_max_chunks, need))


def sweep(tiny, flat, args, rank):
    """Two steps stock and two flat per sequence length (and two flat without the attention
    tiles, when they are on); measured and predicted peaks."""
    import dataclasses

    from megatron_flat.plan import estimate
    from megatron_flat.testing.equivalence import RTOL

    # Two steps: the second carries the optimizer state the first allocated.
    one = argparse.Namespace(**{**vars(args), "steps": 2, "timeline": ""})
    spec = tiny.planner_spec()
    points = []
    for seq in args.sweep:
        model = tiny.with_(seq_length=seq)
        base, base_losses, initial = run(model, None, one, rank, f"s={seq}", quiet=True)
        on, flat_losses, _ = run(model, flat, one, rank, f"s={seq}", init=initial, quiet=True)
        configs = [("stock", None), ("flat", flat)]
        measured = {"stock": base.device, "flat": on.device}
        diffs = [flat_losses]
        if flat.attn_tiles:
            untiled = dataclasses.replace(flat, attn_tiles=0)
            off, off_losses, _ = run(model, untiled, one, rank, f"s={seq}", init=initial,
                                     quiet=True)
            configs.append(("flat_without_tiles", untiled))
            measured["flat_without_tiles"] = off.device
            diffs.append(off_losses)
        layout = planner_layout(getattr(args, "cp", 1), getattr(args, "tp", 1))
        predicted = {name: estimate(spec, layout, seq, cfg).sections for name, cfg in configs}
        diff = max(abs(a - b) / abs(b) for losses in diffs
                   for a, b in zip(losses, base_losses))
        points.append({"seq": seq, "measured": measured,
                       "predicted": predicted, "flat_host": on.host,
                       "loss_rel_diff": diff, "losses_equal": diff <= RTOL})
        if rank == 0:
            b, f = base.device, on.device
            extra = ""
            if "flat_without_tiles" in measured:
                extra = (f", {format_bytes(measured['flat_without_tiles']['step']):>11s} flat "
                         "without tiles")
            print(f"sweep s={seq:5d}: whole step {format_bytes(b['step']):>11s} stock, "
                  f"{format_bytes(f['step']):>11s} flat ({f['step'] / b['step']:.0%}){extra}; "
                  f"losses {'equal' if diff <= RTOL else 'NOT EQUAL'}", flush=True)
    return points


def print_sweep(points) -> None:
    print(f"\ncontext sweep, measured (planner); {PEAK_DEFINITION}")
    runs = sweep_runs(points)
    head = f"{'tokens':>7s}  {'peak':30s}" + "".join(f"{key:>26s}" for key, _, _ in runs)
    print(head + f"{'flat/stock':>11s}")
    for p in points:
        for name, title in sweep_panels(points):
            cells = [f"{format_bytes(p['measured'][key][name])} "
                     f"({format_bytes(p['predicted'][key][name])})" for key, _, _ in runs]
            stock = p["measured"]["stock"][name]
            ratio = f"{p['measured']['flat'][name] / stock:10.0%}" if stock else "       n/a"
            print(f"{p['seq']:7d}  {title:30s}" + "".join(f"{c:>26s}" for c in cells)
                  + f"{ratio:>11s}")
    if len(points) > 1:
        got, planned = slopes(points), slopes(points, "predicted")
        print(f"whole-step slope, s={points[0]['seq']} to {points[-1]['seq']}, bytes per token "
              "(planner): " + ", ".join(f"{key} {got[key]:,.0f} ({planned[key]:,.0f})"
                                        for key, _, _ in runs))


def plot_sweep(path, points, title) -> None:
    """One panel per peak and one for the whole step: measured solid, planned dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [p["seq"] for p in points]
    panels = sweep_panels(points)
    cols = (len(panels) + 2) // 2  # the panels and the legend's, on two rows
    fig, grid = plt.subplots(2, cols, figsize=(4.4 * cols, 7.5))
    axes, spare = list(grid.flat[:len(panels)]), grid.flat[-1]
    for extra in grid.flat[len(panels):-1]:
        extra.axis("off")
    styles = {key: (color, label) for key, color, label in sweep_runs(points)}
    for ax, (name, panel) in zip(axes, panels):
        for variant, (color, label) in styles.items():
            ax.plot(seqs, [p["measured"][variant][name] / 2**20 for p in points], "-o",
                    color=color, label=f"{label}, measured", markersize=3)
            ax.plot(seqs, [p["predicted"][variant][name] / 2**20 for p in points], "--",
                    color=color, label=f"{label}, planner", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("tokens per sequence")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in (axes[0], axes[cols]):
        ax.set_ylabel("peak device MiB\n(above the live set when it begins)")
    handles, labels = axes[0].get_legend_handles_labels()
    spare.axis("off")
    spare.legend(handles, labels, loc="center", fontsize=9,
                 title="solid: measured (MemoryMeter)\ndashed: planner (plan.estimate)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from megatron_flat.testing.equivalence import RTOL

    args = parse_args()
    flat = FlatConfig.from_args(args)
    init_distributed()
    enable_cpu_backend()
    tiny = DEMO_MODEL.with_(seq_length=args.seq_length, grouped_gemm=args.moe_grouped_gemm)
    rank = dist.get_rank()
    if rank == 0:
        print(f"megatron-flat demo: MoE GPT {tiny.num_layers} layers, hidden {tiny.hidden_size}, "
              f"{tiny.num_experts} experts top-{tiny.topk}, vocab {tiny.vocab_size}, "
              f"seq {tiny.seq_length}, {dist.get_world_size()} ranks ({layout_for(args).name})")
        print(f"flat run: {flat.describe()}\n", flush=True)
    base, base_losses, initial = run(tiny, None, args, rank, "baseline", model_state=True)
    on, flat_losses, _ = run(tiny, flat, args, rank, "flat", init=initial, model_state=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(flat_losses, base_losses))
    if rank == 0:
        print_table(base, on, tiles=bool(flat.attn_tiles))
    points = sweep(tiny, flat_for_sweep(flat, args.sweep), args, rank) if args.sweep else []
    if points:
        worst = max(worst, max(p["loss_rel_diff"] for p in points))
    if rank == 0:
        verdict = "equal" if worst <= RTOL else "NOT EQUAL"
        print(f"\nlosses over {args.steps} steps: {verdict} (largest relative difference "
              f"{worst:.2e}, tolerance {RTOL:g}: fp32 reductions reordered)")
        if args.timeline:
            plot_timeline(args.timeline, base, on, f"tiny MoE GPT, {layout_for(args).name}, "
                                                   "rank 0")
            print(f"memory timeline: {args.timeline}")
        if points:
            print_sweep(points)
            if args.sweep_plot:
                plot_sweep(args.sweep_plot, points,
                           f"MoE GPT ({tiny.num_layers} layers, hidden {tiny.hidden_size}, "
                           f"{tiny.num_experts} experts, vocab {tiny.vocab_size}), 2 ranks, "
                           f"EP 2{', CP 2' if args.cp == 2 else ''}"
                           f"{', TP 2 + SP' if args.tp == 2 else ''}, two steps per point: peak "
                           "by context, measured (solid) and planned (dashed)")
                print(f"context sweep: {args.sweep_plot}")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"model": tiny.__dict__, "layout": layout_for(args).name,
                           "flat": flat.to_dict(),
                           "baseline": base.device, "flat_device": on.device,
                           "flat_host": on.host, "baseline_losses": base_losses,
                           "flat_losses": flat_losses, "largest_loss_rel_diff": worst,
                           "peak_definition": PEAK_DEFINITION, "sweep": points},
                          f, indent=2, default=str)
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    if worst > RTOL:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
