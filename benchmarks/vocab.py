"""Vocabulary projection + cross-entropy, forward + backward: working set, counts, accuracy.

Compares, on each rank of a ring of P, one forward + backward of projection + per-token
cross-entropy for the methods (``--json`` names in brackets)

* ``dense``: full ``N_local x V`` logits on every rank (``x @ W.T``, upcast, cross-entropy;
  needs the whole ``V x H`` weight and produces its whole gradient) — the baseline;
* ``megatron``: Megatron's own output layer + loss at TP = P with sequence parallelism —
  ``ColumnParallelLinear``'s function (all-gather of the P ranks' tokens, ``[N, V/P]``
  logits from the rank's shard, ``N = P * N_local``) and
  ``tensor_parallel.vocab_parallel_cross_entropy`` over the group — the second baseline;
* ``ring``: :func:`ring_dtp_cross_entropy` (``auto`` schedule) over the P ranks, each holding
  ``V/P`` rows, whole strips (one per shard; at P = 1 the blocked version, 8192-row strips);
* ``ring-tiled``: the same with token tiles of ``--tile-bytes`` (each strip computed a tile of
  tokens at a time: the working set no longer grows with N);
* ``liger``: Liger's fused linear cross-entropy (token chunks), ``cce``: Cut Cross-Entropy
  (token x vocabulary tiles in Triton, no logits written) — the peers, optional extras of the
  benchmark (``benchmarks/vocab_peers.py`` says how they run on CPU and what is counted);
* ``--schedules``: also ``ring-weights``, ``ring-activations`` and ``ring-B/4`` (each shard
  cut into 4 strips); ``--mtp-heads D``: ``megatron+mtpD`` and ``ring-tiled+mtpD`` run the
  projection + loss 1 + D times per step (the main head and D heads on labels shifted by
  1..D, as Megatron's MTP loop does): Megatron keeps every head's fp32 softmax until the
  backward, Ring-DTP only each head's lse.

Per row: the meter's peak (bytes and strips, ``N_local * V/P * 4`` bytes) and its
**transient**: the peak less what every method must hold whatever it does — the returned
gradients (as returned: the rank's dX and its dW), for half inputs an fp32 dX accumulator
(``4·N·H``), and 5 words per token (the loss and its gradient, log-sum-exp, mask and
coefficient: the contract's O(N) per-token vectors; a method holding less shows a negative
transient) —
and the transient's slope against N (bytes per token, over the sweep);
the cost ledger's FLOPs, ops, bytes moved (by torch ops: a Triton kernel counts as one op
with its FLOPs, not its bytes), ring bytes and syncs of one forward + backward
(the ring methods pass a ``plan_key`` as the Megatron module does, so the counted call is
the steady state: no plan gather, no host sync); the largest error of the loss, dX and dW
against a float64 dense reference, relative to the reference's largest magnitude (dW: the
rank's shard of the gradient of every rank's tokens for ``megatron`` and the ring, the
whole gradient of the rank's tokens for the single-device methods), worst rank; and whether
a second run is bitwise equal. ``--json PATH`` writes one record per (method, P, tokens):
``method, P, tokens, peak_bytes, transient_bytes, strips, flops, ops, syncs, err_loss,
err_dx, err_dw, bitwise_rerun`` and more (forward/backward peaks, ring bytes, the slope,
the ratios to each baseline, ``time_ms``: fastest of ``--reps``, slowest rank; null for the
interpreted peers). A row not run (a peer not installed, or above its size cap) is printed
with the reason and has no record.

Shapes are the paper's per-rank shapes (H = 7168, V = 200,000 over P = 8, so V/P = 25,000)
divided by ``--scale`` (default 40: H = 176, V/P = 624), so that one strip stays large
against ``N_local x H`` as there; ``--tokens`` sets N_local. ``--tile-bytes`` defaults to
``FlatConfig.vocab_tile_bytes / scale**2``: a tile then holds the tokens it holds at the
paper's shape, divided by the scale like every other size. Run::

    python benchmarks/vocab.py --tokens 1024 2048 4096 8192 16384 --dtype fp32
    torchrun --nproc-per-node 4 benchmarks/vocab.py --tokens 1024 4096 --json results/vocab.json
    torchrun --nproc-per-node 8 benchmarks/vocab.py --scale 160 --reps 1   # the paper's P
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
from megatron_flat.runtime.ledger import CostLedger, counts_cells, counts_header
from megatron_flat.runtime.memory import format_bytes
from megatron_flat.testing.distributed import init_distributed
from megatron_flat.vocab import resolve_mode, ring_dtp_cross_entropy

PAPER = dict(hidden=7168, vocab=200_000, world=8, tokens=(16 * 1024, 32 * 1024))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Per-token vectors the working-set contract leaves out: the loss and its gradient, and three
# words of per-token state (log-sum-exp, mask, coefficient: what Ring-DTP keeps).
PER_TOKEN_WORDS = 5


@dataclass
class Inputs:
    """One rank's problem in one dtype. Leaves are built before the meter opens."""

    x: torch.Tensor  # [N_local, H], requires grad
    w_shard: torch.Tensor  # [V/P, H], this rank's rows, requires grad
    w_full: torch.Tensor  # [V, H] (the single-device methods' weight), requires grad
    labels: torch.Tensor  # [N_local]
    group: Optional[dist.ProcessGroup]  # the ring (None when P = 1)
    rank: int
    world: int
    vocab_size: int
    vocab_per_rank: int
    block_size: Optional[int]
    tile_bytes: Optional[int] = None  # ring-tiled's tiles
    labels_full: Optional[torch.Tensor] = None  # [P * N_local]: every rank's, in rank order

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.w_shard, self.w_full)


