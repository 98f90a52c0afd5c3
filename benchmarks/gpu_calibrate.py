"""Measure the step-time model's device constants with microbenchmarks (one GPU).

Each constant of :class:`megatron_flat.plan.time.DeviceModel` that a datasheet does not give
is measured here by one small benchmark, nothing fitted to the units it will predict:

  launch_s           host time per eager op: issue 2,000 small in-place adds, no sync
  api_call_s         host time per CUDA runtime call that launches nothing: 2,000 events
                     recorded and waited on (torch.cuda.Event, through torch's wrappers)
  sync_stall_s       one small op then ``torch.cuda.synchronize()``, less its launch
  kernel_floor_s     device time per tiny kernel (CUDA events around 2,000 of them; an
                     upper bound when the host issues slower than the GPU runs them)
  pcie_bytes_per_s   pinned 256 MiB copies, host to device and back (the slower one)
  matmul_efficiency  bf16 GEMMs at the ledger units' shapes, achieved / datasheet peak
                     (the median of the shapes that fill the SMs; every shape reported)
  hbm_efficiency     a 1 GiB device copy (2 GiB moved), achieved / datasheet bandwidth
  atomic16_per_s     index_add_ of 4,096 bf16 rows of 2,048 into 16,384 rows: adds per s
  atomic32_per_s     the same in fp32

    python benchmarks/gpu_calibrate.py --json OUT/calibration.json        # on a GPU
    python benchmarks/gpu_calibrate.py --device cpu --tiny --json /tmp/c.json   # dry run

Feed the JSON to ``benchmarks/gpu_ledger.py --calibration FILE`` (live units, or
``--recorded`` ones). On CPU the figures describe the CPU, not a GPU: the dry run only shows
the script runs.
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

from megatron_flat.plan.time import DEVICES, model_of

GEMMS = [(16384, 2048, 8192), (16384, 8192, 2048), (16384, 2048, 65536), (512, 2048, 2048)]
TINY_GEMMS = [(256, 64, 128), (64, 64, 64)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_seconds(fn: Callable[[], None], device: torch.device, reps: int = 5) -> float:
    """Median seconds of ``fn`` on the device (CUDA events; wall time on CPU)."""
    times = []
    for _ in range(reps + 1):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is a warm-up


def calibrate(device: torch.device, tiny: bool, model: str) -> dict:
    dev = DEVICES[model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    small = torch.zeros(16, device=device)
    n_ops = 200 if tiny else 2000
    out: dict = {}

    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n_ops):
        small.add_(1)
    out["launch_s"] = (time.perf_counter() - t0) / n_ops
    _sync(device)

    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        events = [torch.cuda.Event() for _ in range(n_ops)]
        t0 = time.perf_counter()
        for event in events:
            event.record(stream)
            stream.wait_event(event)
        out["api_call_s"] = (time.perf_counter() - t0) / (2 * n_ops)
        _sync(device)
    else:
        out["api_call_s"] = None  # no CUDA runtime on CPU

    trips = []
    for _ in range(20):
        t0 = time.perf_counter()
        small.add_(1)
        _sync(device)
        trips.append(time.perf_counter() - t0)
    out["sync_stall_s"] = max(statistics.median(trips) - out["launch_s"], 1e-9)

    def tiny_kernels() -> None:
        for _ in range(n_ops):
            small.add_(1)
    out["kernel_floor_s"] = _device_seconds(tiny_kernels, device, 3) / n_ops

    nbytes = (1 << 20) if tiny else (256 << 20)
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _device_seconds(lambda: dev_buf.copy_(host, non_blocking=True), device)
    d2h = _device_seconds(lambda: host.copy_(dev_buf, non_blocking=True), device)
    out["h2d_bytes_per_s"], out["d2h_bytes_per_s"] = nbytes / h2d, nbytes / d2h
    out["pcie_bytes_per_s"] = min(out["h2d_bytes_per_s"], out["d2h_bytes_per_s"])

    shapes = {}
    for m, k, n in (TINY_GEMMS if tiny else GEMMS):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        s = _device_seconds(lambda: a @ b, device)
        shapes[f"{m}x{k}x{n}"] = {"seconds": s, "flops_per_s": 2 * m * k * n / s,
                                  "efficiency": 2 * m * k * n / s / dev.flops}
    out["gemms"] = shapes
    filling = [v["efficiency"] for key, v in shapes.items() if int(key.split("x")[0]) >= 4096]
    out["matmul_efficiency"] = statistics.median(filling or [v["efficiency"]
                                                             for v in shapes.values()])

    big = torch.empty((1 << 24) if tiny else (1 << 30), dtype=torch.uint8, device=device)
    copy = torch.empty_like(big)
    s = _device_seconds(lambda: copy.copy_(big), device)
    out["hbm_bytes_per_s"] = 2 * big.numel() / s
    out["hbm_efficiency"] = out["hbm_bytes_per_s"] / dev.hbm_bytes_per_s

    rows, width, dest_rows = (256, 64, 1024) if tiny else (4096, 2048, 16384)
    index = torch.randperm(dest_rows, device=device)[:rows]
    for bits, dt in ((16, torch.bfloat16), (32, torch.float32)):
        dest = torch.zeros(dest_rows, width, device=device, dtype=dt)
        src = torch.ones(rows, width, device=device, dtype=dt)
        s = _device_seconds(lambda: dest.index_add_(0, index, src), device)
        out[f"atomic{bits}_per_s"] = rows * width / s
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="dry-run sizes (CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model = model_of(name)
    constants = calibrate(device, args.tiny or device.type == "cpu", model)
    payload = {"device": name, "device_model": model, "measured": device.type == "cuda",
               "torch": torch.__version__, "constants": constants}
    for key, value in constants.items():
        if isinstance(value, (int, float)):
            print(f"{key:20s} {value:.4g}")
    for key, value in constants["gemms"].items():
        print(f"  gemm {key:20s} {value['flops_per_s'] / 1e12:8.1f} TFLOP/s "
              f"({value['efficiency']:.0%} of {model}'s peak)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
