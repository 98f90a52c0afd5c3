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
ledger's counts on the tiny model (``tests/runtime/test_ledger_worlds.py``); the sync and
launch counts per layer are the ledger's counts of the landed code (``SYNCS_*`` /
``OPS_*`` below, pinned by the same test), which do not grow with tokens.

Symbols: H, F, E, k, V as in ``peaks.py``; N tokens per CP rank, N_sp per TP rank in the
MoE/norm regions; σ the routing skew of plain EP, σ' after LLEP; r = σ·k·N_sp routes the
hottest EP rank computes; b bytes per value; u = 2·H·F FLOPs, the unit of expert work per
route (fc1 is 2u gated, u plain; fc2 is u).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Optional, Tuple

from megatron_flat.config import FlatConfig
from megatron_flat.plan import baselines
from megatron_flat.plan.model import Layout, ModelSpec, stage_layers
from megatron_flat.plan.peaks import (
    PeakReport,
    skew_baseline,
    skew_llep,
    gathers_sequence,
    stage_params,
    strip_geometry,
)
from megatron_flat.plan.time import DeviceModel, Overlap, overlap_for

__all__ = ["unit_costs", "UNITS", "expert_units", "attention_flops", "attention_core_flops",
           "attention_projection_flops", "attn_tile_counts", "attn_tile_overhead", "attn_tiles"]

UNITS = ("dispatch", "vocab", "boundaries", "optimizer", "parameters")

# Host syncs and aten ops (launches) per MoE layer, counted by the ledger on the landed code
# at EP = 2, megatron-core 0.16.1 (benchmarks/ledger.py; tests/runtime/test_ledger_worlds.py
# pins them). Megatron's alltoall dispatcher: per forward pass one wait for its split sizes
# and two masked_select (0.19 has no masked_select). PipelinedLLEP: per call one wait, for
# the route counts its plan needs (its tables reach the device in one non-blocking copy);
# none in backward (with --flat-debug-checks, more: every check reads device data).
# Ops, stock: fitted over E_l in {2, 4, 8}: 43 + 6·E_l per forward pass, 22 + 13·E_l in
# backward. Flat: benchmarks/moe_ops_fit.py over E_l in {2, 4, 8} x K in {1, 4, 10} (within
# 8 % at every point), with U = units (expert, chunk) run, K·E_l at real scale:
#   a valued forward call  F = 46 + 38·K + 6·U
#   a graph-only re-run    G = 47 + 21·K
#   backward               B = 42 + 14·K + 21·U
SYNCS_STOCK_PER_PASS = 3
SYNCS_FLAT_FORWARD = 1
SYNCS_FLAT_PER_CHUNK = 0
OPS_STOCK_FORWARD, OPS_STOCK_FORWARD_PER_EXPERT = 43, 6
OPS_STOCK_BACKWARD, OPS_STOCK_BACKWARD_PER_EXPERT = 22, 13
OPS_FLAT_FORWARD, OPS_FLAT_FORWARD_PER_CHUNK, OPS_FLAT_FORWARD_PER_UNIT = 46, 38, 6
OPS_FLAT_BACKWARD, OPS_FLAT_BACKWARD_PER_CHUNK, OPS_FLAT_BACKWARD_PER_UNIT = 42, 14, 21
OPS_FLAT_GRAPH_ONLY, OPS_FLAT_GRAPH_ONLY_PER_CHUNK = 47, 21  # the chunk schedules, no exchange
# PipelinedLLEP's host planning per call (between its counts copy and its one upload, the GPU
# idle): seconds per (chunk, expert) list. benchmarks/dispatch_scale.py at EP 64, 384 experts,
# K 10 with LLEP spilling (69 spilled experts): 7.1 ms median on one CPU thread of the
# development machine, 1.8 us per list (plain EP: 2.4 ms); rounded up.
HOST_PLAN_S_PER_LIST = 2e-6
# PipelinedLLEP's counts exchange carries 7 int64 flags beside the counts and N: the
# graph-only wish and a recompute violation (dispatch.recompute.Violation.encode).
EXCHANGE_FLAGS = 7
# Ring-DTP: the fold per strip (forward) and the recompute + grads per strip (backward).
OPS_RING_PER_STRIP = 12
OPS_RING_BACKWARD_PER_STRIP = 24
OPS_VOCAB_STOCK = 40
# Ring-DTP's token tiles: each tile of a strip beyond its first adds OPS_RING_PER_TILE ops
# and reads the strip's w x H weight block again in the forward, recomputed and dX GEMMs
# (3·b bytes per element) and reads and writes its fp32 block gradient in the dW GEMM
# (8 bytes): TILE_REREAD_FP32_BYTES + 3·b per element of the block. Both measured with the
# ledger (fp32, one rank: tests/plan/test_tile_costs.py).
OPS_RING_PER_TILE = 39
TILE_REREAD_FP32_BYTES = 8
# The attention block's sequence tiles (--flat-attn-tiles): each tile beyond the first adds,
# per layer, OPS_ATTN_TILE_FORWARD ops per forward pass (the QKV projection's gather and
# GEMM, the output projection's GEMM and reduce-scatter, the copies into place) and
# OPS_ATTN_TILE_BACKWARD in backward, ATTN_TILE_CALLS_FORWARD / _BACKWARD collectives (stock
# makes the same ones for all N at once: the same bytes in more calls), and reads the two
# projections' weights again in each forward pass and the dX GEMMs (b bytes per element)
# and reads and writes their fp32 gradient accumulator in the dW GEMMs (TILE_REREAD_FP32_BYTES).
# Counted with the ledger at TP 2 (tests/plan/test_attn_tile_costs_world2.py).
# The tile ``fit`` turns on (FlatConfig.attn_tiles, gathered tokens): the smallest power of
# two keeping a tile's launches and re-reads each under 10 % of its projection GEMMs at the
# paper's presets (attn_tile_overhead; tests/plan/test_attn_tiles_term.py). At H 7168, bf16,
# a gathered tile is 448 MiB where the gathered N x H at 1M tokens per CP rank is 14 GiB.
ATTN_TILE_TOKENS = 32_768
OPS_ATTN_TILE_FORWARD = 13
OPS_ATTN_TILE_BACKWARD = 20
ATTN_TILE_CALLS_FORWARD = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
ATTN_TILE_CALLS_BACKWARD = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
# AdamW, per bucket (flat: upload, update, write back) or per parameter tensor (stock).
OPS_ADAM_PER_TENSOR = 12
OPS_ADAM_PER_BUCKET = 20
# Bytes AdamW reads and writes per parameter: bf16 param (2) + fp32 grad (4) + master,
# m, v (12) read; master, m, v (12) + bf16 param (2) written.
ADAM_MEM_BYTES_PER_PARAM = 32
# A CPU AdamW (the offloading baselines) reads fp32 master, grad, m, v (16 B) and writes
# master, m, v (12 B) per parameter in host memory.
HOST_ADAM_BYTES_PER_PARAM = 28
# HybridDeviceOptimizer copies each fp32 gradient down and each fp32 master up (the cast to
# the model dtype happens on the device).
HDO_D2H_BYTES_PER_PARAM = 4
HDO_H2D_BYTES_PER_PARAM = 4
# FSDP2 with CPU offload, per microbatch: each fp32 parameter shard goes up before each of
# its three all-gathers (forward, recompute, backward), each fp32 gradient shard comes down.
FSDP_GATHERS = 3
# The chunked loss (``plan.recipes``): forward, the chunk's forward again, backward (2×).
CHUNKED_LOSS_WORK = 4 / 3
FSDP_H2D_BYTES_PER_PARAM = 4 * FSDP_GATHERS
FSDP_D2H_BYTES_PER_PARAM = 4
# OffloadStreamAdamW moves per parameter: up master, m, v (12 B; the fp32 gradient is read
# where it is, on the device), back master, m, v (12 B).
OFFLOAD_H2D_BYTES_PER_PARAM = 12
OFFLOAD_D2H_BYTES_PER_PARAM = 12
PROB_BYTES = 4


