"""Ledger counts, measured time and predicted time of each technique on one device.

Single process, no Megatron needed (the GPU image may lack megatron-core): each technique's
plain-PyTorch entry point against the reference it replaces, forward + backward (or one
step), at a GPU shape:

  moe        PipelinedLLEP at EP = 1 (K chunks, recompute per chunk) vs the dense
             reference MoE (``testing.moe_reference.dense_moe``); no all-to-all at EP = 1
  vocab      Ring-DTP blocked on one device vs dense cross-entropy (logits N x V)
  sco        SelectiveCheckpointOffload vs torch checkpoint over a residual MLP stack
  optimizer  OffloadStreamAdamW vs torch.optim.AdamW, one step

Per (unit, variant) it records the CostLedger's counts (on CUDA with
``cuda_sync_check=True``: ``cuda_sync_warnings`` from ``torch.cuda.set_sync_debug_mode``
beside the ledger's ``syncs``), the measured time (CUDA events, median of ``--reps``), the
step-time model's predicted time for the device (``plan.time``; "predicted"), and on CUDA
a ``torch.profiler`` summary of the variant: how much of the host<->device copy time ran
while a compute kernel was running (``copy_overlap``), the question SCO and
OffloadStreamAdamW's schedules answer.

    python benchmarks/gpu_ledger.py --json OUT/ledger-gpu.json            # on a GPU
    python benchmarks/gpu_ledger.py --device cpu --tiny --json /tmp/x.json  # dry run

On CPU (``--device cpu``) the counts follow the ledger's device-data rule, the profiler
summary is skipped and times are CPU times (not comparable with the prediction).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron_flat.checkpoint import SelectiveCheckpointOffload
from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.testing.moe_reference import dense_moe
from megatron_flat.dispatch.schedule import routes_from_topk
from megatron_flat.optim import OffloadStreamAdamW
from megatron_flat.plan.time import overlap_for, predict
from megatron_flat.runtime.ledger import CostLedger, format_count, sync_mismatches
from megatron_flat.runtime.memory import MemoryMeter, format_bytes
from megatron_flat.vocab import ring_dtp_cross_entropy

SHAPES = {
    # GPU shape: a few seconds per unit on an H200
    "gpu": dict(tokens=16384, hidden=2048, ffn=1024, experts=16, topk=4, chunk=2048,
                vocab=65536, vocab_block=8192, layers=8, params_m=256, bucket=16_000_000),
    # dry run on CPU
    "tiny": dict(tokens=256, hidden=64, ffn=64, experts=4, topk=2, chunk=64,
                 vocab=1024, vocab_block=256, layers=3, params_m=1, bucket=100_000),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Unit:
    """One variant of one unit: ``run()`` is the measured work; ``stages`` its pipeline."""

    def __init__(self, name: str, variant: str, run: Callable[[], None], stages: int = 1):
        self.name, self.variant, self.run, self.stages = name, variant, run, stages


def moe_units(s: dict, device: torch.device, dtype: torch.dtype) -> list[Unit]:
    g = torch.Generator().manual_seed(0)
    bank = GLUExperts(s["experts"], s["hidden"], s["ffn"], dtype=dtype, device=device,
                      generator=g)
    x = (torch.randn(s["tokens"], s["hidden"], generator=g) * 0.1).to(device, dtype)
    x.requires_grad_(True)
    scores = torch.randn(s["tokens"], s["experts"], generator=g).to(device)
    probs, ids = scores.softmax(-1).topk(s["topk"], dim=-1)
    route_token, route_expert, order = routes_from_topk(ids)
    route_probs = probs.flatten()[order].to(dtype)
    options = DispatchOptions(chunk_tokens=s["chunk"], max_chunks=64)
    engine = PipelinedLLEP(bank, num_experts=s["experts"], topk=s["topk"], options=options)
    k = -(-s["tokens"] // s["chunk"])

    def stock() -> None:
        dense_moe(bank, x, route_token, route_expert, route_probs).sum().backward()

    def flat() -> None:
        engine(x, route_token, route_expert, route_probs).sum().backward()

    return [Unit("moe", "stock", stock), Unit("moe", "flat", flat, k)]


def vocab_units(s: dict, device: torch.device, dtype: torch.dtype) -> list[Unit]:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(s["tokens"], s["hidden"], generator=g) * 0.1).to(device, dtype)
    w = (torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02).to(device, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    labels = torch.randint(0, s["vocab"], (s["tokens"],), generator=g).to(device)

    def stock() -> None:
        F.cross_entropy((x @ w.t()).float(), labels).backward()

    def flat() -> None:
        ring_dtp_cross_entropy(x, w, labels, block_size=s["vocab_block"]).mean().backward()

    return [Unit("vocab", "stock", stock),
            Unit("vocab", "flat", flat, -(-s["vocab"] // s["vocab_block"]))]


class _Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def sco_units(s: dict, device: torch.device, dtype: torch.dtype) -> list[Unit]:
    torch.manual_seed(2)
    blocks = torch.nn.ModuleList(_Block(s["hidden"]) for _ in range(s["layers"]))
    blocks.to(device, dtype)
    x = torch.randn(s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    boundary = x.numel() * x.element_size()
    sco = SelectiveCheckpointOffload(boundary * (s["layers"] + 1), prefetch=1, device=device)

    def run(ck: Callable) -> None:
        h = x
        for block in blocks:
            h = ck(block, h)
        h.float().square().mean().backward()

    def stock() -> None:
        run(lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False))

    def flat() -> None:
        run(sco.checkpoint)

    return [Unit("sco", "stock", stock), Unit("sco", "flat", flat, s["layers"])]


def optimizer_units(s: dict, device: torch.device, dtype: torch.dtype) -> list[Unit]:
    rows = 4096 if s["params_m"] >= 16 else 256
    n = max(1, s["params_m"] * (1 << 20) // (rows * rows))
    torch.manual_seed(3)

    def params() -> list[torch.nn.Parameter]:
        out = []
        for _ in range(n):
            p = torch.nn.Parameter(torch.randn(rows, rows, device=device, dtype=dtype) * 0.02)
            p.grad = torch.randn_like(p) * 1e-3
            out.append(p)
        return out

    stock_opt = torch.optim.AdamW(params(), lr=1e-4)
    flat_params = params()
    flat_opt = OffloadStreamAdamW(flat_params, lr=1e-4, bucket_numel=s["bucket"], num_slots=2)
    buckets = -(-(n * rows * rows) // s["bucket"])
    return [Unit("optimizer", "stock", stock_opt.step),
            Unit("optimizer", "flat", flat_opt.step, buckets)]


BUILDERS = {"moe": moe_units, "vocab": vocab_units, "sco": sco_units,
            "optimizer": optimizer_units}


def copy_overlap(run: Callable[[], None], device: torch.device) -> Optional[dict]:
    """Profile one run; the fraction of memcpy time spent while a compute kernel ran."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync(device)
    copies, kernels = [], []
    for evt in prof.events():
        if getattr(evt, "device_type", None) is None or str(evt.device_type) != "DeviceType.CUDA":
            continue
        span = (evt.time_range.start, evt.time_range.end)
        name = evt.name.lower()
        (copies if "memcpy" in name else kernels).append(span)
    kernels.sort()
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in copies)
    hidden = 0.0
    for a, b in copies:
        for c, d in merged:
            if d <= a:
                continue
            if c >= b:
                break
            hidden += min(b, d) - max(a, c)
    return {"copy_us": total, "copy_under_compute_us": hidden,
            "copy_overlap": hidden / total if total else None,
            "kernel_busy_us": sum(b - a for a, b in merged)}


