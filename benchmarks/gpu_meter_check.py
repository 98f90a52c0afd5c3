"""MemoryMeter on CUDA: exact against known allocations, and a real MoE step when possible.

Part of ``benchmarks/gpu_check.sh``. Prints a table and writes JSON. Checks:
- a 64 MiB tensor allocated and freed inside a section shows as exactly 64 MiB of peak
  (the CUDA caching allocator rounds to 512 B, so sizes here are multiples of it);
- nested sections do not lower the outer meter's peak;
- host pool bytes appear as host bytes, never as device bytes;
- (if megatron-core imports) the tiny MoE GPT forward+backward on one GPU, with its
  per-component peaks as the demo measures them on CPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from megatron_flat.runtime import HostPool, MemoryMeter
from megatron_flat.runtime.memory import format_bytes

MIB = 1 << 20


def meter_checks() -> dict:
    out = {}
    with MemoryMeter("cuda") as meter:
        with meter.section("alloc64"):
            t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
            del t
        with meter.section("inner16"):
            u = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
            del u
        pool = HostPool(32 * MIB)
        buf = pool.acquire((8 * MIB,), torch.uint8)
        out["host_in_use"] = meter.current_host_bytes()
        pool.release(buf)
    out["alloc64"] = meter.sections["alloc64"].peak_device_bytes
    out["inner16"] = meter.sections["inner16"].peak_device_bytes
    out["outer"] = meter.peak_device_bytes
    out["host_peak"] = meter.peak_host_bytes
    assert out["alloc64"] == 64 * MIB, out
    assert out["inner16"] == 16 * MIB, out
    assert out["outer"] == 64 * MIB, out
    assert out["host_peak"] >= 8 * MIB and pool.pinned, out
    return out


def megatron_step() -> dict:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return {"skipped": "megatron-core not importable on this machine"}
    from megatron_flat.testing.distributed import init_distributed, megatron_layout
    from megatron_flat.testing.training import Layout, Trainer, measure_peaks
    from megatron_flat.testing.tiny_gpt import TinyMoE

    init_distributed()
    tiny = TinyMoE(hidden_size=128, vocab_size=8192, seq_length=512, micro_batch_size=1,
                   global_batch_size=2)
    layout = Layout(recompute="full")
    with megatron_layout(seed=tiny.seed):
        return measure_peaks(Trainer(tiny, layout), steps=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {"meter": meter_checks(), "tiny_moe_step": megatron_step()}
    for group, values in results.items():
        for k, v in values.items():
            print(f"{group:14s} {k:34s} {format_bytes(v) if isinstance(v, int) else v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
