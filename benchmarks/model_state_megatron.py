"""The sixth peak on a Megatron model: what the trainer holds on the device between steps,
against depth, flat with and without param offload (architecture.md §2.7).

For each depth (``--layers``, default 4 8 16) the tiny MoE GPT (Megatron-Core on CPU, EP 2
over 2 ranks, the dense part DP 2, the distributed optimizer, full recompute, grouped-GEMM
experts, ``--microbatches`` microbatches of gradient accumulation per step) trains
``--steps`` steps twice from the same weights, with the other four techniques on
(PipelinedLLEP, Ring-DTP, SCO, OffloadStreamAdamW) and param offload off, then on. Per run,
one JSON row (each figure the worst rank's):

* ``device_model_state_bytes``: what the trainer holds on the device between steps, counted
  from its model, DDP and optimizer (``testing.training.trainer_state_bytes``: weights, gradient
  buffers, optimizer state on the device, param offload's slots); ``host_model_state_bytes``
  the host-tier bytes beside them (optimizer state, param offload's host tier);
* ``step_peak_bytes``: the memory meter's whole-step rise over the steps (the demo's "whole
  step": above the model and its gradients);
* ``h2d_bytes``, ``d2h_bytes``, ``syncs``: the cost ledger's counts over the steps (every
  host-tier copy: SCO's boundaries, OffloadStreamAdamW's buckets, param offload's fetches and
  drains; pinned and non-blocking copies count no sync);
* ``bitwise``: every loss and every parameter after the steps equal (``torch.equal``) to
  the run without param offload.

With param offload every MoE layer's routed experts leave the device but two layers' slots;
what is left grows with depth only by each layer's dense weights and gradients (attention,
norms, router), which Megatron keeps where it puts them. ``dense_per_layer_bytes`` is that
growth per layer, measured with the knob on. Run (2 ranks)::

    torchrun --nproc-per-node 2 benchmarks/model_state_megatron.py \\
        --json results/model_state_megatron.json

On CPU the "device" is CPU memory the meter counts and the copies are inline; this proves the
bound and the exactness, not speed (``benchmarks/model_state.py --device cuda`` times it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig
from megatron_flat.runtime import CostLedger, MemoryMeter, memory
from megatron_flat.testing.distributed import init_distributed, megatron_layout
from megatron_flat.testing.equivalence import full_tensors, load_full
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer, trainer_state_bytes

LAYOUT = Layout(ep=2, distributed_optimizer=True, recompute="full")
# The four on, sized to this model: chunks of 32 routed tokens, strips of 128 vocabulary
# rows, every boundary in a host budget of 64 MiB, buckets of 16K elements through 2 slots.
FOUR = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=32, dispatch_max_chunks=64,
                  vocab=True, vocab_block_size=128, sco=True, sco_host_budget_gib=1 / 16,
                  optimizer_offload=True, optimizer_bucket_numel=16_384,
                  optimizer_num_slots=2)


def model_for(args, layers: int) -> TinyMoE:
    """Experts hold most parameters, as in the models param offload is for."""
    return TinyMoE(num_layers=layers, hidden_size=args.hidden, num_attention_heads=4,
                   ffn_hidden_size=args.hidden * 2, num_experts=args.experts, topk=2,
                   moe_ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                   seq_length=args.seq, micro_batch_size=1,
                   global_batch_size=2 * args.microbatches, data="zipf", grouped_gemm=True,
                   attention="flash")


def _worst(values) -> list:
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run(tiny: TinyMoE, flat: FlatConfig, steps: int, init=None) -> dict:
    """One run: the figures of the module docstring, the losses, the weights after it and
    (``init`` None) the initial weights."""
    with megatron_layout(LAYOUT.tp, LAYOUT.ep, LAYOUT.pp, seed=tiny.seed):
        load = None if init is None else (lambda model: load_full([model], init))
        trainer = Trainer(tiny, LAYOUT, lr=1e-3, flat=flat, init=load)
        initial = full_tensors([trainer.model]) if init is None else init
        trainer.warm_up()
        losses = []
        with MemoryMeter() as meter, CostLedger() as ledger:
            for step in range(steps):
                losses.append(trainer.forward_backward(step))
                trainer.optimizer_step()
        state, host = trainer_state_bytes(trainer)
        worst = _worst([state, host, meter.peak_rise_bytes, ledger.h2d_bytes,
                        ledger.d2h_bytes, ledger.syncs])
        final = full_tensors([trainer.model])
        del trainer
    keys = ("device_model_state_bytes", "host_model_state_bytes", "step_peak_bytes",
            "h2d_bytes", "d2h_bytes", "syncs")
    return {"row": dict(zip(keys, worst)), "losses": losses, "final": final,
            "initial": initial}


def _equal(a: dict, b: dict) -> bool:
    return (a["losses"] == b["losses"] and a["final"].keys() == b["final"].keys()
            and all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"]))


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=512, help="each routed expert's FFN size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=2, help="per rank and step")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    init_distributed()
    from megatron_flat.cpu.backend import enable_cpu_backend

    enable_cpu_backend()
    rank = dist.get_rank()
    rows = []
    if rank == 0:
        print(f"{'layers':>6} {'offload':>7} {'model state':>12} {'host':>12} "
              f"{'step peak':>12} {'h2d':>12} {'d2h':>12} {'syncs':>5} {'bitwise':>7} "
              f"{'ratio':>6}")
    for layers in args.layers:
        tiny = model_for(args, layers)
        off = run(tiny, FOUR, args.steps)
        on = run(tiny, dataclasses.replace(FOUR, param_offload=True), args.steps,
                 init=off["initial"])
        bitwise = _equal(off, on)
        for flag, result in ((False, off), (True, on)):
            row = {"layers": layers, "param_offload": flag, **result["row"],
                   "bitwise": bitwise,
                   "model_state_ratio": result["row"]["device_model_state_bytes"]
                   / off["row"]["device_model_state_bytes"]}
            rows.append(row)
            if rank == 0:
                f = memory.format_bytes
                print(f"{layers:>6} {str(flag):>7} {f(row['device_model_state_bytes']):>12} "
                      f"{f(row['host_model_state_bytes']):>12} "
                      f"{f(row['step_peak_bytes']):>12} {f(row['h2d_bytes']):>12} "
                      f"{f(row['d2h_bytes']):>12} {row['syncs']:>5} {str(bitwise):>7} "
                      f"{row['model_state_ratio']:>6.3f}", flush=True)
    summary = _summary(rows, args.layers)
    if rank == 0:
        lo, hi = min(args.layers), max(args.layers)
        print(f"from {lo} to {hi} layers the device model state grows "
              f"{summary['growth_without']:.1%} without param offload and "
              f"{summary['growth_with']:.1%} with it: per added layer "
              f"{memory.format_bytes(summary['per_layer_without'])} without, "
              f"{memory.format_bytes(summary['per_layer_with'])} with (the layer's dense "
              "weights and gradients, which stay on the device)")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                model = {**vars(model_for(args, lo)), "num_layers": args.layers}
                json.dump({"rows": rows, **summary, "model": model, "layout": LAYOUT.name,
                           "flat": FOUR.to_dict()}, f, indent=1, default=str)
    return rows


def _summary(rows: list, layers: list) -> dict:
    lo, hi = min(layers), max(layers)

    def state(n, flag):
        return next(r["device_model_state_bytes"] for r in rows
                    if r["layers"] == n and r["param_offload"] == flag)
    out = {}
    for flag, name in ((False, "without"), (True, "with")):
        out[f"growth_{name}"] = state(hi, flag) / state(lo, flag) - 1
        out[f"per_layer_{name}"] = (state(hi, flag) - state(lo, flag)) // max(hi - lo, 1)
    out["dense_per_layer_bytes"] = out["per_layer_with"]
    return out


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