def measure(unit: Unit, device: torch.device, reps: int) -> dict:
    # Warm-up inside a throwaway ledger: lazily built plans, pools and optimizer state are
    # not counted, and what they made keeps its origin (host or device data) for the count.
    with CostLedger():
        unit.run()
        _sync(device)
    with MemoryMeter(device) as meter:
        unit.run()
        _sync(device)
    with CostLedger(cuda_sync_check=device.type == "cuda") as ledger:
        unit.run()
        _sync(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        unit.run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    counts = ledger.as_dict()
    counts.pop("sections", None)
    overlap = overlap_for(unit.name, unit.variant, unit.stages)
    pred = predict(counts, overlap, "H200")
    record = {"unit": unit.name, "variant": unit.variant, "device": str(device),
              "stages": unit.stages, **counts, "peak_device_bytes": meter.peak_device_bytes,
              "peak_host_bytes": meter.peak_host_bytes,
              "measured_s": statistics.median(times), "predicted_s": pred.total_s,
              "prediction": pred.as_dict(), "profile": copy_overlap(unit.run, device)}
    return record


def render(records: list[dict]) -> str:
    head = (f"{'unit':10s}{'variant':8s}{'FLOPs':>10s}{'h2d':>10s}{'d2h':>10s}{'syncs':>7s}"
            f"{'cuda':>6s}{'ops':>8s}{'peak':>12s}{'measured':>11s}{'predicted':>11s}"
            f"{'overlap':>9s}")
    lines = [head]
    for r in records:
        ov = (r["profile"] or {}).get("copy_overlap")
        lines.append(
            f"{r['unit']:10s}{r['variant']:8s}{format_count(r['flops']):>10s}"
            f"{format_bytes(r['h2d_bytes']):>10s}{format_bytes(r['d2h_bytes']):>10s}"
            f"{r['syncs']:>7d}{str(r.get('cuda_sync_warnings', '-')):>6s}{r['ops']:>8d}"
            f"{format_bytes(r['peak_device_bytes']):>12s}{r['measured_s'] * 1e3:>9.2f}ms"
            f"{r['predicted_s'] * 1e3:>9.2f}ms{'' if ov is None else f'{ov:.0%}':>9s}")
    lines.append("predicted: the step-time model for an H200 (plan.time), not a measurement; "
                 "cuda: set_sync_debug_mode warnings; overlap: memcpy time under a kernel")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="dry-run shapes (CPU)")
    p.add_argument("--units", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--check-syncs", action="store_true",
                   help="on CUDA, exit 1 unless every unit's flagged syncs (the ledger) equal "
                        "set_sync_debug_mode's warnings (a CPU run has nothing to compare)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    shape = SHAPES["tiny" if args.tiny or device.type == "cpu" else "gpu"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    records = []
    for name in args.units:
        for unit in BUILDERS[name](shape, device, dtype):
            records.append(measure(unit, device, args.reps))
            print(f"  {unit.name}/{unit.variant}: done", file=sys.stderr, flush=True)
    print(render(records))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "device": str(device), "records": records}, f, indent=1)
    if args.check_syncs:
        return check_syncs(records, device)
    return 0


def check_syncs(records: list[dict], device: torch.device) -> int:
    """1 when a unit's ledger disagrees with CUDA's sync-debug mode (each one named)."""
    if device.type != "cuda":
        print("--check-syncs: no CUDA counts on this device; nothing compared")
        return 0
    bad = sync_mismatches({f"{r['unit']}/{r['variant']}": r for r in records})
    for line in bad:
        print(f"SYNC MISMATCH {line}")
    print(f"--check-syncs: {len(records) - len(bad)} of {len(records)} units agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