def expert_units(gated: bool) -> Tuple[int, int]:
    """(fc1, fc2) work per route in units of u = 2·H·F: (2, 1) gated, (1, 1) plain."""
    return (2, 1) if gated else (1, 1)


def attention_flops(model: ModelSpec, layout: Layout, seq_len: int, n: int) -> float:
    """Forward FLOPs of one attention layer on one GPU: its projections
    (``attention_projection_flops``) and its core attention (``attention_core_flops``)."""
    return attention_projection_flops(model, layout, n) + \
        attention_core_flops(model, layout, seq_len, n)


def attention_projection_flops(model: ModelSpec, layout: Layout, n: int) -> float:
    """Forward FLOPs of one layer's attention projections (QKV and output) on one GPU:
    2·N·P_attn/TP."""
    return 2 * n * model.attention_params_per_layer() / layout.tp


def attention_core_flops(model: ModelSpec, layout: Layout, seq_len: int, n: int) -> float:
    """Forward FLOPs of one layer's core attention on one GPU, causal scores + weighted
    values (QK^T and PV): 2·2·N·(S/2)·h·d/TP (each of the N local queries sees on average
    half of the S·mbs keys), averaged over the layers: sliding-window layers see at most
    their window (``ModelSpec.attended_fraction``). What attention replay skips in the
    recompute."""
    keys = seq_len * layout.micro_batch_size / 2 * model.attended_fraction(seq_len)
    return 2 * 2 * n * keys * model.heads * max(model.head_dim, model.dv) / layout.tp


