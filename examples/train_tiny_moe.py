"""The main job: train a small MoE GPT with Megatron-Core on CPU and measure its peaks.

Run with ``make demo`` (2 ranks, gloo) or directly::

    torchrun --nproc-per-node 2 examples/train_tiny_moe.py --steps 20 --json results/demo.json

Layout: EP=2 (DP=2 for the dense part), full recompute, Megatron's distributed optimizer,
synthetic tokens. Prints one line per step, then the measured peak of each component
(the worst rank's, as bytes above the live set when the component starts). Only the
baseline column exists until the techniques land; each adds its "flat" column here.
"""

from __future__ import annotations

import argparse
import json
import os
import torch.distributed as dist

from megatron_flat.megatron.cpu import enable_cpu_backend
from megatron_flat.runtime.memory import format_bytes
from megatron_flat.testing.distributed import init_distributed, megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer, measure_peaks

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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-length", type=int, default=DEMO_MODEL.seq_length)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--json", default=None, help="write the measured peaks here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    init_distributed()
    enable_cpu_backend()
    from megatron_flat.megatron.peaks import BOUNDARIES, COMPONENTS

    tiny = DEMO_MODEL.with_(seq_length=args.seq_length)
    layout = Layout(ep=2, distributed_optimizer=True, recompute="full")
    rank = dist.get_rank()
    if rank == 0:
        print(f"megatron-flat demo: MoE GPT {tiny.num_layers} layers, hidden {tiny.hidden_size}, "
              f"{tiny.num_experts} experts top-{tiny.topk}, vocab {tiny.vocab_size}, "
              f"seq {tiny.seq_length}, {dist.get_world_size()} ranks ({layout.name})", flush=True)

    def report(step: int, loss: float, seconds: float) -> None:
        if rank == 0:
            print(f"step {step + 1:3d} | loss {loss:.4f} | step time {seconds * 1e3:7.1f} ms",
                  flush=True)

    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed):
        trainer = Trainer(tiny, layout, lr=args.lr)
        peaks = measure_peaks(trainer, args.steps, on_step=report)
    if rank == 0:
        step_peak = max(peaks["step"], 1)
        print("\nmeasured peaks (worst rank, MemoryMeter, bytes above the live set at entry)")
        print(f"{'component':34s} {'baseline':>12s} {'of step peak':>13s}")
        for name in COMPONENTS:
            label = name + (" (held)" if name == BOUNDARIES else "")
            print(f"{label:34s} {format_bytes(peaks[name]):>12s} {peaks[name] / step_peak:12.1%}")
        print(f"{'whole step':34s} {format_bytes(peaks['step']):>12s} {1:12.1%}")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"model": tiny.__dict__, "layout": layout.name,
                           "baseline": peaks}, f, indent=2, default=str)
            print(f"\nwrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
