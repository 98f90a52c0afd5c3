"""The step-time model: predicted time on a named GPU from cost counts and overlap structure.

Everything here is a *prediction*: counts (from :class:`~megatron_flat.runtime.ledger.
CostLedger` on CPU, or the analytic per-layer counts of :mod:`megatron_flat.plan.costs` at
a real scale) turned into seconds with a few device constants. A lent GPU confirms or
refutes it (``benchmarks/gpu_check.sh`` prints the measured times beside these).

One unit of work (a MoE layer's forward + backward, the output layer + loss, an optimizer
step, ...) is predicted from its counts ``c`` on device ``D`` as::

    gpu      = c.flops / (D.flops · D.matmul_efficiency)        matmuls
             + c.mem_bytes / (D.hbm_bytes_per_s · D.hbm_efficiency)   everything else
    cpu      = c.host_mem_bytes / D.host_bytes_per_s             work on the host CPU (a CPU
                                                                 AdamW: memory-bound)
    host     = c.ops · D.launch_s                                the host's time per op
             + c.stream_calls · D.api_call_s                     events, stream switches
    compute  = max(gpu + cpu, host)      the GPU starves when launching is slower than running
    comm     = (all-to-all + other collective bytes) / D.link_bytes_per_s
               + collective calls · D.collective_latency_s
    copy     = max(h2d, d2h) / D.pcie_bytes_per_s     (the two directions run concurrently)
    stalls   = c.syncs · D.sync_stall_s       each sync drains the queue; the GPU then idles
             + c.host_plan_s                  while the host launches the next kernels, and
                                              while the host plans after the sync (host
                                              work between a sync and the next launch:
                                              PipelinedLLEP's plan, seconds of CPU time)

Counts from the ledger carry its kernel profile (``c.kernels``, see
:mod:`megatron_flat.runtime.kernels`); then ``gpu`` is summed kernel class by kernel class at
the rates those kernels achieve rather than at peak::

    gemm:T    n · max(D.kernel_floor_s, flops / (D.flops · D.matmul_efficiency · fill(T)),
                      bytes / (D.hbm_bytes_per_s · D.hbm_efficiency))
              (gemm32:T, an fp32 result: at D.fp32_flops instead of the bf16 peak)
              fill(T) = T / (⌈T / D.sms⌉ · D.sms): the last wave of T output tiles leaves
              SMs idle (T = 0: unknown shape, full)
    atomicB   max(n · D.kernel_floor_s, elements / D.atomic_rate(B), bytes at HBM rate)
    mem:B     n · max(D.kernel_floor_s, bytes / n / (D.hbm_bytes_per_s · D.hbm_efficiency))
    copy      0 here (the copy engines' time is ``copy``)

(the analytic counts of :mod:`megatron_flat.plan.costs` have no profile and keep the
aggregate form).

and the unit's :class:`Overlap` (its schedule, written per technique in ``OVERLAPS``) says
which part of ``comm`` and ``copy`` runs beside compute. With ``S`` pipeline stages (chunks,
ring hops, layers, buckets), hideable transfer ``X = max(h_c·comm, h_p·copy)`` (collectives
and copies use different engines) and compute ``C``, a two-stage pipeline takes
``max(X, C)·(S − 1)/S + (X + C)/S`` (the first transfer and the last compute are exposed);
the rest adds serially::

    time = pipeline(X, C, S) + (1 − h_c)·comm + (1 − h_p)·copy + stalls

A unit whose transfers run beside *other* units' compute (FSDP2 gathers each layer's
parameters while the previous layer computes) names those FLOPs in its overlap
(``beside_flops``, time ``B``): ``pipeline(X, C + B, S) − B`` (only what ``B`` cannot hide
is this unit's).

A whole step is the sum of its units' predictions plus the rest of the step (its counts
less the units' counts) run serially.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Iterable, Mapping, Optional

from megatron_flat.plan.model import PlanError

__all__ = [
    "DEVICES",
    "DeviceModel",
    "OVERLAPS",
    "Overlap",
    "Prediction",
    "device",
    "kernel_seconds",
    "model_of",
    "overlap_for",
    "predict",
    "predict_step",
]

COUNT_KEYS = ("flops", "all_to_all_bytes", "other_collective_bytes", "h2d_bytes", "d2h_bytes",
              "syncs", "ops", "mem_bytes", "host_mem_bytes", "host_plan_s", "stream_calls")


@dataclass(frozen=True)
class DeviceModel:
    """Constants of one GPU (per GPU, per direction where it matters).

    ``flops``: dense bf16 peak; ``matmul_efficiency``: the fraction of it large GEMMs reach;
    ``hbm_efficiency``: the fraction of HBM bandwidth bandwidth-bound kernels reach;
    ``link_bytes_per_s``: the intra-node interconnect per direction (NVLink), what one
    rank's collective payload crosses; ``pcie_bytes_per_s``: host↔device per direction as
    achieved with pinned memory; ``launch_s``: host time per op (eager dispatch and the
    launch; an op on host data costs it too);
    ``sync_stall_s``: the device's idle time after one host sync (queue drained, host
    round-trip, first kernels relaunched); ``collective_latency_s``: fixed cost of one
    collective call; ``host_bytes_per_s``: host memory bandwidth one GPU's rank gets for work
    on the CPU (an optimizer step run there).
    """

    name: str
    flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    pcie_bytes_per_s: float
    memory_bytes: int
    matmul_efficiency: float = 0.6
    hbm_efficiency: float = 0.8
    launch_s: float = 5e-6
    sync_stall_s: float = 30e-6
    collective_latency_s: float = 15e-6
    # A 2-socket node's ~320 GB/s of achievable host memory bandwidth shared by its 8 ranks.
    host_bytes_per_s: float = 40e9
    # The kernel profile's constants (plan.time's docstring). sms: published (H100 SXM and
    # H200: 132); the rest are stated assumptions until a calibrate run measures them
    # (benchmarks/gpu_calibrate.py): a kernel's minimum time on the device; atomic adds per
    # second through 16-bit and 32-bit atomics (index_add, scatter_add; 64-bit at half the
    # 32-bit rate), assumed no slower than a 32-bit accumulate until measured.
    sms: int = 132
    fp32_flops: float = 67e12  # H100 SXM / H200: FP32 without tensor cores (TF32 off)
    kernel_floor_s: float = 3e-6
    # a host call into the CUDA runtime that launches nothing (an event recorded or waited
    # on, a stream switched, a block recorded on a stream), through torch's wrappers
    api_call_s: float = 3e-6
    atomic16_per_s: float = 50e9
    atomic32_per_s: float = 50e9

    def atomic_rate(self, bits: int) -> float:
        """Atomic adds per second for elements of ``bits`` bits."""
        if bits <= 16:
            return self.atomic16_per_s
        return self.atomic32_per_s * (32 / bits if bits > 32 else 1)

    def replaced(self, **constants: float) -> "DeviceModel":
        """This device with some constants replaced (a calibrate run's, a fit's);
        ``PlanError`` names an unknown or non-positive one."""
        known = {f for f in self.__dataclass_fields__ if f != "name"}
        bad = [k for k in constants if k not in known]
        if bad:
            raise PlanError(f"unknown device constant(s) {', '.join(sorted(bad))}; "
                            f"known: {', '.join(sorted(known))}")
        for key, value in constants.items():
            if not value > 0:
                raise PlanError(f"device constant {key} must be > 0, got {value!r}")
        return replace(self, **constants)


# H200 SXM (architecture.md §6). The efficiencies and fixed costs are stated assumptions, the
# figures a well-tuned Megatron run reaches, not measurements.
DEVICES: Dict[str, DeviceModel] = {
    "H200": DeviceModel(name="H200", flops=989e12, hbm_bytes_per_s=4.8e12,
                        link_bytes_per_s=450e9, pcie_bytes_per_s=55e9,
                        memory_bytes=141 * 10**9),
    "H100": DeviceModel(name="H100", flops=989e12, hbm_bytes_per_s=3.35e12,
                        link_bytes_per_s=450e9, pcie_bytes_per_s=55e9,
                        memory_bytes=80 * 10**9),
}


def device(name: str) -> DeviceModel:
    """The named device model (``H200``, ``H100``); ``PlanError`` names the choices."""
    try:
        return DEVICES[name]
    except KeyError:
        raise PlanError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICES))}") from None


def model_of(gpu_name: str, default: str = "H200") -> str:
    """The device model whose name appears in a GPU's own name (``torch.cuda.
    get_device_name``: "NVIDIA H100 80GB HBM3" is an ``H100``), else ``default``."""
    return next((known for known in DEVICES if known in gpu_name), default)


@dataclass(frozen=True)
class Overlap:
    """Which transfers of a unit run beside its compute, per its schedule.

    ``stages``: pipeline depth (chunks, ring hops, layers, buckets; 1 = nothing pipelines);
    ``comm_hidden`` / ``copy_hidden``: fractions of the collective / host-copy time that the
    schedule posts asynchronously beside compute; ``why``: the schedule, in words;
    ``beside_flops``: FLOPs of other units the hidden transfers run beside as well.
    """

    stages: int = 1
    comm_hidden: float = 0.0
    copy_hidden: float = 0.0
    why: str = "serial: every transfer on the compute stream"
    beside_flops: float = 0.0  # other units' FLOPs the transfers also run beside

    def __post_init__(self) -> None:
        if not isinstance(self.stages, int) or self.stages < 1:
            raise PlanError(f"overlap stages must be a positive integer, got {self.stages!r}")
        for name in ("comm_hidden", "copy_hidden"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise PlanError(f"overlap {name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.beside_flops < 0:
            raise PlanError(f"overlap beside_flops must be >= 0, got {self.beside_flops!r}")


# The overlap each (unit, variant) schedule has, as the landed code runs it. ``stages`` is
# filled per run (K, P, layers, buckets) by ``overlap_for``.
OVERLAPS: Dict[tuple, Overlap] = {
    ("moe", "stock"): Overlap(why="Megatron's alltoall dispatcher: dispatch and combine "
                                  "all-to-alls on the compute stream, between the router and "
                                  "the experts"),
    ("moe", "flat"): Overlap(comm_hidden=0.5, why="PipelinedLLEP: chunk i+1's dispatch is "
                                                  "posted asynchronously while chunk i's "
                                                  "experts run; the combine (about half the "
                                                  "bytes) blocks"),
    ("vocab", "stock"): Overlap(why="output GEMM, then vocab-parallel cross-entropy's three "
                                    "small all-reduces"),
    ("vocab", "flat"): Overlap(comm_hidden=1.0, why="Ring-DTP: the next hop's send/receive is "
                                                    "posted before the current strip's GEMM"),
    ("sco", "stock"): Overlap(why="plain full recompute: boundaries stay on the device"),
    ("sco", "flat"): Overlap(copy_hidden=1.0, why="SCO: each boundary's offload (with "
                                                  "attention replay, each layer's O + LSE's "
                                                  "too) runs on a copy stream during the next "
                                                  "layers' forward; layer l-1's reload runs "
                                                  "while layer l recomputes; the first reload "
                                                  "of the backward is exposed"),
    ("optimizer", "stock"): Overlap(why="AdamW on device state: no host copies"),
    ("optimizer", "flat"): Overlap(copy_hidden=1.0, why="OffloadStreamAdamW: bucket g+1 "
                                                        "uploads while g updates and g-1 "
                                                        "writes back"),
}
# The baselines that move the optimizer off the GPU (``plan.baselines``).
OVERLAPS[("optimizer", "megatron-cpu-offload")] = Overlap(
    copy_hidden=1.0, why="HybridDeviceOptimizer: every gradient's copy down is posted on a "
                         "side stream first; each parameter's CPU AdamW waits for its own "
                         "gradient (a host sync), and its copy back runs while the next "
                         "parameter updates")
OVERLAPS[("activation-offload", "megatron-offload")] = Overlap(
    copy_hidden=1.0,
    why="Megatron's fine-grained activation offloading: each group's copy down runs on its "
        "d2h stream during the forward, its reload on the h2d stream one group ahead in the "
        "backward")
OVERLAPS[("checkpoint-offload", "fsdp2-cp")] = Overlap(
    why="save_on_cpu(pin_memory=True): each layer input's copy down (forward) and up "
        "(backward) runs on the compute stream, exposed")
OVERLAPS[("optimizer", "fsdp2-offload")] = Overlap(
    why="FSDP2 with CPU offload: torch's AdamW on the CPU over the sharded host state")
OVERLAPS[("parameters", "fsdp2-offload")] = Overlap(
    comm_hidden=1.0, copy_hidden=1.0,
    why="FSDP2: the next layer's shard upload and all-gather (forward, recompute, backward) "
        "and the previous layer's reduce-scatter and gradient download run beside the "
        "current layer's compute (one layer prefetched)")
OVERLAPS[("parameters", "flat")] = Overlap(
    copy_hidden=1.0,
    why="param offload: the next MoE layer's expert weights go up on the h2d stream while the "
        "current layer computes (forward, recompute, backward), each layer's fp32 gradient "
        "comes down on the d2h stream as its backward ends; the first fetch is exposed")
OVERLAPS[("moe-recompute", "stock")] = OVERLAPS[("moe", "stock")]
OVERLAPS[("moe-recompute", "flat")] = OVERLAPS[("moe", "flat")]


def overlap_for(unit: str, variant: str, stages: int = 1) -> Overlap:
    """The schedule's overlap for ``(unit, variant)`` with ``stages`` pipeline stages;
    serial for anything not listed (a whole step's remainder, an unknown unit)."""
    base = OVERLAPS.get((unit, variant), Overlap())
    return Overlap(stages=max(1, int(stages)), comm_hidden=base.comm_hidden,
                   copy_hidden=base.copy_hidden, why=base.why, beside_flops=base.beside_flops)


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one unit and their parts (all predictions, not measurements)."""

    total_s: float
    compute_s: float
    gpu_s: float
    launch_s: float
    comm_s: float
    copy_s: float
    stall_s: float
    exposed_comm_s: float
    exposed_copy_s: float
    device: str
    overlap: Overlap

    @property
    def launch_bound(self) -> bool:
        """The host launches kernels slower than the GPU runs them."""
        return self.launch_s > self.gpu_s

    def as_dict(self) -> Dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "overlap"}
        out["overlap"] = asdict(self.overlap)
        out["launch_bound"] = self.launch_bound
        out["predicted"] = True
        return out


def _count(counts: Mapping[str, Any], key: str) -> float:
    value = counts.get(key, 0) or 0
    if isinstance(value, Mapping):
        value = sum(value.values())
    if value < 0:
        raise PlanError(f"count {key} must be >= 0, got {value!r}")
    return float(value)


def _calls(counts: Mapping[str, Any]) -> float:
    calls = counts.get("collective_calls", 0) or 0
    if isinstance(calls, Mapping):
        # a receive is the other half of a send: one transfer, one latency
        return float(sum(v for k, v in calls.items() if k != "recv"))
    return float(calls)


def kernel_seconds(profile: Mapping[str, Any], dev: DeviceModel) -> float:
    """Device time of a ledger kernel profile (``{key: [count, work, bytes]}``) on ``dev``,
    class by class as the module docstring writes it."""
    hbm = dev.hbm_bytes_per_s * dev.hbm_efficiency
    total = 0.0
    for key, row in profile.items():
        n, work, nbytes = (float(x) for x in row)
        if n <= 0:
            continue
        cls, _, size = key.partition(":")
        if cls in ("gemm", "gemm32"):
            tiles = int(size or 0)
            fill = 1.0 if tiles <= 0 else tiles / (math.ceil(tiles / dev.sms) * dev.sms)
            peak = dev.flops if cls == "gemm" else dev.fp32_flops
            rate = peak * dev.matmul_efficiency * fill
            total += n * max(dev.kernel_floor_s, work / n / rate, nbytes / n / hbm)
        elif cls.startswith("atomic"):
            bits = int(cls[len("atomic"):] or 32)
            total += max(n * dev.kernel_floor_s, work / dev.atomic_rate(bits), nbytes / hbm)
        elif cls == "copy":
            continue  # the copy engines' time: ``copy`` in predict()
        elif cls == "mem":
            total += n * max(dev.kernel_floor_s, nbytes / n / hbm)
        else:
            raise PlanError(f"unknown kernel class {key!r} in a kernel profile")
    return total


def predict(counts: Mapping[str, Any], overlap: Optional[Overlap] = None,
            device_model: Any = "H200") -> Prediction:
    """Predicted time of one unit from its counts (the ledger's keys) and its overlap;
    with the ledger's kernel profile (``counts["kernels"]``) the GPU time is the profile's."""
    dev = device(device_model) if isinstance(device_model, str) else device_model
    ov = overlap or Overlap()
    if counts.get("kernels"):
        gpu = kernel_seconds(counts["kernels"], dev)
    else:
        gpu = (_count(counts, "flops") / (dev.flops * dev.matmul_efficiency)
               + _count(counts, "mem_bytes") / (dev.hbm_bytes_per_s * dev.hbm_efficiency))
    cpu = _count(counts, "host_mem_bytes") / dev.host_bytes_per_s
    host = (_count(counts, "ops") * dev.launch_s
            + _count(counts, "stream_calls") * dev.api_call_s)
    compute = max(gpu + cpu, host)
    comm = ((_count(counts, "all_to_all_bytes") + _count(counts, "other_collective_bytes"))
            / dev.link_bytes_per_s + _calls(counts) * dev.collective_latency_s)
    copy = max(_count(counts, "h2d_bytes"), _count(counts, "d2h_bytes")) / dev.pcie_bytes_per_s
    stalls = _count(counts, "syncs") * dev.sync_stall_s + _count(counts, "host_plan_s")
    hidden = max(ov.comm_hidden * comm, ov.copy_hidden * copy)
    s = ov.stages
    beside = ov.beside_flops / (dev.flops * dev.matmul_efficiency)
    pipelined = max(hidden, compute + beside) * (s - 1) / s + (hidden + compute + beside) / s \
        - beside
    exposed_comm = (1 - ov.comm_hidden) * comm
    exposed_copy = (1 - ov.copy_hidden) * copy
    total = pipelined + exposed_comm + exposed_copy + stalls
    # what of the hideable transfer the pipeline did not hide
    leak = pipelined - compute
    if ov.comm_hidden * comm >= ov.copy_hidden * copy:
        exposed_comm += leak
    else:
        exposed_copy += leak
    return Prediction(total_s=total, compute_s=compute, gpu_s=gpu, launch_s=host, comm_s=comm,
                      copy_s=copy, stall_s=stalls, exposed_comm_s=exposed_comm,
                      exposed_copy_s=exposed_copy, device=dev.name, overlap=ov)


def subtract(total: Mapping[str, Any], parts: Iterable[Mapping[str, Any]]) -> Dict[str, float]:
    """``total`` less the sum of ``parts``, key by key (clamped at 0), for COUNT_KEYS."""
    parts = list(parts)
    out: Dict[str, float] = {}
    for key in COUNT_KEYS:
        out[key] = max(0.0, _count(total, key) - sum(_count(p, key) for p in parts))
    out["collective_calls"] = max(0.0, _calls(total) - sum(_calls(p) for p in parts))
    return out


def predict_step(step_counts: Mapping[str, Any],
                 units: Mapping[str, tuple], device_model: Any = "H200") -> Dict[str, Any]:
    """A whole step: each unit with its overlap, the rest of the step serial.

    ``units`` maps a name to ``(counts, overlap)``; the units' counts must be part of
    ``step_counts`` (measured inside the same step, or scaled to it). Returns
    ``{"total_s", "units": {name: Prediction}, "rest": Prediction, "predicted": True}``.
    """
    preds = {name: predict(c, ov, device_model) for name, (c, ov) in units.items()}
    rest = predict(subtract(step_counts, [c for c, _ in units.values()]), Overlap(),
                   device_model)
    total = sum(p.total_s for p in preds.values()) + rest.total_s
    return {"total_s": total, "units": preds, "rest": rest, "predicted": True}


def format_seconds(seconds: float) -> str:
    """``12.3 ms``, ``456 us``, ``1.23 s`` for tables."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"