def moe_layer_counts(*, hidden: int, ffn: int, experts: int, tokens: int, ep: int,
                     routes_computed: float, routes_sent: float, bytes_per_value: int,
                     gated: bool = True, flat: bool = False, chunks: int = 1, saved: int = 0,
                     recompute: bool = False, graph_only: bool = True,
                     max_chunks: Optional[int] = None, units: Optional[int] = None) -> dict:
    """Counts of one MoE layer, one microbatch, forward + backward on one EP rank.

    ``routes_computed``: routes this rank's experts run; ``routes_sent``: routes it sends to
    other ranks; ``tokens``: its tokens (N_sp); ``recompute``: inside Megatron's full
    recompute (the forward runs twice). With u = 2·H·F and F1, F2 = (2, 1) gated, (1, 1)
    plain, P = forward passes (2 under recompute), V = passes that dispatch (P; flat with
    ``graph_only`` under recompute: 1, the re-run skips the dispatch and keeps nothing,
    saved = 0)::

        flops   = 2·N·H·E·(P + 2)                           router GEMM, its dX and dW
                + (V·(F1 + F2) + 2·(F1 + F2)                experts forward, backward
                   + [flat]·F1·(1 − saved/K))·u·routes_computed   + fc1 again per chunk
        a2a     = stock: routes_sent·(P + 1)·(2·H·b + 4)    tokens + fp32 prob out, output
                                                            back, per forward and backward
                  flat:  routes_sent·(V·(2·H·b + 4) + 3·H·b + 8)
                                                            backward re-sends each token
                                                            with its output grad (2·H·b + 4)
                                                            and returns dX and dprob
        other   = stock: P·(EP − 1)·E·8                     all-gather of tokens per expert
                  flat:  P·(EP − 1)·(S·E + 1 + 7)·8         all-gather of every rank's counts
                                                            per (chunk, expert), N and 7
                                                            flags (the graph-only verdict),
                                                            in S = K_max slots
                                                            (``max_chunks``; default K), 1
                                                            for ``llep``
        syncs, ops: the ledger's counts of the landed code (constants above); flat ops
                    with U = ``units`` (expert, chunk) pairs run, K·E_l when not given
        host_plan_s = flat: P·K·E·HOST_PLAN_S_PER_LIST      host planning after each call's
                                                            sync (the graph-only re-run plans
                                                            too); stock: 0

    Checked exactly against the ledger on the tiny layer (``tests/runtime/
    test_ledger_worlds.py``), stock and flat, with and without recompute.
    """
    H, F, E, b = hidden, ffn, experts, bytes_per_value
    e_local = E // ep
    fc1, fc2 = expert_units(gated)
    passes = 2 if recompute else 1
    K = max(1, chunks)
    valued = 1 if flat and recompute and graph_only else passes
    if valued < passes:
        saved = 0  # the no-grad forward keeps nothing; the graph-only re-run computes nothing
    work = valued * (fc1 + fc2) + 2 * (fc1 + fc2)  # expert FLOPs per route, in units of u
    if flat:
        work += fc1 * (1 - min(saved, K) / K)
    flops = 2 * tokens * H * E * (passes + 2) + work * 2 * H * F * routes_computed
    if not flat:
        a2a = routes_sent * (passes + 1) * (2 * H * b + PROB_BYTES)
        other = passes * (ep - 1) * E * 8
        calls = {"all_to_all_single": 3 * (passes + 1), "all_gather_into_tensor": passes}
        syncs = passes * SYNCS_STOCK_PER_PASS
        ops = passes * (OPS_STOCK_FORWARD + OPS_STOCK_FORWARD_PER_EXPERT * e_local) \
            + OPS_STOCK_BACKWARD + OPS_STOCK_BACKWARD_PER_EXPERT * e_local
    else:
        slots = K if max_chunks is None else max(K, max_chunks)
        a2a = routes_sent * (valued * (2 * H * b + PROB_BYTES) + 3 * H * b + 2 * PROB_BYTES)
        other = passes * (ep - 1) * (slots * E + 1 + EXCHANGE_FLAGS) * 8
        calls = {"all_to_all_single": valued * 2 * K + 2 * K, "all_gather_into_tensor": passes}
        syncs = passes * SYNCS_FLAT_FORWARD + valued * SYNCS_FLAT_PER_CHUNK * K
        u = K * e_local if units is None else units
        ops = valued * (OPS_FLAT_FORWARD + OPS_FLAT_FORWARD_PER_CHUNK * K
                        + OPS_FLAT_FORWARD_PER_UNIT * u) \
            + (passes - valued) * (OPS_FLAT_GRAPH_ONLY + OPS_FLAT_GRAPH_ONLY_PER_CHUNK * K) \
            + OPS_FLAT_BACKWARD + OPS_FLAT_BACKWARD_PER_CHUNK * K + OPS_FLAT_BACKWARD_PER_UNIT * u
    host_plan_s = passes * HOST_PLAN_S_PER_LIST * K * E if flat else 0.0
    if ep == 1:
        a2a, other, calls = 0, 0, {}
    return {"flops": flops, "all_to_all_bytes": a2a, "other_collective_bytes": other,
            "collective_calls": calls, "syncs": syncs, "ops": ops, "host_plan_s": host_plan_s}


def tile_reread_bytes(width: int, hidden: int, bytes_per_value: int) -> int:
    """Bytes one more token tile of a ``width``-row strip moves (``OPS_RING_PER_TILE``)."""
    return width * hidden * (3 * bytes_per_value + TILE_REREAD_FP32_BYTES)


