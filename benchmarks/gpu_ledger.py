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
    python benchmarks/gpu_ledger.py --count-only --json OUT.json   # GPU shape's counts, CPU
    python benchmarks/gpu_ledger.py --recorded docs/gpu-runs/2026-12-04.json --json OUT.json

``--recorded`` also reads this script's own ``--json`` output, so a fresh GPU run's units are
re-predicted the same way (``--recorded OUT/ledger-gpu.json``).

``--count-only`` counts the GPU shape on CPU without running its matmuls (each returns zeros
of the shape it would make: the counts depend on shapes, and the units branch on no matmul
result), in bf16, with the kernels torch picks on CUDA (AdamW: foreach; OffloadStreamAdamW:
fused). ``--recorded FILE`` re-predicts a recorded run's units (their counts and measured
seconds, no GPU needed) with today's model: by the device's published constants (or a
calibrate run's, ``--calibration FILE``) and by constants fitted to the other units only
(leave-one-out, ``plan.calibration``).

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
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_flat.checkpoint import SelectiveCheckpointOffload
from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.testing.moe_reference import dense_moe
from megatron_flat.dispatch.schedule import routes_from_topk
from megatron_flat.optim import OffloadStreamAdamW
from megatron_flat.plan.calibration import calibrated_device, leave_one_out, predict_records
from megatron_flat.plan.time import DeviceModel, device as device_model, model_of, overlap_for
from megatron_flat.plan.time import predict
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
    # Each optimizer runs the kernel it picks on CUDA, on either device, so that a count on
    # CPU is the count of what a GPU runs: torch's AdamW foreach, OffloadStreamAdamW fused.
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

    stock_opt = torch.optim.AdamW(params(), lr=1e-4, foreach=True)
    flat_params = params()
    flat_opt = OffloadStreamAdamW(flat_params, lr=1e-4, bucket_numel=s["bucket"], num_slots=2,
                                  fused=True)
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


class ShapeOnlyMatmuls(TorchDispatchMode):
    """Matmuls return zeros of their result's shape without computing it (``--count-only``):
    the ledger, entered inside this mode, still sees each matmul with its real operands."""

    OPS = frozenset(getattr(torch.ops.aten, n).default
                    for n in ("mm", "bmm", "addmm", "baddbmm", "_grouped_mm")
                    if hasattr(torch.ops.aten, n))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func not in self.OPS:
            return func(*args, **kwargs)
        meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        out = func(*meta[0], **meta[1])
        return torch.zeros(out.shape, dtype=out.dtype, device=args[0].device)


def count(unit: Unit) -> dict:
    """``--count-only``: the unit's ledger counts (after a warm-up), matmuls not run."""
    with ShapeOnlyMatmuls():
        with CostLedger():
            unit.run()
        with CostLedger() as ledger:
            unit.run()
    counts = ledger.as_dict()
    counts.pop("sections", None)
    return {"unit": unit.name, "variant": unit.variant, "stages": unit.stages,
            "counts": counts}


def device_for_prediction(device: torch.device) -> str:
    """The device model a run is predicted for: the GPU's own when it is one we model."""
    return model_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else "H200"


def measure(unit: Unit, device: torch.device, reps: int,
            model: "DeviceModel | str" = "H200") -> dict:
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
    pred = predict(counts, overlap, model)
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
    p.add_argument("--count-only", action="store_true",
                   help="the GPU shape's counts on this machine, matmuls not run (no times)")
    p.add_argument("--recorded", metavar="FILE", default=None,
                   help="re-predict a recorded run's units (docs/gpu-runs/*.json); no GPU")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="device constants measured by benchmarks/gpu_calibrate.py")
    args = p.parse_args(argv)
    calibration = _load(args.calibration) if args.calibration else None
    if args.recorded:
        return recorded(args.recorded, calibration, args.json)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.count_only:
        records = [count(unit) for name in args.units
                   for unit in BUILDERS[name](SHAPES["gpu"], device, torch.bfloat16)]
        for r in records:
            c = r["counts"]
            print(f"{r['unit']}/{r['variant']}: {format_count(c['flops'])} FLOPs, "
                  f"{c['ops']} ops ({c['host_ops']} on host data), {c['syncs']} syncs")
        _write(args.json, {"shape": SHAPES["gpu"], "device": str(device), "count_only": True,
                           "records": records})
        return 0
    shape = SHAPES["tiny" if args.tiny or device.type == "cpu" else "gpu"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = device_for_prediction(device)
    if calibration is not None:
        model = calibrated_device(calibration, model)
    records = []
    for name in args.units:
        for unit in BUILDERS[name](shape, device, dtype):
            records.append(measure(unit, device, args.reps, model))
            print(f"  {unit.name}/{unit.variant}: done", file=sys.stderr, flush=True)
    print(render(records))
    _write(args.json, {"shape": shape, "device": str(device),
                       "device_model": model if isinstance(model, str) else model.name,
                       "records": records})
    if args.check_syncs:
        return check_syncs(records, device)
    return 0


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write(path: Optional[str], payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def repredict(run: dict, calibration: Optional[dict] = None) -> list[dict]:
    """A recorded run's units re-predicted: ``[{unit, variant, measured_s, predicted_s,
    ratio, predicted_then_s, held_out_s, held_out_ratio}]``. ``predicted_s``: today's model
    with the run's device constants (published, or ``calibration``'s); ``held_out_s``: with
    constants fitted to the run's other units only (leave-one-out)."""
    # a recorded file keeps each unit's counts apart; this script's own --json output (a
    # fresh GPU run) has them beside the measured time
    records = [r if "counts" in r else {**r, "counts": r} for r in run["records"]]
    base = device_model(run.get("device_model", "H200"))
    dev = calibrated_device(calibration, base) if calibration else base
    held = leave_one_out(records, base)
    rows = []
    for r, p, h in zip(records, predict_records(records, dev), held):
        m = float(r["measured_s"])
        rows.append({"unit": r["unit"], "variant": r["variant"], "measured_s": m,
                     "predicted_s": p, "ratio": m / p,
                     "predicted_then_s": r.get("predicted_then_s"),
                     "held_out_s": h["predicted_s"], "held_out_ratio": h["ratio"],
                     "held_out_constants": h["constants"]})
    return rows


def recorded(path: str, calibration: Optional[dict], out: Optional[str]) -> int:
    run = _load(path)
    rows = repredict(run, calibration)
    source = "calibrated" if calibration else "published"
    print(f"{'unit':10s}{'variant':8s}{'measured':>11s}{'then':>11s}{source:>12s}{'ratio':>7s}"
          f"{'held-out':>11s}{'ratio':>7s}")
    for r in rows:
        then = r["predicted_then_s"]
        print(f"{r['unit']:10s}{r['variant']:8s}{r['measured_s'] * 1e3:>9.2f}ms"
              f"{'-' if then is None else f'{then * 1e3:.2f}ms':>11s}"
              f"{r['predicted_s'] * 1e3:>10.2f}ms{r['ratio']:>7.2f}"
              f"{r['held_out_s'] * 1e3:>9.2f}ms{r['held_out_ratio']:>7.2f}")
    print(f"predicted for {run.get('device_model', 'H200')} ({source} constants); held-out: "
          "constants fitted to the other units only; ratio = measured / predicted")
    _write(out, {"recorded": path, "device_model": run.get("device_model", "H200"),
                 "constants": source, "units": rows})
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
