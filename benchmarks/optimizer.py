"""Optimizer step: CPU AdamW offload (ours and Megatron's) vs OffloadStreamAdamW vs on-device.

Variants, all on the same model (transformer-shaped matrices, ``--dtype`` params on
``--device``) and the same fp32 gradients (``main_grad``, as Megatron's grad buffer holds
them):

  (a) cpu-adamw      ZeRO-Offload style: fp32 master, exp_avg, exp_avg_sq and an fp32 grad
                     copy in host memory (the host pool); each step copies grads to the
                     host, runs torch's AdamW on the CPU (fused CPU kernel when torch has it,
                     else foreach) and copies the new weights back.
  (b) offload-sN     OffloadStreamAdamW with N staging slots (N = ``--slots``).
  (c) device-adamw   torch.optim.AdamW with all state on the device (for low-precision
                     params: on an fp32 master copy, then cast), the memory it costs.
  (d) megatron-hdo   Megatron-Core's HybridDeviceOptimizer as ``--optimizer-cpu-offload
                     --optimizer-offload-fraction 1.0`` builds it (megatron_flat.testing.
                     hybrid_optimizer): fp32 masters, moments and grads on the host, the step
                     on the CPU. On a CPU-only machine it runs on stand-in device params (its
                     memory is exact, its time means nothing); leave out with --skip-hdo.

Reported per variant: median step time, ratio to (a), device peak (MemoryMeter, above the
model's params and grads), device staging bytes (b), host state bytes (host pool; for (d)
the host tensors it holds, counted storage by storage). For (b) also the host tier's
figures: bytes allocated (exact), pinned (CUDA), the per-node total for ``--ranks-per-node``
ranks and what ``pin_memory=True`` would hold for the same buffers.
(b) and (c) run the same AdamW kernel on the same device, so their weights must be
bitwise equal; that is checked. On CUDA it also measures pinned host<->device bandwidth
and reports (b) against the transfer floor (bytes each way / bandwidth, the two
directions overlapping). Time only as ratios within one run (architecture.md §5).

On CPU the streams are inline, so the pipeline cannot overlap anything: a CPU run proves
the memory bounds and exactness, not speed. Run::

    python benchmarks/optimizer.py --json results/optimizer.json                 # CPU, ~38M params
    python benchmarks/optimizer.py --hidden 4096 --layers 5 --json out.json     # GPU, ~1B params
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any, Callable, Optional

import torch

from megatron_flat.optim import OffloadStreamAdamW
from megatron_flat.runtime import HostPool, MemoryMeter, host_tier, memory
from megatron_flat.runtime.ledger import CostLedger, count, counts_cells, counts_header
from megatron_flat.runtime.memory import format_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_NOTE = ("CPU run: every stream is the inline one, so upload, update and write-back "
            "cannot overlap. This run proves memory and exactness, not speed.")


def layer_shapes(hidden: int, layers: int) -> list[tuple[int, ...]]:
    """qkv, proj, fc1, fc2 and two norms per layer: about 12·h² params per layer."""
    h = hidden
    per_layer = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
                 (h,), (h,)]
    return per_layer * layers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fused_on(device: torch.device) -> bool:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:
        return device.type == "cuda"


class Model:
    """Params and their fp32 gradients (``main_grad``), rebuilt identically per variant."""

    def __init__(self, shapes, dtype, device, seed=0):
        gen = torch.Generator(device).manual_seed(seed)  # on the device: fast for 1B params
        self.params = []
        for s in shapes:
            p = torch.randn(s, generator=gen, device=device).mul_(0.02).to(dtype)
            p.requires_grad_()
            # Megatron keeps gradients in an fp32 buffer whatever the param dtype.
            p.main_grad = torch.randn(s, generator=gen, device=device).mul_(1e-3)
            self.params.append(p)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


class CpuAdamW:
    """(a): host-resident state, serial CPU AdamW, grads down and weights up each step."""

    def __init__(self, params, lr, pool: HostPool, use_fused: bool):
        self.params = params
        self.pool = pool
        self.masters, self.host_grads = [], []
        for p in params:
            master = self._take(p.shape)
            master.copy_(p.detach())
            master.requires_grad_()
            grad = self._take(p.shape)
            master.grad = grad
            self.masters.append(master)
            self.host_grads.append(grad)
        kw = dict(fused=True) if use_fused else dict(foreach=True)
        self.kernel = "fused" if use_fused else "foreach"
        self.opt = torch.optim.AdamW(self.masters, lr=lr, **kw)
        for m in self.masters:  # state in the pool as well, so it counts as host memory
            st = self.opt.state[m]
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = self._take(m.shape).zero_()
            st["exp_avg_sq"] = self._take(m.shape).zero_()

    def _take(self, shape):
        t = self.pool.acquire(shape, torch.float32)
        return t if t is not None else torch.empty(shape, dtype=torch.float32)

    @torch.no_grad()
    def step(self) -> None:
        for p, g in zip(self.params, self.host_grads):
            g.copy_(p.main_grad, non_blocking=True)
        sync(self.params[0].device)
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m, non_blocking=True)
        sync(self.params[0].device)


class DeviceAdamW:
    """(c): torch AdamW with its state on the device (fp32 master for low precision)."""

    def __init__(self, params, lr, kernel_kw):
        self.params = params
        self.low = params[0].dtype != torch.float32
        if self.low:
            self.masters = [p.detach().float().requires_grad_() for p in params]
        else:
            self.masters = params
        self.opt = torch.optim.AdamW(self.masters, lr=lr, **kernel_kw)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            if self.low:
                p.copy_(m)
            m.grad = None


class MegatronHDO:
    """(d): Megatron's HybridDeviceOptimizer (all state offloaded). On CPU it runs over
    stand-in device params, and whatever it allocates is host memory for the meter."""

    def __init__(self, params, lr):
        from megatron_flat.testing import hybrid_optimizer as hdo

        self.cpu = not params[0].is_cuda
        self.params = hdo.stand_in(params) if self.cpu else params
        for p, given in zip(self.params, params):
            p.decoupled_grad = given.main_grad  # HDO reads decoupled_grad, else .grad
        with self._host():
            self.opt = hdo.hybrid_device_adamw(self.params, lr)
        self.kernel = "cpu fused"
        self._host_bytes = hdo.host_bytes

    def _host(self):
        return memory.host_allocation() if self.cpu else _nothing()

    def step(self) -> None:
        with self._host():
            self.opt.step()

    @property
    def host_bytes(self) -> int:
        return self._host_bytes(self.opt)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_variant(name: str, build: Callable[[list], Any], args, shapes, dtype, device,
                info: Optional[Callable[[Any], dict]] = None) -> tuple[dict, list]:
    model = Model(shapes, dtype, device)
    gc.collect()
    sync(device)
    # The warm-up runs inside a throwaway cost ledger, so the state it makes keeps its
    # origin (AdamW's step counters are host data) when the next step is counted.
    with MemoryMeter(device) as meter, CostLedger():
        opt = build(model.params)
        for _ in range(args.warmup):
            opt.step()
        sync(device)
    counts = count(opt.step)  # one more step, every variant alike
    sync(device)
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    row = {
        "variant": name,
        "step_s": statistics.median(times),
        "step_times_s": times,
        "peak_device_bytes": meter.peak_device_bytes,
        "peak_host_bytes": meter.peak_host_bytes,
        "ledger": counts,
    }
    if info is not None:
        row.update(info(opt))
    weights = [p.detach().to("cpu", copy=True) for p in model.params]
    del opt, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, weights


def bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Pinned host<->device bandwidth (bytes/s): each direction alone, and both at once."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(fn, reps=3):
        fn()
        sync(device)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both():
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)

    out = {
        "h2d_Bps": nbytes / timed(lambda: dev.copy_(host, non_blocking=True)),
        "d2h_Bps": nbytes / timed(lambda: host2.copy_(dev2, non_blocking=True)),
        "duplex_Bps_each_way": nbytes / timed(both),
    }
    del host, host2, dev, dev2
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--bucket-numel", type=int, default=8_000_000)
    p.add_argument("--slots", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--kernel", choices=["auto", "fused", "foreach", "single"], default="auto",
                   help="AdamW kernel for (b) and (c); auto = fused where torch has it")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and repeat")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over all variants (timings pooled; memory from the first)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (inside the meter)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--skip-device-adamw", action="store_true",
                   help="leave out (c) when the device cannot hold the full state")
    p.add_argument("--skip-hdo", action="store_true",
                   help="leave out (d), Megatron's HybridDeviceOptimizer (needs megatron-core)")
    p.add_argument("--ranks-per-node", type=int, default=8,
                   help="ranks sharing a node's host memory, for the per-node total")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 keeps a shared machine's "
                        "OpenMP barriers out of the timings")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tier = host_tier.configure(local_ranks=args.ranks_per_node)  # (b)'s host memory
    dtype = DTYPES[args.dtype]
    shapes = layer_shapes(args.hidden, args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    kernel = args.kernel
    if kernel == "auto":
        kernel = "fused" if fused_on(device) else "foreach"
    kernel_kw = {"fused": dict(fused=True), "foreach": dict(foreach=True),
                 "single": dict(foreach=False)}[kernel]
    cpu_fused = fused_on(torch.device("cpu"))
    low = dtype != torch.float32

    def pool_for_a():  # (a) keeps master, exp_avg, exp_avg_sq and grad: 16 B/param
        return HostPool(16 * numel + 4 * 512 * len(shapes))

    def offload_info(o):
        return {"kernel": f"{device.type} {o.kernels[0]}", "staging_bytes": o.staging_bytes,
                "host_state_bytes": o.host_bytes, "buckets": len(o.plan.buckets),
                "largest_bucket": o.plan.largest_numel,
                "host_pinned": o.host_pinned, "host_tier": tier.report()}

    variants = [("(a) cpu-adamw", lambda ps: CpuAdamW(ps, args.lr, pool_for_a(), cpu_fused),
                 lambda o: {"kernel": f"cpu {o.kernel}"})]
    for slots in args.slots:
        variants.append((
            f"(b) offload-s{slots}",
            lambda ps, slots=slots: OffloadStreamAdamW(
                ps, lr=args.lr, bucket_numel=args.bucket_numel, num_slots=slots,
                device=device, grad_attr="main_grad", **kernel_kw),
            offload_info,
        ))
    if not args.skip_device_adamw:
        variants.append(("(c) device-adamw", lambda ps: DeviceAdamW(ps, args.lr, kernel_kw),
                         lambda o: {"kernel": f"{device.type} {kernel}"}))
    if not args.skip_hdo:
        try:
            import megatron.core.optimizer.cpu_offloading  # noqa: F401
        except ImportError as exc:
            print(f"(d) megatron-hdo left out: megatron-core not importable ({exc})")
            args.skip_hdo = True
    if not args.skip_hdo:
        variants.append(("(d) megatron-hdo", lambda ps: MegatronHDO(ps, args.lr),
                         lambda o: {"kernel": o.kernel, "host_state_bytes": o.host_bytes}))

    # Round-robin repeats: a machine whose load drifts slows every variant alike.
    rows: dict[str, dict] = {}
    weights: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name, build, info in variants:
            row, w = run_variant(name, build, args, shapes, dtype, device, info)
            if repeat == 0:
                rows[name], weights[name] = row, w
            else:
                rows[name]["step_times_s"] += row["step_times_s"]
    rows = list(rows.values())
    for r in rows:
        r["step_s"] = statistics.median(r["step_times_s"])
        r["min_step_s"] = min(r["step_times_s"])

    # Exactness across variants.
    names = list(weights)
    offload = [n for n in names if n.startswith("(b)")]
    checks = {}
    reference = "(c) device-adamw" if "(c) device-adamw" in weights else offload[0]
    for n in names:
        if n == reference:
            continue
        equal = all(torch.equal(a, b) for a, b in zip(weights[n], weights[reference]))
        diff = max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
                   for a, b in zip(weights[n], weights[reference]))
        checks[f"{n} vs {reference}"] = {"bitwise_equal": equal, "max_abs_diff": diff}

    base, base_min = rows[0]["step_s"], rows[0]["min_step_s"]
    for r in rows:
        r["time_ratio_vs_a"] = r["step_s"] / base
        r["min_time_ratio_vs_a"] = r["min_step_s"] / base_min
        r["speedup_vs_a"] = base / r["step_s"]

    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": numel,
        "dtype": args.dtype,
        "bucket_numel": args.bucket_numel,
        "kernel": kernel,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
        "exactness": checks,
    }
    if device.type == "cuda":
        bw = bandwidth(device)
        per_param = 12 if low else 8  # master (if low precision), exp_avg, exp_avg_sq
        each_way = per_param * numel
        floor = max(each_way / bw["h2d_Bps"], each_way / bw["d2h_Bps"],
                    each_way / bw["duplex_Bps_each_way"])
        result["bandwidth"] = bw
        result["transfer_floor_s"] = floor
        result["bytes_each_way"] = each_way
        for r in rows:
            if r["variant"].startswith("(b)"):
                r["fraction_of_floor"] = floor / r["step_s"]
    else:
        result["note"] = CPU_NOTE

    print(f"optimizer step, {numel / 1e6:.1f}M {args.dtype} params on {device} "
          f"({result['device_name']}), bucket {args.bucket_numel:,}, kernel {kernel}, "
          f"{args.steps} steps x {args.repeats} rounds")
    header = (f"{'variant':18s}{'kernel':>12s}{'median':>10s}{'vs (a)':>8s}{'min':>10s}"
              f"{'vs (a)':>8s}{'device peak':>13s}{'staging':>12s}{'host state':>12s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        staging = format_bytes(r["staging_bytes"]) if "staging_bytes" in r else "-"
        print(f"{r['variant']:18s}{r['kernel']:>12s}{r['step_s'] * 1e3:>8.1f}ms"
              f"{r['time_ratio_vs_a']:>7.2f}x{r['min_step_s'] * 1e3:>8.1f}ms"
              f"{r['min_time_ratio_vs_a']:>7.2f}x{format_bytes(r['peak_device_bytes']):>13s}"
              f"{staging:>12s}{format_bytes(r.get('host_state_bytes', r['peak_host_bytes'])):>12s}")
    tiers = [r for r in rows if "host_tier" in r]
    if tiers:
        print(f"host tier of (b) (per rank; per node: x{args.ranks_per_node} ranks): allocated "
              "(exact), pinned (CUDA only), what pin_memory=True would hold")
        for r in tiers:
            t = r["host_tier"]
            print(f"  {r['variant']:16s}{format_bytes(t['allocated_total_bytes']):>12s} allocated"
                  f"{format_bytes(t['pinned_bytes']):>12s} pinned"
                  f"{format_bytes(t['per_node_bytes']):>12s} per node"
                  f"{format_bytes(t['caching_allocator_bytes']):>12s} with pin_memory")
    print("counts of one step (CostLedger; h2d/d2h: optimizer state streamed to and from the "
          "host pool)")
    print(f"{'variant':18s}" + counts_header())
    for r in rows:
        print(f"{r['variant']:18s}" + counts_cells(r["ledger"]))
    for k, v in checks.items():
        print(f"exactness {k}: bitwise_equal={v['bitwise_equal']} max_abs_diff={v['max_abs_diff']:.3g}")
    if device.type == "cuda":
        bw = result["bandwidth"]
        print(f"bandwidth: H2D {bw['h2d_Bps'] / 1e9:.1f} GB/s, D2H {bw['d2h_Bps'] / 1e9:.1f} GB/s, "
              f"duplex {bw['duplex_Bps_each_way'] / 1e9:.1f} GB/s each way; transfer floor "
              f"{result['transfer_floor_s'] * 1e3:.1f} ms ({format_bytes(result['bytes_each_way'])} each way)")
        for r in rows:
            if "fraction_of_floor" in r:
                print(f"  {r['variant']}: {r['fraction_of_floor']:.0%} of the floor, "
                      f"{r['speedup_vs_a']:.2f}x faster than (a)")
    else:
        print(CPU_NOTE)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