def vocab_counts(*, hidden: int, vocab: int, tokens: int, tp: int, bytes_per_value: int,
                 sequence_parallel: bool, flat: bool = False, mode: str = "activations",
                 strips: int = 1, tiles: int = 1, width: int = 0) -> dict:
    """Counts of the output projection + loss, one microbatch, forward + backward.

    ``tokens``: this rank's N_sp (the sequence-parallel share; N = TP·N_sp). Stock
    (``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``)::

        flops = 3·2·N·H·V/TP                       logits, their dX and dW
        other = [SP]·3·N_sp·H·b·(TP − 1)           all-gather forward and again in backward,
                                                   reduce-scatter of dX
              + 3·2·(TP − 1)/TP·4·N                three fp32 all-reduces (max, sum, target)

    Ring-DTP (P = TP, each rank its own N_sp tokens over all V/P shards, ``strips`` per
    shard)::

        flops = 4·2·N_sp·H·V                       strips forward; recomputed, dX, dW backward
        activations: forward (P − 1)·N_sp·(H·b + 8) tokens and labels + P·12·N_sp states;
                     backward (P − 1)·N_sp·(H·b + 16) tokens, labels, lse and coefficient
                     + (P − 1)·4·H·N_sp fp32 dX sums (relayed in pieces)
        weights:     forward (P − 1)·(V/P)·H·b; backward (P − 1)·(V/P)·H·b
                     + (P − 1)·4·(V/P)·H fp32 shard-gradient sums (relayed in pieces)

    Token tiles (``tiles`` per strip of ``width`` rows, each shard's ``strips`` strips on
    each of the P hops): ``(tiles − 1)·strips·P`` more tiles, each ``OPS_RING_PER_TILE`` ops
    and ``tile_reread_bytes(width, H, b)`` bytes (``mem_bytes``); FLOPs and ring bytes are
    the same.

    Checked exactly against the ledger at TP = 2 (``tests/runtime/test_ledger_worlds.py``).
    """
    H, V, b, P, n_sp = hidden, vocab, bytes_per_value, tp, tokens
    shard = math.ceil(V / P)
    if not flat:
        n = n_sp * P if sequence_parallel else n_sp
        other = 3 * 2 * (P - 1) * 4 * n // P
        if sequence_parallel:
            other += 3 * n_sp * H * b * (P - 1)
        calls = {}
        if P > 1:
            calls = {"all_reduce": 3}
            if sequence_parallel:
                calls.update(all_gather_into_tensor=2, reduce_scatter_tensor=1)
        return {"flops": 3 * 2 * n * H * shard, "other_collective_bytes": other if P > 1 else 0,
                "ops": OPS_VOCAB_STOCK, "collective_calls": calls}
    from megatron_flat.vocab.plan import relay_piece_rows, relay_pieces

    flops = 4 * 2 * n_sp * H * shard * P
    if P == 1:
        ring, calls = 0, 0
    elif mode == "weights":
        pieces = relay_pieces(shard, relay_piece_rows([shard]))
        ring = (P - 1) * shard * H * b + (P - 1) * shard * H * b + (P - 1) * 4 * shard * H
        calls = (P - 1) + (P - 1) + (P - 1) * pieces
    else:
        pieces = relay_pieces(n_sp, relay_piece_rows([n_sp]))
        ring = (P - 1) * n_sp * (H * b + 8) + P * 12 * n_sp \
            + (P - 1) * n_sp * (H * b + 16) + (P - 1) * 4 * H * n_sp
        calls = 2 * (P - 1) + P + 3 * (P - 1) + (P - 1) * pieces
    ops = strips * P * (OPS_RING_PER_STRIP + OPS_RING_BACKWARD_PER_STRIP)
    extra_tiles = max(tiles - 1, 0) * strips * P
    ops += extra_tiles * OPS_RING_PER_TILE
    mem = extra_tiles * tile_reread_bytes(width or math.ceil(shard / strips), H, b)
    return {"flops": flops, "other_collective_bytes": ring, "ops": ops, "mem_bytes": mem,
            "collective_calls": {"send": calls}}


def attn_tile_counts(*, projection_params: int, tiles: int, bytes_per_value: int,
                     recompute: bool = True) -> dict:
    """What ``tiles`` sequence tiles add to one attention block, one microbatch, forward +
    backward on one TP rank, over the untiled projections (``tiles`` = 1: nothing).

    With P = ``projection_params`` (the QKV and output projections' weights on this rank),
    t = tiles − 1 and passes = 2 under full recompute (the forward runs twice)::

        ops    = t·(passes·OPS_ATTN_TILE_FORWARD + OPS_ATTN_TILE_BACKWARD)
        calls  = t·(passes·ATTN_TILE_CALLS_FORWARD + ATTN_TILE_CALLS_BACKWARD)
        mem    = t·((passes + 1)·b + TILE_REREAD_FP32_BYTES)·P   the weights read again per
                                                                pass and dX GEMM, the fp32
                                                                accumulator per dW GEMM

    FLOPs and collective bytes are stock's: every row is projected, gathered and scattered
    once per pass either way."""
    extra = max(tiles - 1, 0)
    passes = 2 if recompute else 1
    calls = {}
    for name in ATTN_TILE_CALLS_FORWARD:
        calls[name] = extra * (passes * ATTN_TILE_CALLS_FORWARD[name]
                               + ATTN_TILE_CALLS_BACKWARD[name])
    mem = extra * ((passes + 1) * bytes_per_value + TILE_REREAD_FP32_BYTES) * projection_params
    return {"ops": extra * (passes * OPS_ATTN_TILE_FORWARD + OPS_ATTN_TILE_BACKWARD),
            "collective_calls": calls if extra else {}, "mem_bytes": mem}