@dataclass
class Method:
    """A projection + loss: ``run(inputs) -> per-token loss [N_local]`` (backward is ours).

    ``weight``: the leaf whose gradient is its dW (``shard``: the rank's V/P rows, holding
    every rank's tokens' gradient; ``full``: the whole weight, this rank's tokens only);
    ``dtype``: inputs in this dtype whatever ``--dtype`` is (Cut Cross-Entropy: fp16);
    ``interpreted``: its kernels run in Triton's interpreter on CPU (not timed there);
    ``max_tokens`` / ``max_logits``: not run above these sizes (the interpreter's speed)."""

    name: str
    run: Callable[[Inputs], torch.Tensor]
    note: str = ""
    weight: str = "full"
    dtype: Optional[torch.dtype] = None
    interpreted: bool = False
    max_tokens: Optional[int] = None
    max_logits: Optional[int] = None
    heads: int = 0  # MTP heads beside the main one (no fp64 reference: errors not reported)
    all_tokens: bool = False  # returns every rank's tokens' loss (Megatron's TP layout)

    def skip_reason(self, shape: "Shape") -> str:
        vocab = shape.vocab
        if self.max_tokens is not None and shape.tokens > self.max_tokens:
            return f"N_local {shape.tokens} > --peer-max-tokens {self.max_tokens}"
        if self.max_logits is not None and shape.tokens * vocab > self.max_logits:
            return (f"N_local x V = {shape.tokens * vocab} > --cce-max-logits "
                    f"{self.max_logits}")
        return ""


def dense_cross_entropy(inp: Inputs) -> torch.Tensor:
    logits = inp.x @ inp.w_full.t()
    return F.cross_entropy(logits.float(), inp.labels, reduction="none")


def ring(mode: str, strips_per_shard: int = 0, tiled: bool = False
         ) -> Callable[[Inputs], torch.Tensor]:
    """Ring-DTP in ``mode``; ``strips_per_shard`` > 0 cuts each shard into that many strips
    (else ``--block-size``, else the op's default: the whole shard); ``tiled``: token tiles
    of ``--tile-bytes``."""
    def run(inp: Inputs, shift: int = 0) -> torch.Tensor:
        block = inp.block_size
        if strips_per_shard:
            block = -(-inp.vocab_per_rank // strips_per_shard)
        tile = inp.tile_bytes if tiled else None
        labels = torch.roll(inp.labels, -shift) if shift else inp.labels
        return ring_dtp_cross_entropy(
            inp.x, inp.w_shard, labels, group=inp.group,
            mode=mode, vocab_size=inp.vocab_size, block_size=block, tile_bytes=tile,
            plan_key=("bench", mode, block, tile, tuple(inp.x.shape), inp.x.dtype))
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
    Ring-DTP); returns the loss of all N = P * N_local tokens, every rank's in rank order.

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
    # Every TP rank holds the loss of all N tokens and back-propagates all of it, as in
    # Megatron (a rank's slice alone would leave its shard's gradient of the others' tokens
    # out); the errors compare this rank's rows (``Method.all_tokens``).
    return loss[:, 0]


