"""How each of the four peaks grows with sequence length, without megatron-flat.

Trains the demo's MoE GPT (EP=2, full recompute, distributed optimizer) for a few steps at
several sequence lengths and measures each component's peak with the MemoryMeter (worst
rank). The ratio columns are against the shortest sequence in the same run, so they show
the growth architecture.md §1 predicts: dispatch and boundaries ∝ N, vocabulary ∝ N·V, optimizer
flat in N. Run::

    torchrun --nproc-per-node 2 benchmarks/baseline_peaks.py --seq 256 512 1024 --json results/baseline_peaks.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from megatron_flat.cpu.backend import enable_cpu_backend
from megatron_flat.runtime.memory import format_bytes
from megatron_flat.testing.distributed import init_distributed, megatron_layout
from megatron_flat.testing.training import Layout, Trainer, measure_peaks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from train_tiny_moe import DEMO_MODEL  # noqa: E402  (one model definition for demo and bench)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    init_distributed()
    enable_cpu_backend()
    from megatron_flat.megatron.peaks import COMPONENTS

    layout = Layout(ep=2, distributed_optimizer=True, recompute="full")
    rows = {}
    for seq in args.seq:
        tiny = DEMO_MODEL.with_(seq_length=seq)
        with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed):
            rows[seq] = measure_peaks(Trainer(tiny, layout), args.steps)
    if dist.get_rank() == 0:
        base = args.seq[0]
        names = list(COMPONENTS) + ["step"]
        print(f"baseline peaks by sequence length (worst rank; ratio vs seq {base})")
        print(f"{'component':30s}" + "".join(f"{'seq ' + str(s):>22s}" for s in args.seq))
        for name in names:
            cells = []
            for s in args.seq:
                ratio = rows[s][name] / max(rows[base][name], 1)
                cells.append(f"{format_bytes(rows[s][name]):>12s} ({ratio:5.2f}x)")
            print(f"{name:30s}" + "".join(f"{c:>22s}" for c in cells))
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"layout": layout.name, "model": DEMO_MODEL.__dict__,
                           "peaks_by_seq": rows}, f, indent=2, default=str)
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
