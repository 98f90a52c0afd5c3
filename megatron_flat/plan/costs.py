"""Per-layer cost counts at a real scale, in the ledger's terms, for the step-time model.

The planner cannot run a 667B model, so it evaluates the counts the
:class:`~megatron_flat.runtime.ledger.CostLedger` would report, from the model shape, the
layout, the sequence length and the knobs, per GPU of the worst pipeline stage and per
microbatch (the optimizer: per step). ``unit_costs`` returns, for each technique's unit,
``(counts, Overlap)`` for the baseline and for megatron-flat; ``plan.time.predict`` turns
them into predicted seconds.

How counts scale from one layer to the model: every per-route, per-token and per-strip
term below is written for one layer and one microbatch, then multiplied by the stage's MoE
layer count (dispatch) or taken once (vocabulary: last stage; optimizer: per step). The
FLOP and byte formulas are exact for the schedules as written and are checked against the
ledger's counts on the tiny model (``tests/plan/test_costs_world2.py``); the sync and
launch counts per layer are the ledger's counts of the landed code (``SYNCS_*`` /
``OPS_*`` below, pinned by the same test), which do not grow with tokens.

Symbols: H, F, E, k, V as in ``peaks.py``; N tokens per CP rank, N_sp per TP rank in the
MoE/norm regions; σ the routing skew of plain EP, σ' after LLEP; r = σ·k·N_sp routes the
hottest EP rank computes; b bytes per value; u = 2·H·F FLOPs, the unit of expert work per
route (fc1 is 2u gated, u plain; fc2 is u).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from megatron_flat.config import FlatConfig
from megatron_flat.plan.model import Layout, ModelSpec, stage_layers
from megatron_flat.plan.peaks import PeakReport, _skew_baseline, _skew_llep, stage_params
from megatron_flat.plan.time import Overlap, overlap_for

__all__ = ["unit_costs", "UNITS", "expert_units", "attention_flops"]

UNITS = ("dispatch", "vocab", "boundaries", "optimizer")

# Host syncs per MoE layer and pass, counted by the ledger on the landed code at EP = 2
# (benchmarks/ledger.py; pinned by tests/plan/test_costs_world2.py). Megatron's alltoall
# dispatcher reads the split sizes once per forward; PipelinedLLEP reads the global counts
# for its plan once per forward and the chunk's split sizes per chunk.
SYNCS_STOCK_FORWARD = 5
SYNCS_STOCK_BACKWARD = 2
SYNCS_FLAT_FORWARD = 9
SYNCS_FLAT_FORWARD_PER_CHUNK = 2
SYNCS_FLAT_BACKWARD_PER_CHUNK = 2
# aten ops (kernel launches) per MoE layer: a fixed part per pass and a part per local
# expert (SequentialMLP and PipelinedLLEP run one expert at a time), per chunk for flat.
OPS_STOCK_FORWARD = 60
OPS_STOCK_FORWARD_PER_EXPERT = 12
OPS_STOCK_BACKWARD_PER_EXPERT = 16
OPS_FLAT_FORWARD = 60
OPS_FLAT_PER_CHUNK = 30
OPS_FLAT_PER_CHUNK_EXPERT = 14
OPS_FLAT_BACKWARD_PER_CHUNK_EXPERT = 28
# Ring-DTP: the fold per strip (forward) and the recompute + grads per strip (backward).
OPS_RING_PER_STRIP = 12
OPS_RING_BACKWARD_PER_STRIP = 24
OPS_VOCAB_STOCK = 40
# AdamW, per bucket (flat: upload, update, write back) or per parameter tensor (stock).
OPS_ADAM_PER_TENSOR = 12
OPS_ADAM_PER_BUCKET = 20
# Bytes AdamW reads and writes per parameter: bf16 param (2) + fp32 grad (4) + master,
# m, v (12) read; master, m, v (12) + bf16 param (2) written.
ADAM_MEM_BYTES_PER_PARAM = 32
# OffloadStreamAdamW moves per parameter: up master, m, v and the fp32 grad (16 B; the
# grad already sits on the device, see the host-tier issue), back master, m, v (12 B).
OFFLOAD_H2D_BYTES_PER_PARAM = 16
OFFLOAD_D2H_BYTES_PER_PARAM = 12
PROB_BYTES = 4


def expert_units(model: ModelSpec) -> Tuple[int, int]:
    """(fc1, fc2) work per route in units of u = 2·H·F: (2, 1) gated, (1, 1) plain."""
    return (2, 1) if model.gated else (1, 1)


def attention_flops(model: ModelSpec, layout: Layout, seq_len: int, n: int) -> float:
    """Forward FLOPs of one attention layer on one GPU: projections 2·N·P_attn/TP and
    causal scores + weighted values 2·2·N·(S/2)·h·d/TP (each of the N local queries sees
    on average half of the S·mbs keys)."""
    proj = 2 * n * model.attention_params_per_layer() / layout.tp
    keys = seq_len * layout.micro_batch_size / 2
    core = 2 * 2 * n * keys * model.heads * max(model.head_dim, model.dv) / layout.tp
    return proj + core


def _moe_layers(model: ModelSpec, layout: Layout, stage: int) -> int:
    first, count = stage_layers(model, layout)[stage]
    return sum(1 for i in range(first, first + count) if model.is_moe_layer(i))


def _dispatch(model: ModelSpec, layout: Layout, report: PeakReport,
              flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """One microbatch of the stage's MoE layers, forward + full recompute + backward.

    Baseline (alltoall dispatcher): expert work (3 + 3 + 6)·u per route (gated; 2 + 2 + 4
    plain) on r = σ·k·N_sp routes; all-to-all per route sent off-rank ((EP−1)/EP of the
    k·N_sp routes): forward and recompute each dispatch H·b + 4 (its fp32 probability) and
    combine H·b; backward sends the output gradient H·b and the input gradient H·b.

    PipelinedLLEP (recompute of every chunk in its backward, or the first s of K kept):
    the same passes on r' = σ'·k·N_sp routes, + fc1 once more per recomputed chunk
    (2u·(1 − s/K) per route); forward and recompute each move (H·b + 4) + H·b per route;
    backward re-sends the token with its output gradient (2·H·b + 4) and returns the input
    and probability gradients (H·b + 4). LLEP's weight transfers: the hottest rank's excess
    (σ − σ')·k·N_sp routes leave with whole experts, about E_l·(σ − σ')/σ of them, each
    3·H·F·b out and its fp32 gradient back, per pass that computes (forward, recompute,
    backward).
    """
    layers = _moe_layers(model, layout, report.stage)
    if not model.experts or not layers:
        return {}, overlap_for("moe", "stock")
    H, F, k, b = model.hidden, model.expert_ffn, model.topk, model.bytes_per_value
    n_sp, ep = report.tokens_sp, layout.ep
    e_local = model.experts // ep
    fc1, fc2 = expert_units(model)
    u = 2 * H * F
    off = (ep - 1) / ep
    sent = k * n_sp * off
    on = flat is not None and flat.dispatch != "off"
    if not on:
        r = _skew_baseline(model, layout, report.skew) * k * n_sp
        flops = 4 * (fc1 + fc2) * u * r
        a2a = sent * (2 * (2 * H * b + PROB_BYTES) + 2 * H * b)
        syncs = 2 * SYNCS_STOCK_FORWARD + SYNCS_STOCK_BACKWARD
        ops = 2 * (OPS_STOCK_FORWARD + OPS_STOCK_FORWARD_PER_EXPERT * e_local) \
            + OPS_STOCK_BACKWARD_PER_EXPERT * e_local
        counts = {"flops": flops * layers, "all_to_all_bytes": a2a * layers,
                  "syncs": syncs * layers, "ops": ops * layers,
                  "collective_calls": 8 * layers}
        return counts, overlap_for("moe", "stock")
    sigma = _skew_baseline(model, layout, report.skew)
    sigma_llep = _skew_llep(model, layout, report.skew, flat)
    r = sigma_llep * k * n_sp
    K = report.num_chunks if flat.dispatch == "pipelined" else 1
    kept = min(flat.dispatch_saved_chunks, K) if flat.dispatch == "pipelined" else K
    recompute_fc1 = fc1 * (1 - kept / K)
    flops = (4 * (fc1 + fc2) + recompute_fc1) * u * r
    a2a = sent * (2 * ((H * b + PROB_BYTES) + H * b) + (2 * H * b + PROB_BYTES)
                  + (H * b + PROB_BYTES))
    spilled = e_local * (sigma - sigma_llep) / sigma if sigma > sigma_llep else 0.0
    weights = spilled * model.ffn_matrices * H * F * (b + 4) * 3
    syncs = 2 * (SYNCS_FLAT_FORWARD + SYNCS_FLAT_FORWARD_PER_CHUNK * K) \
        + SYNCS_FLAT_BACKWARD_PER_CHUNK * K
    ops = 2 * (OPS_FLAT_FORWARD + OPS_FLAT_PER_CHUNK * K + OPS_FLAT_PER_CHUNK_EXPERT * K * e_local) \
        + OPS_FLAT_BACKWARD_PER_CHUNK_EXPERT * K * e_local
    counts = {"flops": flops * layers, "all_to_all_bytes": (a2a + weights) * layers,
              "syncs": syncs * layers, "ops": ops * layers,
              "collective_calls": (6 * K + 3) * layers}
    return counts, overlap_for("moe", "flat", K)


def _vocab(model: ModelSpec, layout: Layout, report: PeakReport,
           flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """Output projection + loss, one microbatch, on the last stage.

    Baseline: logits N × V/TP on each rank (SP gathers the N tokens first): 2·N·H·V/TP
    forward, twice that backward; all-gather of the input (N_sp·H·b·(TP−1)) and
    reduce-scatter of its gradient under SP; three N-sized fp32 all-reduces (max,
    sum-exp, target logit) at 2·(TP−1)/TP.

    Ring-DTP (P = TP ranks, each with its own N_sp tokens over all V): forward
    2·N_sp·H·V, backward recompute + dX + dW = 3·2·N_sp·H·V; per hop the weights mode moves
    the V/P × H shard (b) forward and the shard plus its fp32 dW backward, P − 1 hops each;
    the activations mode moves X (b·H), targets (8) and the state (12) per token per hop,
    with one return hop, forward; X, targets, state and the fp32 dX backward.
    """
    if report.stage != layout.pp - 1:
        return {}, overlap_for("vocab", "stock")
    H, V, b, P = model.hidden, model.vocab, model.bytes_per_value, layout.tp
    n, n_sp = report.tokens, report.tokens_sp
    shard = math.ceil(V / P)
    if flat is None or not flat.vocab:
        flops = 3 * 2 * n * H * shard
        other = 3 * 2 * (P - 1) * 4 * n / P if P > 1 else 0
        if layout.sp and P > 1:
            other += 2 * n_sp * H * b * (P - 1)
        return ({"flops": flops, "other_collective_bytes": other, "ops": OPS_VOCAB_STOCK,
                 "collective_calls": 5 if P > 1 else 0}, overlap_for("vocab", "stock"))
    strips_per_shard = math.ceil(shard / flat.vocab_block_size)
    flops = 4 * 2 * n_sp * H * shard * P
    mode = report.vocab_mode
    if P == 1:
        ring = 0.0
    elif mode == "weights":
        ring = (P - 1) * (shard * H * b) + (P - 1) * (shard * H * (b + 4))
    else:
        per_token = H * b + 8 + 12
        ring = P * n_sp * per_token + P * n_sp * (per_token + 4 * H)
    strips = strips_per_shard * P
    ops = strips * (OPS_RING_PER_STRIP + OPS_RING_BACKWARD_PER_STRIP)
    return ({"flops": flops, "other_collective_bytes": ring, "ops": ops,
             "collective_calls": 4 * P}, overlap_for("vocab", "flat", P))


def _boundaries(model: ModelSpec, layout: Layout, report: PeakReport,
                flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """The stage's attention for one microbatch (forward, recompute and backward: 4 × the
    forward FLOPs) and the copies SCO adds beside it.

    SCO: every offloaded boundary (N_sp·H·b) goes to the host in the forward and comes
    back in the backward; its layers pipeline the copies (the first reload is exposed).
    Only attention is counted as the compute that hides them (the experts are the
    dispatch unit's), so the units add up to a step without counting anything twice and
    the hiding is, if anything, underestimated.
    """
    first, count = stage_layers(model, layout)[report.stage]
    if not count:
        return {}, overlap_for("sco", "stock")
    flops = 4 * attention_flops(model, layout, report.seq_len, report.tokens) * count
    if flat is None or not flat.sco:
        return {"flops": flops}, overlap_for("sco", "stock")
    moved = report.boundaries_offloaded * report.boundary_bytes
    return ({"flops": flops, "h2d_bytes": moved, "d2h_bytes": moved},
            overlap_for("sco", "flat", max(1, count)))


def _optimizer(model: ModelSpec, layout: Layout, report: PeakReport,
               flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """One optimizer step of this GPU's shard: AdamW reads and writes 32 B per parameter
    in HBM either way; OffloadStreamAdamW adds 16 B up and 12 B down per parameter over
    PCIe, pipelined over its buckets."""
    first, count = stage_layers(model, layout)[report.stage]
    p = stage_params(model, layout, first, count, report.stage == 0,
                     report.stage == layout.pp - 1)
    if layout.distributed_optimizer:
        shard = math.ceil(p["dense"] / layout.dense_dp) + math.ceil(p["expert"] / layout.expert_dp)
    else:
        shard = p["dense"] + p["expert"]
    mem = ADAM_MEM_BYTES_PER_PARAM * shard
    if flat is None or not flat.optimizer_offload:
        tensors = 12 * max(count, 1)
        return ({"mem_bytes": mem, "ops": OPS_ADAM_PER_TENSOR * tensors},
                overlap_for("optimizer", "stock"))
    buckets = max(1, math.ceil(shard / flat.optimizer_bucket_numel))
    return ({"mem_bytes": mem, "h2d_bytes": OFFLOAD_H2D_BYTES_PER_PARAM * shard,
             "d2h_bytes": OFFLOAD_D2H_BYTES_PER_PARAM * shard,
             "ops": OPS_ADAM_PER_BUCKET * buckets},
            overlap_for("optimizer", "flat", buckets))


def unit_costs(model: ModelSpec, layout: Layout, report: PeakReport,
               flat: Optional[FlatConfig]) -> Dict[str, Tuple[dict, Overlap]]:
    """Counts and overlap of each unit (``UNITS``) for ``report``'s stage and knobs.

    ``flat=None`` is the baseline; a technique that ``flat`` leaves off gets the baseline's
    counts for its unit.
    """
    return {
        "dispatch": _dispatch(model, layout, report, flat),
        "vocab": _vocab(model, layout, report, flat),
        "boundaries": _boundaries(model, layout, report, flat),
        "optimizer": _optimizer(model, layout, report, flat),
    }