def attn_tile_overhead(model: ModelSpec, layout: Layout, tile_tokens: int,
                       device: Optional[DeviceModel] = None) -> dict:
    """What one more attention tile of ``tile_tokens`` gathered tokens costs beside its work,
    on ``device`` (H200 by default), as fractions of the tile's projection GEMM time under
    full recompute (forward twice, dX and dW: 8·T·P FLOPs for T tokens and P projection
    weights per TP rank): ``launch``, the host time of its launches and collective calls
    (hidden while below 1); ``reread``, the time of the bytes it reads again (added serially
    by the step-time model). ``ATTN_TILE_TOKENS`` keeps both under 10 % for the paper's
    presets."""
    from megatron_flat.plan.time import device as named_device

    dev = device or named_device("H200")
    P = model.attention_params_per_layer() // layout.tp
    counts = attn_tile_counts(projection_params=P, tiles=2,
                              bytes_per_value=model.bytes_per_value)
    gemm_s = 8 * tile_tokens * P / (dev.flops * dev.matmul_efficiency)
    launch_s = counts["ops"] * dev.launch_s + sum(counts["collective_calls"].values()) * \
        dev.collective_latency_s
    reread_s = counts["mem_bytes"] / (dev.hbm_bytes_per_s * dev.hbm_efficiency)
    return {"gemm_s": gemm_s, "launch": launch_s / gemm_s, "reread": reread_s / gemm_s}