def _peers_module():
    """``benchmarks/vocab_peers.py``, found beside this file however this one was loaded."""
    import importlib.util
    import sys

    if "vocab_peers" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vocab_peers.py")
        spec = importlib.util.spec_from_file_location("vocab_peers", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["vocab_peers"] = module
        spec.loader.exec_module(module)
    return sys.modules["vocab_peers"]


def _peer(name: str, run: Callable) -> Callable[[Inputs], torch.Tensor]:
    def call(inp: Inputs) -> torch.Tensor:
        return run(inp.x, inp.w_full, inp.labels)
    call.__name__ = name
    return call


def methods_for(args: argparse.Namespace, device: torch.device) -> tuple[list[Method], int]:
    """(every method of this run, how many of them are baselines: the first ones)."""
    if args.peers and device.type != "cuda":  # before Triton decorates any kernel
        os.environ.setdefault("TRITON_INTERPRET", "1")
    load = _peers_module().load if args.peers else None

    methods = [
        Method("dense", dense_cross_entropy, "full N_local x V logits and V x H weight grad"),
        Method("megatron", megatron_vocab_parallel_ce,
               "Megatron at TP=P with SP: all-gather tokens, N x V/P logits, vocab-parallel CE",
               weight="shard", all_tokens=True),
    ]
    n_base = len(methods)
    methods += [
        Method("ring", ring("auto"), "whole strips (auto schedule)", weight="shard"),
        Method("ring-tiled", ring("auto", tiled=True), "token tiles of --tile-bytes",
               weight="shard"),
    ]
    if args.schedules:
        methods += [
            Method("ring-weights", ring("weights"), "weight shards circulate", weight="shard"),
            Method("ring-activations", ring("activations"), "tokens circulate",
                   weight="shard"),
            Method("ring-B/4", ring("auto", 4), "auto, each shard in 4 strips",
                   weight="shard"),
        ]
    if args.peers:
        interpreted = device.type != "cuda"
        for name, (run, why) in load(device).items():
            if run is None:
                if dist.get_rank() == 0:
                    print(f"# {name}: not run: {why}")
                continue
            methods.append(Method(
                name, _peer(name, run), why, interpreted=interpreted,
                dtype=torch.float16 if name == "cce" else None,
                max_tokens=args.peer_max_tokens,
                max_logits=args.cce_max_logits if name == "cce" and interpreted else None))
    if args.mtp_heads:
        d = args.mtp_heads
        methods += [
            Method(f"megatron+mtp{d}", with_mtp_heads(megatron_vocab_parallel_ce, d),
                   f"megatron, main head + {d} MTP head(s)", weight="shard", heads=d,
                   all_tokens=True),
            Method(f"ring-tiled+mtp{d}", with_mtp_heads(ring("auto", tiled=True), d),
                   f"ring-tiled, main head + {d} MTP head(s)", weight="shard", heads=d),
        ]
    return methods, n_base


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
    dtype: str
    peak_bytes: int
    forward_bytes: int
    backward_bytes: int
    transient_bytes: int
    seconds: Optional[float]
    errors: dict  # loss, dx, dw -> largest error relative to the fp64 reference's scale
    bitwise_rerun: bool
    ledger: dict = field(default_factory=dict)  # CostLedger counts of one forward + backward
    strips: float = 0.0
    vs: dict = field(default_factory=dict)  # baseline -> {"peak": ratio, "time": ratio}


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
                block_size: Optional[int], device: torch.device,
                tile_bytes: Optional[int] = None) -> Inputs:
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
        block_size=block_size, tile_bytes=tile_bytes, labels_full=labels_full,
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


