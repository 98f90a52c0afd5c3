"""The planner against the memory meter at a second, larger scale (CPU, one process).

The tiny-model checks (``tests/plan/test_validation*.py``, ``benchmarks/planner_check.py``)
run shapes of a few thousand tokens·hidden. This runs one Megatron MoE GPT two orders of
magnitude larger — hidden 512, 8 layers, 16 experts top-2 (expert FFN 512), vocabulary
32,768, sequence 2,048, fp32, full recompute, world of one — and compares:

- the **baseline** terms (stock Megatron: its dispatcher, ``vocab_parallel_cross_entropy``,
  full recompute's boundaries, its optimizer step), target within ±5%;
- the **flat** terms, one technique on at a time (PipelinedLLEP with 4 chunks, Ring-DTP in
  8 strips, SCO with room for 6 of 8 boundaries, OffloadStreamAdamW with 1M-element buckets
  and 2 slots), target within −10…+30% (the planner may be above the meter: it takes each
  technique's documented bound, e.g. the hottest expert of a chunk at its bound).

Each figure is in the meter's definitions (``PeakReport.sections``; what each includes is
stated in the two test modules' docstrings, whose machinery this reuses: one definition of
the cases, the planner call and the meter). Run::

    TORCHDYNAMO_DISABLE=1 python benchmarks/planner_scale.py --json results/planner_scale.json

**CP 2 point.** Under torchrun with two ranks, ``--cp 2`` runs the same model with context
parallelism 2 (each rank holds two load-balanced chunks, 1,024 of the 2,048 tokens; DP 1;
attention through the CPU backend's ``ContextParallelCoreAttention``) and compares stock
Megatron's four terms, worst rank, with the planner's figures for ``Layout(cp=2)``::

    TORCHDYNAMO_DISABLE=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/planner_scale.py --cp 2 --json results/planner_scale_cp2.json

**The attention block (the fifth term).** Every point also compares the ``attention block``
section (each layer's self-attention, forward with the recompute and backward, above its
entry; ``plan.peaks.attention_block_section``) and Megatron's persistent sequence-parallel
gather buffer (``plan.peaks.sp_gather_buffer``), on the same model with flash-style core
attention (``cpu.flash_attention``: the planner models no N² scores; machinery in
``tests/plan/_attention_block.py``). At TP 1 stock's; under torchrun with two ranks,
``--tp 2`` runs TP 2 with sequence parallelism, stock (a baseline figure) and with the
attention tiles (512-token tiles), alone and beside Ring-DTP (flat figures)::

    TORCHDYNAMO_DISABLE=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/planner_scale.py --tp 2 --json results/planner_scale_tp2.json

Not validated here (GPU-only; on CPU the unfused reference path runs): the fused-kernel
widths (fused SwiGLU's 4F per route, fused AdamW's and clipping's zero scratch, bf16 logits'
fp32 copy), overlap (two chunks in flight, the ring's next hop), all-to-all buffers and
LLEP spills (EP > 1), the Ring-DTP ring (TP > 1), pinned memory and the CUDA caching
allocator's rounding (belongs in the fit margin), and the baselines that offload the
optimizer (HybridDeviceOptimizer's and FSDP2's host terms are counted from their code, not
metered here: ``benchmarks/optimizer.py`` measures HybridDeviceOptimizer's host bytes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests", "plan")

SHAPE = "h512-l8-e16-v32k-s2k"
MODEL = dict(num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
             num_experts=16, topk=2, moe_ffn_hidden_size=512, vocab_size=32_768,
             seq_length=2048)
BASELINE_TOLERANCE = 0.05
FLAT_BELOW, FLAT_ABOVE = -0.10, 0.30


ATTN_TILE = 512  # tokens per attention tile at the --tp 2 point: 4 tiles of the 2,048


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TESTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def flat_cases(flat):
    """One case per technique on the large shape (knobs: module docstring)."""
    flat.SHAPES[SHAPE] = MODEL
    boundary = MODEL["seq_length"] * MODEL["hidden_size"] * 4
    Case = flat.Case
    return [
        Case(SHAPE, "dispatch", dict(dispatch_chunk_tokens=512)),
        Case(SHAPE, "vocab", dict(vocab_block_size=4096)),
        Case(SHAPE, "sco", dict(sco_host_budget_gib=6.5 * boundary / (1 << 30))),
        Case(SHAPE, "optimizer", dict(optimizer_bucket_numel=1 << 20, optimizer_num_slots=2)),
    ]


def baseline_rows(base, flat):
    """Stock Megatron's sections, planned and measured."""
    from megatron_flat.plan import estimate
    from megatron_flat.plan.peaks import (
        METER_BOUNDARIES,
        METER_DISPATCH,
        METER_OPTIMIZER,
        METER_VOCAB,
    )

    tiny = base._tiny(MODEL)
    measured = base._measure(tiny)
    report = estimate(tiny.planner_spec(), base.tiny_layout(tiny), tiny.seq_length)
    return [flat.Row(f"{SHAPE}/stock", c, report.sections[c], measured[c])
            for c in (METER_DISPATCH, METER_VOCAB, METER_BOUNDARIES, METER_OPTIMIZER)]


