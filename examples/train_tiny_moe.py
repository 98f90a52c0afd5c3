"""The main job: a small MoE GPT trained with Megatron-Core on CPU, stock and with all four
megatron-flat techniques on, from the same weights; measures each peak both ways.

Run with ``make demo`` (2 ranks, gloo) or directly::

    torchrun --standalone --nproc-per-node 2 examples/train_tiny_moe.py --steps 10 \\
        --json results/demo.json --timeline results/demo_timeline.png

Layout: EP=2 (DP=2 for the dense part), full recompute, Megatron's distributed optimizer,
grouped-GEMM experts (``--no-moe-grouped-gemm``: SequentialMLP), synthetic zipf tokens. The baseline is stock Megatron; the flat run turns on PipelinedLLEP
(chunk-capped expert dispatch), Ring-DTP (the vocabulary projection + loss in strips), SCO
(checkpoint boundaries in the pinned host pool) and OffloadStreamAdamW (AdamW moments in
host memory, streamed in buckets). Any ``--flat-*`` flag overrides the demo's settings
(e.g. ``--no-flat-sco``). Prints one line per step for each run, then per component the
worst rank's peak (device bytes above the live set when the component starts; boundaries
as the bytes held from forward to backward) for both runs, the pinned host bytes the flat
run used instead, the loss agreement, and writes a memory-timeline PNG.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from megatron_flat.config import FlatConfig, add_flat_args
from megatron_flat.megatron.cpu import enable_cpu_backend
from megatron_flat.runtime.memory import format_bytes
from megatron_flat.testing.distributed import init_distributed, megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer, measure

DEMO_MODEL = TinyMoE(
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

# All four on, sized to the demo model: 1024 routed tokens per rank and layer go out in
# chunks of at most 128 per source; the 8192-entry vocabulary is folded in strips of 1024
# (the ring has one rank at TP=1); the boundaries' host budget holds every layer's input;
# the optimizer streams buckets of 64K elements through 2 slots.
DEMO_FLAT = FlatConfig(
    dispatch="pipelined", dispatch_chunk_tokens=128, dispatch_max_chunks=16,
    vocab=True, vocab_mode="auto", vocab_block_size=1024,
    sco=True, sco_host_budget_gib=0.03125, sco_prefetch=1,
    optimizer_offload=True, optimizer_bucket_numel=65_536, optimizer_num_slots=2,
)
LAYOUT = Layout(ep=2, distributed_optimizer=True, recompute="full")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-length", type=int, default=DEMO_MODEL.seq_length)
    p.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=True,
                   help="grouped-GEMM experts in both runs, as most Megatron MoE runs use "
                        "(GroupedMLP on 0.16, TEGroupedMLP on 0.19; on CPU through the "
                        "reference grouped GEMM); --no-moe-grouped-gemm: SequentialMLP")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--json", default=None, help="write the measured peaks here")
    p.add_argument("--timeline", default="results/demo_timeline.png",
                   help="memory-timeline PNG of rank 0 (empty to skip)")
    add_flat_args(p)
    p.set_defaults(**{"flat_" + k: v for k, v in DEMO_FLAT.to_dict().items()})
    return p.parse_args()


def run(tiny, flat, args, rank, label, init=None):
    """Train one run under the meter; returns (PeakReport, losses, initial full weights)."""
    from megatron_flat.testing.equivalence import full_tensors, load_full

    losses = []

    def report(step: int, loss: float, seconds: float) -> None:
        losses.append(loss)
        if rank == 0:
            print(f"{label:8s} step {step + 1:3d} | loss {loss:.6f} | step time "
                  f"{seconds * 1e3:7.1f} ms", flush=True)

    with megatron_layout(LAYOUT.tp, LAYOUT.ep, LAYOUT.pp, seed=tiny.seed):
        load = None if init is None else (lambda model: load_full([model], init))
        trainer = Trainer(tiny, LAYOUT, lr=args.lr, flat=flat, init=load)
        initial = full_tensors([trainer.model])
        peaks = measure(trainer, args.steps, on_step=report, timeline=bool(args.timeline))
        del trainer
    return peaks, losses, initial


def print_table(base, flat) -> None:
    from megatron_flat.megatron.peaks import BOUNDARIES, COMPONENTS

    print("\nmeasured peaks (worst rank, MemoryMeter, bytes above the live set at entry)")
    print(f"{'component':34s} {'baseline':>11s} {'flat':>11s} {'flat/base':>10s} "
          f"{'pinned host (flat)':>19s}")
    for name in list(COMPONENTS) + ["step"]:
        label = {"step": "whole step (total peak)",
                 BOUNDARIES: BOUNDARIES + " (held)"}.get(name, name)
        b, f = base.device[name], flat.device[name]
        ratio = f"{f / b:9.1%}" if b else "      n/a"
        print(f"{label:34s} {format_bytes(b):>11s} {format_bytes(f):>11s} {ratio:>10s} "
              f"{format_bytes(flat.host[name]):>19s}")


def plot_timeline(path, base, flat) -> None:
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
        ax.plot(t, [x / 2**20 for x in b], label=label, linewidth=0.8)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("live device memory above start (MiB)")
    ax.set_title("tiny MoE GPT, EP=2, rank 0")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
              f"seq {tiny.seq_length}, {dist.get_world_size()} ranks ({LAYOUT.name})")
        print(f"flat run: {flat.describe()}\n", flush=True)
    base, base_losses, initial = run(tiny, None, args, rank, "baseline")
    on, flat_losses, _ = run(tiny, flat, args, rank, "flat", init=initial)
    worst = max(abs(a - b) / abs(b) for a, b in zip(flat_losses, base_losses))
    if rank == 0:
        print_table(base, on)
        verdict = "equal" if worst <= RTOL else "NOT EQUAL"
        print(f"\nlosses over {args.steps} steps: {verdict} (largest relative difference "
              f"{worst:.2e}, tolerance {RTOL:g}: fp32 reductions reordered)")
        if args.timeline:
            plot_timeline(args.timeline, base, on)
            print(f"memory timeline: {args.timeline}")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"model": tiny.__dict__, "layout": LAYOUT.name, "flat": flat.to_dict(),
                           "baseline": base.device, "flat_device": on.device,
                           "flat_host": on.host, "baseline_losses": base_losses,
                           "flat_losses": flat_losses, "largest_loss_rel_diff": worst},
                          f, indent=2, default=str)
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    if worst > RTOL:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