def reference(inp: Inputs) -> dict:
    """The float64 dense reference from the leaves' own values: this rank's per-token loss,
    dX, dW of its tokens (``full``) and the rank's rows of dW of every rank's tokens
    (``shard``; summed over the ring). Token chunks keep the float64 logits small."""
    x, w = inp.x.detach().double(), inp.w_full.detach().double()
    n, vocab = x.shape[0], w.shape[0]
    loss, dx = torch.empty(n, dtype=torch.float64, device=x.device), torch.empty_like(x)
    dw = torch.zeros_like(w)
    step = max(1, 2**22 // vocab)
    for t0 in range(0, n, step):
        t1 = min(t0 + step, n)
        logits = x[t0:t1] @ w.t()
        lse = torch.logsumexp(logits, dim=1)
        labels = inp.labels[t0:t1]
        loss[t0:t1] = lse - logits.gather(1, labels[:, None])[:, 0]
        grad = torch.softmax(logits, dim=1)
        grad[torch.arange(t1 - t0), labels] -= 1
        dx[t0:t1] = grad @ w
        dw += grad.t() @ x[t0:t1]
    every = dw.clone()
    if inp.group is not None:
        dist.all_reduce(every, group=inp.group)
    rows = slice(inp.rank * inp.vocab_per_rank, (inp.rank + 1) * inp.vocab_per_rank)
    return {"loss": loss, "dx": dx, "full": dw, "shard": every[rows]}


def _error(value: Optional[torch.Tensor], ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude (worst rank)."""
    if value is None:
        return float("nan")
    # on the reference's device: a CUDA run's values against a reference made elsewhere
    value = value.detach().to(ref.device).double()
    err = float((value - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
    return _slowest(err)


def _outputs(method: Method, inp: Inputs, loss: torch.Tensor) -> tuple:
    weight = inp.w_shard if method.weight == "shard" else inp.w_full
    if method.all_tokens:
        n = inp.x.shape[0]
        loss = loss[inp.rank * n: (inp.rank + 1) * n]
    return loss.detach().clone(), inp.x.grad, weight.grad


def _bitwise(a: tuple, b: tuple) -> bool:
    same = all(u is not None and v is not None and torch.equal(u, v) for u, v in zip(a, b))
    return bool(_slowest(0.0 if same else 1.0) == 0.0)


def measure(method: Method, inp: Inputs) -> tuple:
    """One warm-up run (one-time buffers: Megatron's all-gather buffer, ring plans), then one
    run under the meter and the ledger; their outputs compared bitwise (the rerun check).
    Returns (outputs, (whole, forward, backward) peaks worst rank, transient, counts)."""
    _clear_grads(inp)
    loss = method.run(inp)
    loss.sum().backward()
    first = _outputs(method, inp, loss)
    del loss
    _clear_grads(inp)
    with MemoryMeter(inp.x.device) as meter, CostLedger() as ledger:
        with meter.section("forward"):
            loss = method.run(inp)
        with meter.section("backward"):
            loss.sum().backward()
    second = _outputs(method, inp, loss)
    del loss
    returned = sum(g.numel() * g.element_size() for g in second[1:] if g is not None)
    n, h = inp.x.shape
    # An fp32 dX accumulator is needed beside the returned dX only for half inputs.
    accumulator = 4 * n * h if inp.x.dtype.itemsize < 4 else 0
    floor = returned + accumulator + PER_TOKEN_WORDS * 4 * n
    counts = ledger.as_dict()
    counts.pop("sections", None)
    peaks = (meter.peak_device_bytes, meter.sections["forward"].peak_device_bytes,
             meter.sections["backward"].peak_device_bytes)
    peaks = tuple(int(_slowest(float(p))) for p in peaks)
    transient = int(_slowest(float(meter.peak_device_bytes - floor)))
    _clear_grads(inp)
    return second, _bitwise(first, second), peaks, transient, counts


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


def run_shape(shape: Shape, methods: list[Method], n_base: int, dtype: torch.dtype,
              group, rank: int, args: argparse.Namespace, device: torch.device) -> list[Row]:
    """Every method at one shape: measured, checked against fp64, timed (``args.reps``
    rounds, interleaved so load spikes on a shared machine hit every method alike)."""
    inputs: dict = {}
    refs: dict = {}

    def inputs_for(dt: torch.dtype) -> Inputs:
        if dt not in inputs:
            inputs[dt] = make_inputs(shape, dt, group, rank, args.block_size, device,
                                     args.tile_bytes)
            refs[dt] = reference(inputs[dt])
        return inputs[dt]

    rows, timed = [], []
    for m in methods:
        if m.skip_reason(shape):  # the same on every rank: it depends on the shape only
            if rank == 0:
                print(f"# {m.name} at N_local={shape.tokens}: not run ({m.skip_reason(shape)})")
            continue
        dt = m.dtype or dtype
        inp = inputs_for(dt)
        outs, same, peaks, transient, counts = measure(m, inp)
        ref = refs[dt]
        errors = {"loss": float("nan"), "dx": float("nan"), "dw": float("nan")}
        if not m.heads:
            errors = {"loss": _error(outs[0], ref["loss"]), "dx": _error(outs[1], ref["dx"]),
                      "dw": _error(outs[2], ref[m.weight])}
        name = {v: k for k, v in DTYPES.items()}[dt]
        rows.append(Row(m.name, name, *peaks, transient_bytes=transient, seconds=None,
                        errors=errors, bitwise_rerun=same, ledger=counts))
        timed.append((rows[-1], m, inp))
    times: dict = {}
    for _ in range(args.reps):
        for row, m, inp in timed:
            if not (m.interpreted and device.type != "cuda"):  # the interpreter: not timed
                times.setdefault(row.method, []).append(time_once(m, inp))
    for row in rows:
        row.seconds = min(times[row.method]) if row.method in times else None
        row.strips = row.peak_bytes / shape.strip_bytes
    base = {r.method: r for r in rows if r.method in [m.name for m in methods[:n_base]]}
    for row in rows:
        row.vs = {name: {"peak": row.peak_bytes / max(b.peak_bytes, 1),
                         "time": (row.seconds / max(b.seconds, 1e-12)
                                  if row.seconds is not None and b.seconds else None)}
                  for name, b in base.items()}
    return rows


def ring_bytes(row: Row) -> int:
    """Bytes this rank sent to its ring neighbour (point-to-point sends)."""
    return int(row.ledger.get("collective_bytes", {}).get("send", 0))


def _finite(value: float) -> Optional[float]:
    return None if value != value else value  # NaN (not measured) -> null in JSON


def record(shape: Shape, row: Row) -> dict:
    """One JSON record (see the module docstring for the keys)."""
    steps = 2 * (shape.world - 1)
    return {
        "method": row.method, "P": shape.world, "tokens": shape.tokens,
        "peak_bytes": row.peak_bytes, "transient_bytes": row.transient_bytes,
        "strips": row.strips, "transient_strips": row.transient_bytes / shape.strip_bytes,
        "flops": int(row.ledger.get("flops", 0)), "ops": int(row.ledger.get("ops", 0)),
        "mem_bytes": int(row.ledger.get("mem_bytes", 0)),
        "syncs": int(row.ledger.get("syncs", 0)),
        "err_loss": _finite(row.errors["loss"]), "err_dx": _finite(row.errors["dx"]),
        "err_dw": _finite(row.errors["dw"]), "bitwise_rerun": row.bitwise_rerun,
        "time_ms": None if row.seconds is None else 1e3 * row.seconds,
        "forward_bytes": row.forward_bytes, "backward_bytes": row.backward_bytes,
        "ring_bytes": ring_bytes(row),
        "ring_bytes_per_step": ring_bytes(row) // steps if steps else 0,
        "other_collective_bytes": int(row.ledger.get("other_collective_bytes", 0)),
        "hidden": shape.hidden, "vocab_per_rank": shape.vocab_per_rank,
        "strip_bytes": shape.strip_bytes, "dtype": row.dtype,
        "auto": resolve_mode("auto", shape.tokens, shape.vocab_per_rank, shape.world),
        "vs": row.vs,
    }


def add_slopes(records: list[dict]) -> None:
    """Each record gains its method's transient slope over the tokens sweep at its P (bytes
    per token, smallest to largest N) and ``transient_growth``: the largest N's transient
    over the smallest's (1.0: flat)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["method"], r["P"]), []).append(r)
    for group in groups.values():
        lo = min(group, key=lambda r: r["tokens"])
        hi = max(group, key=lambda r: r["tokens"])
        span = hi["tokens"] - lo["tokens"]
        slope = (hi["transient_bytes"] - lo["transient_bytes"]) / span if span else None
        growth = hi["transient_bytes"] / lo["transient_bytes"] if lo["transient_bytes"] > 0 \
            else None
        for r in group:
            r["transient_slope"] = slope
            r["transient_growth"] = growth


def _err(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1e}"


def print_table(shape: Shape, rows: list[Row], baselines: list[str], tile_bytes: int) -> None:
    auto = resolve_mode("auto", shape.tokens, shape.vocab_per_rank, shape.world)
    print(f"\nP={shape.world} N_local={shape.tokens} H={shape.hidden} V={shape.vocab} "
          f"V/P={shape.vocab_per_rank}; strip = N_local*V/P*4 = "
          f"{format_bytes(shape.strip_bytes)}; tile {format_bytes(tile_bytes)}; "
          f"auto -> {auto}")
    head = (f"{'method':18s}{'dtype':>6s}{'peak':>11s}{'strips':>8s}{'transient':>11s}"
            f"{'t.strips':>9s}{'err loss':>9s}{'err dX':>9s}{'err dW':>9s}{'rerun':>7s}"
            f"{'time s':>8s}")
    for n in baselines:
        head += f"{'peak/' + n:>{max(11, len(n) + 6)}s}"
    print(head)
    for r in rows:
        rec = record(shape, r)
        line = (f"{r.method:18s}{r.dtype:>6s}{format_bytes(r.peak_bytes):>11s}"
                f"{r.strips:8.2f}{format_bytes(r.transient_bytes):>11s}"
                f"{rec['transient_strips']:9.3f}{_err(rec['err_loss']):>9s}"
                f"{_err(rec['err_dx']):>9s}{_err(rec['err_dw']):>9s}"
                f"{'equal' if r.bitwise_rerun else 'DIFFER':>7s}"
                f"{'-' if r.seconds is None else f'{r.seconds:.3f}':>8s}")
        for n in baselines:
            line += f"{r.vs[n]['peak']:{max(11, len(n) + 6)}.3f}"
        print(line)
    steps = 2 * (shape.world - 1)
    print("counts of one forward + backward (CostLedger, rank 0; FLOPs include the backward's "
          "recomputed strips; mem: bytes the ops read and write; ring: bytes sent to the "
          "next rank, in all and per ring step)")
    print(f"{'method':18s}" + counts_header() + f"{'mem':>11s}{'ring':>11s}{'ring/step':>11s}")
    for r in rows:
        per_step = ring_bytes(r) // steps if steps else 0
        print(f"{r.method:18s}" + counts_cells(r.ledger)
              + f"{format_bytes(int(r.ledger.get('mem_bytes', 0))):>11s}"
              + f"{format_bytes(ring_bytes(r)):>11s}{format_bytes(per_step):>11s}")


def print_sweep(records: list[dict]) -> None:
    """The transient of every method against N at this P, and its slope."""
    by: dict = {}
    for r in records:
        by.setdefault(r["method"], {})[r["tokens"]] = r
    tokens = sorted({r["tokens"] for r in records})
    if len(tokens) < 2:
        return
    print(f"\ntransient against N_local at P={records[0]['P']} (bytes; slope: bytes per token; "
          "growth: largest N over smallest)")
    print(f"{'method':18s}" + "".join(f"{n:>11d}" for n in tokens)
          + f"{'slope':>10s}{'growth':>8s}")
    for name, cells in by.items():
        line = f"{name:18s}" + "".join(
            f"{format_bytes(cells[n]['transient_bytes']) if n in cells else '-':>11s}"
            for n in tokens)
        any_r = next(iter(cells.values()))
        slope, growth = any_r.get("transient_slope"), any_r.get("transient_growth")
        line += f"{'-' if slope is None else f'{slope:.1f}':>10s}"
        line += f"{'-' if growth is None else f'{growth:.2f}':>8s}"
        print(line)


def default_tile_bytes(scale: float) -> int:
    """``FlatConfig.vocab_tile_bytes`` scaled as the shapes are: the tile's tokens and its
    strip's width both divide by the scale, its bytes by the scale squared."""
    from megatron_flat.config import FlatConfig

    return max(1, int(FlatConfig().vocab_tile_bytes / scale**2))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=40.0,
                   help="divide the paper's per-rank shapes by this (default 40)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank, e.g. 1024 2048 4096 8192 16384 (default: 16K and "
                        "32K / scale)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tile-bytes", type=int, default=None,
                   help="ring-tiled's tile (default: FlatConfig.vocab_tile_bytes / scale**2)")
    p.add_argument("--block-size", type=int, default=None,
                   help="vocab rows per strip (default: the op's: whole shard, 8192 at P=1)")
    p.add_argument("--reps", type=int, default=1,
                   help="timed rounds per method (the fastest is kept; 0: not timed)")
    p.add_argument("--hidden", type=int, default=None, help="override H")
    p.add_argument("--vocab-per-rank", type=int, default=None, help="override V/P")
    p.add_argument("--schedules", action="store_true",
                   help="also ring-weights, ring-activations and ring-B/4")
    p.add_argument("--mtp-heads", type=int, default=0,
                   help="MTP heads of the +mtp rows (default 0: no MTP rows)")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="leave out liger and cce")
    p.add_argument("--peer-max-tokens", type=int, default=16384,
                   help="the peers are not run above this N_local (Triton's interpreter on "
                        "CPU runs a Liger row in milliseconds)")
    p.add_argument("--cce-max-logits", type=int, default=2**20,
                   help="on CPU, cce is not run above this N_local x V (its interpreted "
                        "backward takes ~30 s at 1024 x 625)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda for a one-GPU check of the blocked version, e.g. "
                        "--device cuda --tokens 32768 --hidden 7168 --vocab-per-rank 200000 "
                        "(untested: no GPU here)")
    p.add_argument("--json", default=None, help="write the list of records here (rank 0)")
    args = p.parse_args(argv)
    if args.mtp_heads < 0:
        p.error(f"--mtp-heads must be >= 0, got {args.mtp_heads}")
    if args.tile_bytes is None:
        args.tile_bytes = default_tile_bytes(args.scale)
    if args.tile_bytes < 1:
        p.error(f"--tile-bytes must be >= 1, got {args.tile_bytes}")
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """Every shape and method on this process's ring (call inside ``init_distributed``)."""
    from megatron_flat.cpu.backend import enable_cpu_backend
    from megatron_flat.testing.distributed import megatron_layout

    device = torch.device(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    records = []
    shapes = scaled_shapes(args.scale, world, args.tokens, args.hidden, args.vocab_per_rank)
    methods, n_base = methods_for(args, device)
    enable_cpu_backend()
    # Megatron's parallel state at TP = P over the world (the megatron baseline).
    with megatron_layout(tp=world):
        for shape in shapes:
            rows = run_shape(shape, methods, n_base, DTYPES[args.dtype], group, rank, args,
                             device)
            if rank == 0:
                print_table(shape, rows, [m.name for m in methods[:n_base]], args.tile_bytes)
            records += [record(shape, r) for r in rows]
    add_slopes(records)
    if rank == 0:
        print_sweep(records)
    return records


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if args.peers and not args.device.startswith("cuda"):
        # Before anything imports Triton: it decides then whether kernels are interpreted.
        os.environ.setdefault("TRITON_INTERPRET", "1")
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