def cp_baseline_rows(base, flat, cp: int):
    """Stock Megatron's four terms at context parallelism ``cp`` (world = CP), planned and
    measured (worst rank)."""
    from megatron_flat.plan import estimate
    from megatron_flat.plan.peaks import (
        METER_BOUNDARIES,
        METER_DISPATCH,
        METER_OPTIMIZER,
        METER_VOCAB,
    )
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer, measure_peaks

    tiny = base._tiny(MODEL)
    with megatron_layout(seed=tiny.seed, cp=cp):
        measured = measure_peaks(Trainer(tiny, TrainLayout(recompute="full", cp=cp)), steps=1)
    layout = base.tiny_layout(tiny).with_(cp=cp)
    report = estimate(tiny.planner_spec(), layout, tiny.seq_length)
    return [flat.Row(f"{SHAPE}/stock/cp{cp}", c, report.sections[c], measured[c])
            for c in (METER_DISPATCH, METER_VOCAB, METER_BOUNDARIES, METER_OPTIMIZER)]


def attention_rows(block, flat, tp: int):
    """The attention block and the gather buffer: stock (baseline) and, at TP > 1, with the
    attention tiles alone and beside Ring-DTP (flat)."""
    from megatron_flat.config import FlatConfig

    tiny = block.tiny_model(**{**MODEL, "micro_batch_size": 1, "global_batch_size": 1})
    where = f"{SHAPE}/tp{tp}" + ("/sp" if tp > 1 else "")
    cases = [("baseline", f"{where}/stock", None)]
    if tp > 1:
        cases += [("flat", f"{where}/attn_tiles={ATTN_TILE}", FlatConfig(attn_tiles=ATTN_TILE)),
                  ("flat", f"{where}/attn_tiles+vocab",
                   FlatConfig(attn_tiles=ATTN_TILE, vocab=True, vocab_block_size=4096))]
    out = {"baseline": [], "flat": []}
    for kind, case, cfg in cases:
        out[kind] += [flat.Row(c, figure, predicted, measured)
                      for c, figure, predicted, measured in block.rows(case, tiny, tp, cfg)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--only", choices=["baseline", "flat"], default=None)
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size; > 1: only the CP point (stock), run under "
                        "torchrun with CP ranks")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size; > 1: only the attention-block point (stock, "
                        "tiles, tiles + Ring-DTP), run under torchrun with TP ranks")
    args = p.parse_args()
    if args.tp > 1 and args.cp > 1:
        p.error("--tp and --cp are separate points: give one")

    import torch.distributed as dist

    from megatron_flat.cpu.backend import enable_cpu_backend
    from megatron_flat.testing.distributed import init_distributed

    world = init_distributed()
    ranks = args.cp * args.tp
    if world != ranks:
        flag = f"--cp {args.cp}" if args.cp > 1 else f"--tp {args.tp}"
        p.error(f"{flag} runs on {ranks} rank(s) (torchrun --nproc-per-node {ranks}); "
                f"this world has {world}")
    enable_cpu_backend()
    base, flat = _load("test_validation"), _load("test_validation_flat")
    block = _load("_attention_block")
    start = time.perf_counter()
    rows = {"baseline": [], "flat": []}
    if args.cp > 1:
        rows["baseline"] = cp_baseline_rows(base, flat, args.cp)
    elif args.tp > 1:
        rows = attention_rows(block, flat, args.tp)
    elif args.only != "flat":
        rows["baseline"] = baseline_rows(base, flat) + attention_rows(block, flat, 1)["baseline"]
    if args.only != "baseline" and args.cp == 1 and args.tp == 1:
        for case in flat_cases(flat):
            rows["flat"] += flat.compare(case, flat.plan(case), flat.measure_case(case))
    seconds = time.perf_counter() - start

    if dist.get_rank() != 0:  # rank 0 reports (every figure is already the worst rank's)
        dist.destroy_process_group()
        return 0

    def ok(kind, row):
        if row.component == block.METER_GATHER_BUFFER:  # a buffer's size: exactly
            return row.predicted == row.measured
        if kind == "baseline":
            return abs(row.error) <= BASELINE_TOLERANCE
        return FLAT_BELOW <= row.error <= FLAT_ABOVE

    where = ("world of one" if ranks == 1 else f"CP {args.cp} over {ranks} ranks, worst rank"
             if args.cp > 1 else f"TP {args.tp} with SP over {ranks} ranks, worst rank")
    print(f"planner vs memory meter at a second scale: {SHAPE} "
          f"({', '.join(f'{k}={v}' for k, v in MODEL.items())}), fp32, full recompute, "
          f"{where}; error = predicted / measured - 1")
    print(f"targets: baseline within ±{BASELINE_TOLERANCE:.0%}, flat within "
          f"{FLAT_BELOW:+.0%}…{FLAT_ABOVE:+.0%}, the gather buffer exactly")
    header = f"{'case':56s} {'component':36s} {'predicted':>13s} {'measured':>13s} {'error':>7s}"
    print(header)
    print("-" * len(header))
    failed = 0
    for kind in ("baseline", "flat"):
        for row in rows[kind]:
            good = ok(kind, row)
            failed += not good
            err = block.error(row.predicted, row.measured)
            print(f"{row.case:56s} {row.component:36s} {row.predicted:>13,d} "
                  f"{row.measured:>13,d} {err:>+7.1%}{'' if good else '  !'}")
    total = sum(len(v) for v in rows.values())
    print(f"{total - failed} of {total} figures within their target ({seconds:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "model": MODEL, "cp": args.cp, "tp": args.tp,
                       "seconds": round(seconds, 1),
                       "targets": {"baseline": BASELINE_TOLERANCE,
                                   "flat": [FLAT_BELOW, FLAT_ABOVE]},
                       "rows": [dict(kind=kind, case=r.case, component=r.component,
                                     predicted=r.predicted, measured=r.measured,
                                     error=block.error(r.predicted, r.measured),
                                     ok=ok(kind, r))
                                for kind in rows for r in rows[kind]]}, f, indent=2)
        print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
