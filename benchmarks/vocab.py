"""Vocabulary projection + cross-entropy, forward + backward: peak memory per rank.

Compares, on each rank of a ring of P, the peak of live device bytes (MemoryMeter) and the
time of projection + per-token cross-entropy, forward and backward, for

* ``dense``: full ``N_local x V`` logits on every rank (``x @ W.T``, upcast, cross-entropy;
  needs the whole ``V x H`` weight and produces its whole gradient) — the baseline;
* ``megatron-vp-ce``: Megatron's own output layer + loss at TP = P with sequence
  parallelism — ``ColumnParallelLinear``'s function (all-gather of the P ranks' tokens,
  ``[N, V/P]`` logits from the rank's shard, ``N = P * N_local``) and
  ``tensor_parallel.vocab_parallel_cross_entropy`` over the group — the second baseline;
* ``ring-weights`` / ``ring-activations`` / ``ring-auto``: :func:`ring_dtp_cross_entropy`
  over the P ranks, each holding ``V/P`` rows, one strip per shard (the paper's schedule);
  ``ring-auto-B/4``: the same with each shard cut into 4 strips (``block_size``).
  P = 1: ``ring-blocked`` (the single-device version, 8192-row strips by default) and
  ``ring-blocked-B/4``.

* multi-token prediction (``--mtp-heads D``, default 1): ``megatron-vp-ce+mtpD`` and
  ``ring-auto+mtpD`` run the projection + loss 1 + D times per step (the main head and D
  heads on labels shifted by 1..D, as Megatron's MTP loop does): Megatron keeps every
  head's fp32 softmax until the backward, Ring-DTP only each head's lse.

Baselines live in ``BASELINES`` and the methods under test in ``METHODS``: a new column is
one more ``Method`` appended to ``BASELINES``; every method is reported against every
baseline. The ring methods pass a ``plan_key`` as the Megatron module does, so the counted
(second) call is the steady state: no plan gather, no host sync.

Counts (CostLedger, one forward + backward of rank 0): FLOPs (every matmul, the backward's
recomputed strips included), ring bytes (what this rank sends to its neighbour: shards or
tokens, partial states, travelling gradient sums) and per ring step (P - 1 steps forward,
P - 1 backward), host syncs. ``--json PATH`` writes a list of records, one per (method,
tokens): ``method``, ``P``, ``tokens``, ``peak_bytes``, ``strips``, ``syncs``, ``flops``,
``time_ms`` and more (forward/backward peaks, ring bytes, the ratios to each baseline).

Shapes are the paper's per-rank shapes (H = 7168, V = 200,000 over P = 8, so V/P = 25,000,
and N = 16K / 32K tokens per rank) divided by ``--scale``, so that one strip
``N_local x V/P`` stays large against ``N_local x H`` as there (V/P = 3.5 H) and N = 16K
falls below V/P, 32K above (``auto`` picks activations, then weights). V = P * V/P. Peaks are
in bytes and in strips (``N_local * V/P * 4`` bytes); times are the fastest of ``--reps``
rounds, slowest rank, reported as ratios (DESIGN.md §5). Run::

    torchrun --nproc-per-node 4 benchmarks/vocab.py --json results/vocab.json
    torchrun --nproc-per-node 8 benchmarks/vocab.py --scale 160 --reps 1   # the paper's P
    python benchmarks/vocab.py            # P = 1: dense vs the blocked version
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flat.runtime import MemoryMeter
from megatron_flat.runtime.ledger import count, counts_cells, counts_header
from megatron_flat.runtime.memory import format_bytes
from megatron_flat.testing.distributed import init_distributed
from megatron_flat.vocab import resolve_mode, ring_dtp_cross_entropy

PAPER = dict(hidden=7168, vocab=200_000, world=8, tokens=(16 * 1024, 32 * 1024))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Inputs:
    """One rank's problem. Leaves (x, w_shard, w_full) are built before the meter opens."""

    x: torch.Tensor  # [N_local, H], requires grad
    w_shard: torch.Tensor  # [V/P, H], this rank's rows, requires grad
    w_full: torch.Tensor  # [V, H] (the dense baseline's weight), requires grad
    labels: torch.Tensor  # [N_local]
    group: Optional[dist.ProcessGroup]  # the ring (None when P = 1)
    rank: int
    world: int
    vocab_size: int
    vocab_per_rank: int
    block_size: Optional[int]
    labels_full: Optional[torch.Tensor] = None  # [P * N_local]: every rank's, in rank order

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.w_shard, self.w_full)