def tile_overhead(*, hidden: int, width: int, tile_bytes: int, bytes_per_value: int,
                  device: Optional[DeviceModel] = None) -> dict:
    """What one token tile of a ``width``-row strip costs beside its work, on ``device``
    (the H200 model by default), as fractions of the tile's GEMM time: ``launch``, the host
    time of its ``OPS_RING_PER_TILE`` launches (hidden while below 1: the GPU is still busy
    with the tile before); ``reread``, the time of the bytes it moves again
    (``tile_reread_bytes``: hidden under a compute-bound GEMM, added serially by the step-time
    model). The tile's work is its forward, recomputed, dX and dW GEMMs: 8·c·w·H FLOPs for
    ``c = tile_bytes // (4·w)`` tokens. ``FlatConfig.vocab_tile_bytes``'s default is the
    smallest power of two keeping both under 10 % at the paper's shape."""
    from megatron_flat.plan.time import device as named_device

    dev = device or named_device("H200")
    rows = max(1, tile_bytes // (4 * width))
    gemm_s = 8 * rows * width * hidden / (dev.flops * dev.matmul_efficiency)
    launch_s = OPS_RING_PER_TILE * dev.launch_s
    reread_s = tile_reread_bytes(width, hidden, bytes_per_value) / (
        dev.hbm_bytes_per_s * dev.hbm_efficiency)
    return {"tile_rows": rows, "gemm_s": gemm_s, "launch": launch_s / gemm_s,
            "reread": reread_s / gemm_s}


def _moe_layers(model: ModelSpec, layout: Layout, stage: int) -> int:
    first, count = stage_layers(model, layout)[stage]
    return sum(1 for i in range(first, first + count) if model.is_moe_layer(i))


def _scale(counts: dict, factor: float) -> dict:
    out = {}
    for key, value in counts.items():
        out[key] = {k: v * factor for k, v in value.items()} if isinstance(value, dict) \
            else value * factor
    return out


def _dispatch(model: ModelSpec, layout: Layout, report: PeakReport,
              flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """The stage's MoE layers, one microbatch, under full recompute (``moe_layer_counts``
    per layer, times the stage's MoE layers).

    The hottest EP rank sets the pace: it computes σ·k·N_sp routes (σ the routing skew of
    plain EP; σ' after LLEP with ``--flat-dispatch``) and sends (EP−1)/EP of its k·N_sp
    routes off-rank. LLEP's weight transfers (not in ``moe_layer_counts``): the hottest
    rank's excess (σ − σ')·k·N_sp routes leave with whole experts, about E_l·(σ − σ')/σ
    of them, each F_m·H·F·b out and its fp32 gradient back, per pass that computes
    (forward, recompute unless graph-only, backward).
    """
    layers = _moe_layers(model, layout, report.stage)
    if not model.experts or not layers:
        return {}, overlap_for("moe", "stock")
    H, F, k, b = model.hidden, model.expert_ffn, model.topk, model.bytes_per_value
    n_sp, ep = report.tokens_sp, layout.ep
    e_local = model.experts // ep
    on = flat is not None and flat.dispatch != "off"
    sigma = skew_baseline(model, layout, report.skew)
    sigma_run = skew_llep(model, layout, report.skew, flat) if on else sigma
    K = report.num_chunks if on and flat.dispatch == "pipelined" else 1
    saved = min(flat.dispatch_saved_chunks, K) if on and flat.dispatch == "pipelined" else K
    counts = moe_layer_counts(hidden=H, ffn=F, experts=model.experts, tokens=n_sp, ep=ep,
                              routes_computed=sigma_run * k * n_sp,
                              routes_sent=k * n_sp * (ep - 1) / ep, bytes_per_value=b,
                              gated=model.gated, flat=on, chunks=K, saved=saved,
                              recompute=not _selective(report),
                              graph_only=on and flat.dispatch_graph_only_recompute,
                              max_chunks=flat.dispatch_max_chunks if on and K > 1 else None)
    if on:
        spilled = e_local * (sigma - sigma_run) / sigma if sigma > sigma_run else 0.0
        passes = 2 if flat.dispatch_graph_only_recompute else 3  # the graph-only re-run: none
        counts["all_to_all_bytes"] += spilled * model.ffn_matrices * H * F * (b + 4) * passes
    return _scale(counts, layers), overlap_for("moe", "flat" if on else "stock", K)


def _vocab(model: ModelSpec, layout: Layout, report: PeakReport,
           flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """Output projection + loss, one microbatch, on the last stage (``vocab_counts``; the
    main head and each MTP head)."""
    if report.stage != layout.pp - 1:
        return {}, overlap_for("vocab", "stock")
    on = flat is not None and flat.vocab
    shard = math.ceil(model.vocab / layout.tp)
    strips, tiles, width = 1, 1, shard
    if on:
        width, rows = strip_geometry(shard, report.tokens_sp, flat.vocab_block_size,
                                     flat.vocab_tile_bytes)
        strips = math.ceil(shard / width)
        tiles = math.ceil(report.tokens_sp / rows) if rows else 1
    counts = vocab_counts(hidden=model.hidden, vocab=model.vocab, tokens=report.tokens_sp,
                          tp=layout.tp, bytes_per_value=model.bytes_per_value,
                          sequence_parallel=bool(layout.sp), flat=on, mode=report.vocab_mode,
                          strips=strips, tiles=tiles, width=width)
    # Every MTP head is one more projection + loss of the same shape.
    counts = _scale(counts, 1 + model.mtp_layers)
    if report.recipe is not None:
        # The chunked loss checkpoints each chunk: its forward runs again in the backward,
        # a third more of the projection's work (forward 1 of its 3).
        counts = _scale(counts, CHUNKED_LOSS_WORK)
        return counts, overlap_for("vocab", "stock")
    return counts, overlap_for("vocab", "flat" if on else "stock", layout.tp if on else 1)


def _boundaries(model: ModelSpec, layout: Layout, report: PeakReport,
                flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """The stage's attention for one microbatch (forward, recompute and backward: 4 × the
    forward FLOPs) and the copies SCO adds beside it.

    SCO: every offloaded boundary (N_sp·H·b) goes to the host in the forward and comes
    back in the backward; its layers pipeline the copies (the first reload is exposed).
    Only attention is counted as the compute that hides them (the experts are the
    dispatch unit's), so the units add up to a step without counting anything twice and
    the hiding is, if anything, underestimated.

    Attention replay: the recompute of each layer it keeps (``report.replay_fraction`` of
    them; all when SCO's pool holds them) skips the core attention (its projections still
    run), so such a layer's FLOPs are 4·P + 3·C (P the projections' forward, C the core
    attention's) instead of 4·(P + C); its O + LSE (``report.replay_bytes``) goes to the
    host in the forward and comes back one layer ahead in the backward, on the copy streams
    of SCO's boundaries.
    """
    first, count = stage_layers(model, layout)[report.stage]
    if not count:
        return {}, overlap_for("sco", "stock")
    forward = attention_flops(model, layout, report.seq_len, report.tokens)
    replayed = count * report.replay_fraction  # layers per microbatch that replay
    skipped = replayed * attention_core_flops(model, layout, report.seq_len, report.tokens)
    counts = {"flops": 4 * forward * count - skipped}
    if _selective(report):
        # Megatron's activation offloading: selective recompute (no forward re-run), every
        # offloaded group down in the forward and up one group ahead in the backward on the
        # side streams, beside the layers' compute.
        moved = report.boundaries_offloaded * report.offloaded_per_layer
        counts.update(flops=3 * forward * count, h2d_bytes=moved, d2h_bytes=moved)
        return counts, overlap_for("activation-offload", "megatron-offload", max(1, count))
    tiles = attn_tiles(layout, report.tokens, flat)
    if tiles > 1:
        extra = attn_tile_counts(projection_params=model.attention_params_per_layer() // layout.tp,
                                 tiles=tiles, bytes_per_value=model.bytes_per_value)
        counts.update(_scale(extra, count))
    if report.recipe is not None and report.boundaries_offloaded:
        # save_on_cpu: each layer input down in the forward, up in the backward, both on
        # the compute stream (nothing hides them).
        moved = report.boundaries_offloaded * report.boundary_bytes
        counts.update(h2d_bytes=moved, d2h_bytes=moved)
        return counts, overlap_for("checkpoint-offload", "fsdp2-cp")
    if flat is None or not flat.sco:
        return counts, overlap_for("sco", "stock")
    moved = report.boundaries_offloaded * report.boundary_bytes + replayed * report.replay_bytes
    counts.update(h2d_bytes=moved, d2h_bytes=moved)
    return counts, overlap_for("sco", "flat", max(1, count))


def attn_tiles(layout: Layout, tokens: int, flat: Optional[FlatConfig]) -> int:
    """Sequence tiles per attention projection for ``tokens`` tokens per CP rank (1: untiled;
    tiles need sequence parallelism over TP > 1)."""
    tile_tokens = flat.attn_tiles if flat is not None else 0
    if not tile_tokens or not gathers_sequence(layout):
        return 1
    from megatron_flat.attention.tiles import SequenceTiles, rows_for_tokens

    n_local = max(1, tokens // layout.tp)
    return SequenceTiles(n_local, layout.tp, rows_for_tokens(tile_tokens, layout.tp)).count


def _shard(model: ModelSpec, layout: Layout, report: PeakReport) -> Tuple[int, int]:
    """(P_s, parameter tensors) of this GPU's stage: the optimizer shard (distributed
    optimizer or FSDP: dense over DP·CP, experts over TP·CP·DP/EP) and how many tensors."""
    first, count = stage_layers(model, layout)[report.stage]
    first_stage, last_stage = report.stage == 0, report.stage == layout.pp - 1
    p = stage_params(model, layout, first, count, first_stage, last_stage)
    if layout.distributed_optimizer or report.baseline in ("fsdp2-offload", "fsdp2-cp"):
        shard = math.ceil(p["dense"] / layout.dense_dp) + math.ceil(p["expert"] / layout.expert_dp)
    else:
        shard = p["dense"] + p["expert"]
    tensors = sum(n for _, n, _ in baselines.param_tensors(model, layout, first, count,
                                                          first_stage, last_stage))
    return shard, tensors


def _optimizer(model: ModelSpec, layout: Layout, report: PeakReport,
               flat: Optional[FlatConfig]) -> Tuple[dict, Overlap]:
    """One optimizer step of this GPU's shard: AdamW reads and writes 32 B per parameter
    in HBM either way; OffloadStreamAdamW adds 12 B up and 12 B down per parameter over
    PCIe, pipelined over its buckets. The offloading baselines run torch's AdamW on the
    CPU instead (28 B per parameter of host memory traffic); Megatron's
    HybridDeviceOptimizer also copies each gradient down and each master up (4 B each) and
    waits on the host for each parameter's gradient."""
    first, count = stage_layers(model, layout)[report.stage]
    shard, tensors = _shard(model, layout, report)
    mem = ADAM_MEM_BYTES_PER_PARAM * shard
    off = flat is None or not flat.any_enabled
    if off and report.baseline in ("megatron-cpu-offload", "megatron-offload"):
        return ({"host_mem_bytes": HOST_ADAM_BYTES_PER_PARAM * shard,
                 "d2h_bytes": HDO_D2H_BYTES_PER_PARAM * shard,
                 "h2d_bytes": HDO_H2D_BYTES_PER_PARAM * shard, "syncs": tensors,
                 "ops": OPS_ADAM_PER_TENSOR * tensors},
                overlap_for("optimizer", "megatron-cpu-offload", max(1, tensors)))
    if off and _fsdp_on_host(report):
        return ({"host_mem_bytes": HOST_ADAM_BYTES_PER_PARAM * shard},
                overlap_for("optimizer", "fsdp2-offload"))
    if off and report.recipe is not None and report.recipe.optimizer_on_host:
        # ZeRO-3's offloaded optimizer: each gradient shard down, CPU AdamW, the new
        # low-precision shard up.
        return ({"host_mem_bytes": HOST_ADAM_BYTES_PER_PARAM * shard,
                 "d2h_bytes": model.bytes_per_value * shard,
                 "h2d_bytes": model.bytes_per_value * shard},
                overlap_for("optimizer", "fsdp2-offload"))
    if flat is None or not flat.optimizer_offload:
        tensors = 12 * max(count, 1)
        return ({"mem_bytes": mem, "ops": OPS_ADAM_PER_TENSOR * tensors},
                overlap_for("optimizer", "stock"))
    h2d, d2h = OFFLOAD_H2D_BYTES_PER_PARAM * shard, OFFLOAD_D2H_BYTES_PER_PARAM * shard
    experts = report.params_offloaded
    if experts:
        # Param offload: the experts' sub-optimizer steps all local experts (not their
        # expert-DP shard), uploads each fp32 gradient from the host tier beside master, m
        # and v, and writes the new weight back to the host tier.
        sharded = _expert_shard(model, layout, report)
        shard += experts - sharded
        mem = ADAM_MEM_BYTES_PER_PARAM * shard
        h2d += (OFFLOAD_H2D_BYTES_PER_PARAM + 4) * experts \
            - OFFLOAD_H2D_BYTES_PER_PARAM * sharded
        d2h += (OFFLOAD_D2H_BYTES_PER_PARAM + model.bytes_per_value) * experts \
            - OFFLOAD_D2H_BYTES_PER_PARAM * sharded
    buckets = max(1, math.ceil(shard / flat.optimizer_bucket_numel))
    return ({"mem_bytes": mem, "h2d_bytes": h2d, "d2h_bytes": d2h,
             "ops": OPS_ADAM_PER_BUCKET * buckets},
            overlap_for("optimizer", "flat", buckets))


def _expert_shard(model: ModelSpec, layout: Layout, report: PeakReport) -> int:
    """The experts' part of ``_shard``'s P_s (their expert-DP shard where the optimizer is
    distributed)."""
    first, count = stage_layers(model, layout)[report.stage]
    p = stage_params(model, layout, first, count, report.stage == 0,
                     report.stage == layout.pp - 1)
    return math.ceil(p["expert"] / layout.expert_dp) if layout.distributed_optimizer \
        else p["expert"]


def _parameters(model: ModelSpec, layout: Layout, report: PeakReport,
                beside_flops: float) -> Tuple[dict, Overlap]:
    """The parameters' traffic of one microbatch: param offload's or FSDP2's (empty
    otherwise).

    Param offload (``plan.param_offload``): h2d = (2·b + 4)·P_e, d2h = 4·P_e (P_e the routed
    experts on this GPU; the bound after the first microbatch), on the copy streams beside
    every layer's compute, one MoE layer fetched ahead (stages: the stage's MoE layers).

    FSDP2:

    With P_d, P_e this GPU's dense and expert parameters (its TP/EP share, gathered) and
    s_d = DP·CP, s_e = TP·CP·DP/EP their shard groups::

        h2d   = 3·4·P_s                     each fp32 shard up before each all-gather
        d2h   = 4·P_s                       each fp32 gradient shard down
        other = Σ (3·b + 4)·P·(s − 1)/s     three all-gathers of b-byte parameters and one
                                            fp32 reduce-scatter of the gradient, per kind

    They run beside every layer's compute (``beside_flops``: the other units' FLOPs of the
    microbatch), one layer prefetched. The collectives are priced at the intra-node link's
    bandwidth, which favours FSDP2 where its shard group spans nodes.
    """
    if report.params_offloaded:
        from megatron_flat.plan import param_offload

        term = param_offload.term(model, layout, report.params_offloaded)
        h2d, d2h = term.microbatch_bytes()
        base = overlap_for("parameters", "flat", max(1, _moe_layers(model, layout,
                                                                    report.stage)))
        return {"h2d_bytes": h2d, "d2h_bytes": d2h}, replace(base, beside_flops=beside_flops)
    if report.baseline not in ("fsdp2-offload", "fsdp2-cp"):
        return {}, overlap_for("parameters", "stock")
    first, count = stage_layers(model, layout)[report.stage]
    p = stage_params(model, layout, first, count, report.stage == 0,
                     report.stage == layout.pp - 1)
    shard, _ = _shard(model, layout, report)
    b = model.bytes_per_value
    other = 0.0
    for n, s in ((p["dense"], layout.dense_dp), (p["expert"], layout.expert_dp)):
        other += (FSDP_GATHERS * b + 4) * n * (s - 1) / s
    host = _fsdp_on_host(report)  # without CPU offload only the collectives remain
    counts = {"h2d_bytes": FSDP_H2D_BYTES_PER_PARAM * shard if host else 0,
              "d2h_bytes": FSDP_D2H_BYTES_PER_PARAM * shard if host else 0,
              "other_collective_bytes": other,
              "collective_calls": {"all_gather_into_tensor": FSDP_GATHERS * max(count, 1),
                                   "reduce_scatter_tensor": max(count, 1)}}
    base = overlap_for("parameters", "fsdp2-offload", max(1, count))
    return counts, replace(base, beside_flops=beside_flops)


def _selective(report: PeakReport) -> bool:
    """Whether ``report``'s run recomputes selectively (``megatron-offload``), not whole
    layers."""
    return report.baseline == "megatron-offload" and not report.flat_on


def _fsdp_on_host(report: PeakReport) -> bool:
    """Whether ``report``'s baseline is FSDP2 with its model state on the host."""
    return report.baseline == "fsdp2-offload" or (
        report.recipe is not None and report.recipe.params_on_host)


def unit_costs(model: ModelSpec, layout: Layout, report: PeakReport,
               flat: Optional[FlatConfig]) -> Dict[str, Tuple[dict, Overlap]]:
    """Counts and overlap of each unit (``UNITS``) for ``report``'s stage and knobs.

    ``flat=None`` is the baseline ``report.baseline`` (``plan.baselines``); a technique that
    ``flat`` leaves off gets stock Megatron's counts for its unit.
    """
    out = {
        "dispatch": _dispatch(model, layout, report, flat),
        "vocab": _vocab(model, layout, report, flat),
        "boundaries": _boundaries(model, layout, report, flat),
        "optimizer": _optimizer(model, layout, report, flat),
    }
    beside = sum(float(out[u][0].get("flops", 0)) for u in ("dispatch", "vocab", "boundaries"))
    out["parameters"] = _parameters(model, layout, report, beside)
    return out
