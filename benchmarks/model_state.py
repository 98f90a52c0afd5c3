"""The sixth peak, model state: the device's expert weights and fp32 gradients against depth,
with and without param offload (architecture.md §2.7).

For each depth (``--layers``, default 4 8 16) one training step (``--microbatches``
microbatches of gradient accumulation, then an update of every weight) runs twice on the
same stack of expert layers (``megatron_flat.testing.expert_stack``: fixed routing, each
weight gradient added into an fp32 ``main_grad`` per row chunk, full recompute), with the
weights resident on the device and with :class:`~megatron_flat.params.ParamOffload`.
Per run, in one JSON row:

* ``device_model_state_bytes``: the memory meter's live device bytes after the step (what a
  step leaves on the device: weights, gradients, and for the offload its slots), above the
  level before the stack was built;
* ``step_peak_bytes``: the meter's peak over building the stack and the step;
* ``h2d_bytes``, ``d2h_bytes``, ``syncs``: the cost ledger's counts over the step;
* ``bitwise``: losses, input gradients, every ``main_grad`` and every updated weight equal
  to the resident run's (``torch.equal``).

With the offload the device model state must not grow with depth (two layers' slots); without
it, it grows linearly. The ratio column is offload / resident at the same depth. On CPU the
"device" is CPU memory counted by the meter and the copies are inline (the ledger still counts
them, pinned and non-blocking: no sync); this proves the bound and the exactness, not speed.
``--device cuda --repeats N`` (``benchmarks/gpu_check.sh``'s param-offload stage) adds each
variant's median ``step_seconds`` and, with the offload, ``copy_bytes_per_s`` (the larger
direction's bytes over the step: what the copies ran at beside the compute).

This stack is the offload's own harness; ``benchmarks/model_state_megatron.py`` has the same
figures for a Megatron MoE GPT through ``--flat-param-offload`` with the other four techniques
on (2 ranks). Run::

    python benchmarks/model_state.py --json results/model_state.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from megatron_flat.runtime import CostLedger, MemoryMeter, memory
from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.testing.expert_stack import ExpertStack, make_weights, train


def _stack(weights, offload: bool, device: str) -> ExpertStack:
    return ExpertStack(weights, offload=offload, checkpoint="non-reentrant",
                       tier=host_tiers.HostTier() if offload else None, device=device)


def _step_seconds(weights, batches, offload: bool, device: str, repeats: int) -> float:
    """Median wall time of one training step on CUDA (0.0 on CPU: no speed claim there)."""
    if device != "cuda" or repeats < 1:
        return 0.0
    stack = _stack(weights, offload, device)
    train(stack, batches, keep=False)  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        train(stack, batches, keep=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _run(weights, batches, offload: bool, device: str, repeats: int) -> dict:
    """The measured step (nothing kept), then the same step again for the bitwise check."""
    gc.collect()
    with MemoryMeter(device) as meter:
        stack = _stack(weights, offload, device)
        with CostLedger() as ledger:
            train(stack, batches, keep=False)
        state = meter.current_device_bytes()
    return {"result": train(_stack(weights, offload, device), batches),
            "step_seconds": _step_seconds(weights, batches, offload, device, repeats),
            "device_model_state_bytes": state,
            "step_peak_bytes": meter.peak_device_bytes, "h2d_bytes": ledger.h2d_bytes,
            "d2h_bytes": ledger.d2h_bytes, "syncs": ledger.syncs,
            "host_bytes": stack.offload.plan.host_bytes if offload else 0}


def _equal(a: dict, b: dict) -> bool:
    def same(x, y):
        return all(torch.equal(p, q) for p, q in zip(x, y))
    return (same(a["losses"], b["losses"]) and same(a["input_grads"], b["input_grads"])
            and all(same(p, q) for sa, sb in zip(a["main_grads"], b["main_grads"])
                    for p, q in zip(sa, sb))
            and all(same(p, q) for p, q in zip(a["weights"], b["weights"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=0,
                   help="CUDA: steps timed per variant (median; 0: no timing)")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(args.tokens, args.hidden, generator=g).to(dtype).to(args.device)
                for _ in range(args.microbatches)]]
    rows = []
    print(f"{'layers':>6} {'offload':>7} {'model state':>12} {'step peak':>12} {'h2d':>12} "
          f"{'d2h':>12} {'syncs':>5} {'bitwise':>7} {'ratio':>6}")
    for layers in args.layers:
        weights = make_weights(layers, args.hidden, args.ffn, args.experts, dtype)
        runs = {flag: _run(weights, batches, flag, args.device, args.repeats)
                for flag in (False, True)}
        bitwise = _equal(runs[False].pop("result"), runs[True].pop("result"))
        if runs[True]["step_seconds"]:
            runs[True]["copy_bytes_per_s"] = (max(runs[True]["h2d_bytes"], runs[True]["d2h_bytes"])
                                              / runs[True]["step_seconds"])
        for flag, run in runs.items():
            row = {"layers": layers, "param_offload": flag, **run, "bitwise": bitwise}
            ratio = run["device_model_state_bytes"] / runs[False]["device_model_state_bytes"]
            row["model_state_ratio"] = ratio
            rows.append(row)
            print(f"{layers:>6} {str(flag):>7} "
                  f"{memory.format_bytes(row['device_model_state_bytes']):>12} "
                  f"{memory.format_bytes(row['step_peak_bytes']):>12} "
                  f"{memory.format_bytes(row['h2d_bytes']):>12} "
                  f"{memory.format_bytes(row['d2h_bytes']):>12} {row['syncs']:>5} "
                  f"{str(bitwise):>7} {ratio:>6.3f}")
    on = [r["device_model_state_bytes"] for r in rows if r["param_offload"]]
    growth = max(on) / min(on) - 1
    print(f"with param offload the device model state varies by {growth:.1%} from "
          f"{min(args.layers)} to {max(args.layers)} layers (the bound: two layers' slots)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "offload_growth": growth, "dtype": args.dtype,
                       "microbatches": args.microbatches}, f, indent=1)


if __name__ == "__main__":
    main()