@dataclass
class Method:
    """A projection + loss: ``run(inputs) -> per-token loss [N_local]`` (backward is ours)."""

    name: str
    run: Callable[[Inputs], torch.Tensor]
    note: str = ""


def dense_cross_entropy(inp: Inputs) -> torch.Tensor:
    logits = inp.x @ inp.w_full.t()
    return F.cross_entropy(logits.float(), inp.labels, reduction="none")


def ring(mode: str, strips_per_shard: int = 0) -> Callable[[Inputs], torch.Tensor]:
    """Ring-DTP in ``mode``; ``strips_per_shard`` > 0 cuts each shard into that many strips
    (else ``--block-size``, else the op's default: the whole shard)."""
    def run(inp: Inputs, shift: int = 0) -> torch.Tensor:
        block = inp.block_size
        if strips_per_shard:
            block = -(-inp.vocab_per_rank // strips_per_shard)
        labels = torch.roll(inp.labels, -shift) if shift else inp.labels
        return ring_dtp_cross_entropy(
            inp.x, inp.w_shard, labels, group=inp.group,
            mode=mode, vocab_size=inp.vocab_size, block_size=block,
            plan_key=("bench", mode, block, tuple(inp.x.shape), inp.x.dtype))
    return run


def with_mtp_heads(run_head: Callable, heads: int) -> Callable[[Inputs], torch.Tensor]:
    """The main head and ``heads`` MTP heads: the projection + loss 1 + heads times, head k
    on this rank's labels shifted left by k (Megatron's MTP roll); returns their sum."""
    def run(inp: Inputs) -> torch.Tensor:
        total = run_head(inp)
        for k in range(1, heads + 1):
            total = total + run_head(inp, k)
        return total
    return run


def megatron_vocab_parallel_ce(inp: Inputs, shift: int = 0) -> torch.Tensor:
    """Megatron's output layer + loss at TP = P, sequence parallel (GPTModel's path without
    Ring-DTP); returns this rank's tokens' loss (every rank computes all N = P * N_local).

    Needs Megatron's parallel state with TP = P (``main`` sets it up). The all-gather goes
    into Megatron's global memory buffer, which a real model already holds for its decoder's
    sequence-parallel layers: it is warmed up before the meter opens, so not counted here.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    from megatron_flat.megatron import compat

    tp_group = parallel_state.get_tensor_model_parallel_group()
    logits = linear_with_grad_accumulation_and_async_allreduce(
        inp.x.unsqueeze(1), inp.w_shard, None, gradient_accumulation_fusion=False,
        allreduce_dgrad=False, sequence_parallel=inp.world > 1, tp_group=tp_group,
    )  # [N, 1, V/P]
    target = inp.labels_full
    if shift:  # an MTP head: every rank's labels rolled as the ring methods roll them
        target = torch.roll(target.view(inp.world, -1), -shift, dims=1).reshape(-1)
    loss = compat.vocab_parallel_cross_entropy(logits, target.unsqueeze(1), tp_group)
    del logits  # consumed in place by the loss
    n = inp.x.shape[0]
    return loss[inp.rank * n: (inp.rank + 1) * n, 0]


BASELINES: list[Method] = [
    Method("dense", dense_cross_entropy, "full N_local x V logits and V x H weight grad"),
]
BASELINES.append(Method(
    "megatron-vp-ce", megatron_vocab_parallel_ce,
    "Megatron at TP=P with SP: all-gather tokens, N x V/P logits, vocab-parallel CE"))
METHODS: list[Method] = [
    Method("ring-weights", ring("weights"), "weight shards circulate"),
    Method("ring-activations", ring("activations"), "tokens circulate, one return hop"),
    Method("ring-auto", ring("auto"), "activations if N <= V/P else weights"),
    Method("ring-auto-B/4", ring("auto", 4), "auto, each shard in 4 strips (block_size)"),
]


@dataclass
class Shape:
    hidden: int
    vocab_per_rank: int
    world: int
    tokens: int  # per rank

    @property
    def vocab(self) -> int:
        return self.vocab_per_rank * self.world

    @property
    def strip_bytes(self) -> int:
        return self.tokens * self.vocab_per_rank * 4


@dataclass
class Row:
    method: str
    peak_bytes: int
    forward_bytes: int
    backward_bytes: int
    seconds: float
    strips: float = 0.0
    vs: dict = field(default_factory=dict)  # baseline -> {"peak": ratio, "time": ratio}
    ledger: dict = field(default_factory=dict)  # CostLedger counts of one forward + backward


def _round8(value: float) -> int:
    return max(8, int(round(value / 8)) * 8)


def scaled_shapes(scale: float, world: int, tokens: Optional[list[int]],
                  hidden: Optional[int] = None, vocab_per_rank: Optional[int] = None
                  ) -> list[Shape]:
    hidden = hidden or _round8(PAPER["hidden"] / scale)
    per_rank = vocab_per_rank or _round8(PAPER["vocab"] / PAPER["world"] / scale)
    counts = tokens or [_round8(n / scale) for n in PAPER["tokens"]]
    return [Shape(hidden, per_rank, world, n) for n in counts]


def make_inputs(shape: Shape, dtype: torch.dtype, group, rank: int,
                block_size: Optional[int], device: torch.device) -> Inputs:
    gen = torch.Generator().manual_seed(1234)  # the same weight on every rank
    w_full = torch.randn(shape.vocab, shape.hidden, generator=gen) * shape.hidden ** -0.5
    rows = slice(rank * shape.vocab_per_rank, (rank + 1) * shape.vocab_per_rank)
    w_shard = w_full[rows].clone()
    gen.manual_seed(4321 + rank)  # this rank's tokens
    x = torch.randn(shape.tokens, shape.hidden, generator=gen)
    labels = torch.randint(0, shape.vocab, (shape.tokens,), generator=gen)
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).requires_grad_()

    labels = labels.to(device)
    labels_full = labels
    if group is not None:
        labels_full = labels.new_empty(shape.world * shape.tokens)
        dist.all_gather_into_tensor(labels_full, labels, group=group)
    return Inputs(
        x=leaf(x), w_shard=leaf(w_shard), w_full=leaf(w_full), labels=labels,
        group=group, rank=rank,
        world=shape.world, vocab_size=shape.vocab, vocab_per_rank=shape.vocab_per_rank,
        block_size=block_size, labels_full=labels_full,
    )


def _clear_grads(inp: Inputs) -> None:
    for leaf in inp.leaves():
        leaf.grad = None


def _slowest(value: float, op=dist.ReduceOp.MAX) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def measure_peak(method: Method, inp: Inputs) -> tuple[int, int, int]:
    """(whole, forward, backward) peak of one metered run, worst rank."""
    _clear_grads(inp)
    with MemoryMeter(inp.x.device) as meter:
        with meter.section("forward"):
            loss = method.run(inp)
        with meter.section("backward"):
            loss.sum().backward()
        del loss
    _clear_grads(inp)
    peaks = (meter.peak_device_bytes, meter.sections["forward"].peak_device_bytes,
             meter.sections["backward"].peak_device_bytes)
    return tuple(int(_slowest(float(p))) for p in peaks)


def count_once(method: Method, inp: Inputs) -> dict:
    """The cost ledger's counts of one forward + backward on this rank."""
    _clear_grads(inp)
    counts = count(lambda: method.run(inp).sum().backward())
    _clear_grads(inp)
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(method: Method, inp: Inputs) -> float:
    """Seconds of one unmetered forward + backward, slowest rank."""
    _clear_grads(inp)
    if dist.is_initialized():
        dist.barrier()
    _sync(inp.x.device)
    start = time.perf_counter()
    method.run(inp).sum().backward()
    _sync(inp.x.device)
    elapsed = _slowest(time.perf_counter() - start)
    _clear_grads(inp)
    return elapsed


def methods_for(shape: Shape, mtp_heads: int) -> tuple[list[Method], int]:
    """(every method run at this shape, how many of them are baselines)."""
    if shape.world > 1:
        tested = list(METHODS)
    else:
        tested = [Method("ring-blocked", ring("auto"), "the single-device version"),
                  Method("ring-blocked-B/4", ring("auto", 4), "each strip 1/4 of V")]
    baselines = list(BASELINES)
    if mtp_heads:
        suffix = f"+mtp{mtp_heads}"
        baselines.append(Method("megatron-vp-ce" + suffix,
                                with_mtp_heads(megatron_vocab_parallel_ce, mtp_heads),
                                f"megatron-vp-ce, main head + {mtp_heads} MTP head(s)"))
        tested.append(Method(("ring-auto" if shape.world > 1 else "ring-blocked") + suffix,
                             with_mtp_heads(ring("auto"), mtp_heads),
                             f"ring-auto, main head + {mtp_heads} MTP head(s)"))
    return baselines + tested, len(baselines)


def run_shape(shape: Shape, dtype, group, rank, reps, block_size, device,
              mtp_heads: int = 0) -> list[Row]:
    """Peaks, then ``reps`` timing rounds over all methods (interleaved, so load spikes on a
    shared machine hit every method alike); each method keeps its fastest round."""
    inp = make_inputs(shape, dtype, group, rank, block_size, device)
    methods, n_base = methods_for(shape, mtp_heads)
    for m in methods:  # one-time buffers (Megatron's all-gather buffer, ring plans) unmetered
        time_once(m, inp)
    peaks = [measure_peak(m, inp) for m in methods]
    counts = [count_once(m, inp) for m in methods]
    times = [[] for _ in methods]
    for _ in range(reps):
        for i, m in enumerate(methods):
            times[i].append(time_once(m, inp))
    rows = [Row(m.name, *pk, seconds=min(ts), ledger=c)
            for m, pk, ts, c in zip(methods, peaks, times, counts)]
    base = {r.method: r for r in rows[:n_base]}
    for row in rows:
        row.strips = row.peak_bytes / shape.strip_bytes
        row.vs = {name: {"peak": row.peak_bytes / max(b.peak_bytes, 1),
                         "time": row.seconds / max(b.seconds, 1e-12)}
                  for name, b in base.items()}
    return rows


def ring_bytes(row: Row) -> int:
    """Bytes this rank sent to its ring neighbour (point-to-point sends)."""
    return int(row.ledger.get("collective_bytes", {}).get("send", 0))


def record(shape: Shape, dtype_name: str, row: Row) -> dict:
    """One JSON record (see the module docstring for the keys)."""
    steps = 2 * (shape.world - 1)
    return {
        "method": row.method, "P": shape.world, "tokens": shape.tokens,
        "peak_bytes": row.peak_bytes, "strips": row.strips,
        "syncs": int(row.ledger.get("syncs", 0)), "flops": int(row.ledger.get("flops", 0)),
        "time_ms": 1e3 * row.seconds,
        "forward_bytes": row.forward_bytes, "backward_bytes": row.backward_bytes,
        "ring_bytes": ring_bytes(row),
        "ring_bytes_per_step": ring_bytes(row) // steps if steps else 0,
        "other_collective_bytes": int(row.ledger.get("other_collective_bytes", 0)),
        "hidden": shape.hidden, "vocab_per_rank": shape.vocab_per_rank,
        "strip_bytes": shape.strip_bytes, "dtype": dtype_name,
        "auto": resolve_mode("auto", shape.tokens, shape.vocab_per_rank, shape.world),
        "vs": row.vs,
    }


def print_table(shape: Shape, dtype_name: str, rows: list[Row], n_base: int) -> None:
    auto = resolve_mode("auto", shape.tokens, shape.vocab_per_rank, shape.world)
    print(f"\nP={shape.world} N_local={shape.tokens} H={shape.hidden} V={shape.vocab} "
          f"V/P={shape.vocab_per_rank} {dtype_name}; strip = N_local*V/P*4 = "
          f"{format_bytes(shape.strip_bytes)}; auto -> {auto}")
    names = [r.method for r in rows[:n_base]]
    head = f"{'method':22s}{'peak':>12s}{'strips':>8s}{'fwd':>12s}{'bwd':>12s}{'time s':>9s}"
    for n in names:
        w = max(12, len(n) + 6)
        head += f"{'peak/' + n:>{w}s}{'time/' + n:>{w}s}"
    print(head)
    for r in rows:
        line = (f"{r.method:22s}{format_bytes(r.peak_bytes):>12s}{r.strips:8.2f}"
                f"{format_bytes(r.forward_bytes):>12s}{format_bytes(r.backward_bytes):>12s}"
                f"{r.seconds:9.3f}")
        for n in names:
            v, w = r.vs[n], max(12, len(n) + 6)
            line += f"{v['peak']:{w}.3f}{v['time']:{w}.2f}"
        print(line)
    steps = 2 * (shape.world - 1)
    print("counts of one forward + backward (CostLedger, rank 0; FLOPs include the backward's "
          "recomputed strips; ring: bytes sent to the next rank, in all and per ring step)")
    print(f"{'method':22s}" + counts_header() + f"{'ring':>11s}{'ring/step':>11s}")
    for r in rows:
        per_step = ring_bytes(r) // steps if steps else 0
        print(f"{r.method:22s}" + counts_cells(r.ledger)
              + f"{format_bytes(ring_bytes(r)):>11s}{format_bytes(per_step):>11s}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=40.0,
                   help="divide the paper's per-rank shapes by this (default 40)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank (default: 16K and 32K / scale)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--block-size", type=int, default=None,
                   help="vocab rows per strip (default: the op's: whole shard, 8192 at P=1)")
    p.add_argument("--reps", type=int, default=2,
                   help="timed rounds per method (the fastest is kept)")
    p.add_argument("--hidden", type=int, default=None, help="override H")
    p.add_argument("--vocab-per-rank", type=int, default=None, help="override V/P")
    p.add_argument("--mtp-heads", type=int, default=1,
                   help="MTP heads of the +mtp rows (0: no MTP rows; default 1)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda for a one-GPU check of the blocked version, e.g. "
                        "--device cuda --tokens 32768 --hidden 7168 --vocab-per-rank 200000 "
                        "(untested: no GPU here)")
    p.add_argument("--json", default=None, help="write the list of records here (rank 0)")
    args = p.parse_args(argv)
    if args.mtp_heads < 0:
        p.error(f"--mtp-heads must be >= 0, got {args.mtp_heads}")
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """Every shape and method on this process's ring (call inside ``init_distributed``)."""
    from megatron_flat.megatron.cpu import enable_cpu_backend
    from megatron_flat.testing.distributed import megatron_layout

    device = torch.device(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    records = []
    shapes = scaled_shapes(args.scale, world, args.tokens, args.hidden, args.vocab_per_rank)
    enable_cpu_backend()
    # Megatron's parallel state at TP = P over the world (the megatron-vp-ce baseline).
    with megatron_layout(tp=world):
        for shape in shapes:
            rows = run_shape(shape, DTYPES[args.dtype], group, rank, args.reps,
                             args.block_size, device, args.mtp_heads)
            if rank == 0:
                print_table(shape, args.dtype, rows, methods_for(shape, args.mtp_heads)[1])
            records += [record(shape, args.dtype, r) for r in rows]
    return records


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    init_distributed()
    records = run(args)
    if dist.get_rank() == 0 and args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    return records


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
