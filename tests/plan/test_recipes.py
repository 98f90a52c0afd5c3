"""The recipe baseline fsdp2-cp (plan.recipes): its activation terms against stock's, its
knobs, and the step-time counts it adds."""

import math

import pytest

from megatron_flat.plan import Layout, estimate, preset
from megatron_flat.plan.costs import unit_costs
from megatron_flat.plan.model import PlanError
from megatron_flat.plan.recipes import FSDP2_CP, TRL_LONG_CONTEXT, Fsdp2CP

from dataclasses import replace

DENSE = preset("qwen3-8b")
MOE = preset("qwen3-30b-a3b")
TRL = Layout(tp=1, cp=8, ep=1)
SEQ = 1 << 20


def _pair(model, layout, recipe, seq=SEQ):
    stock = estimate(model, layout, seq)
    return stock, estimate(model, layout, seq, baseline="fsdp2-cp", recipe=recipe)


def test_checkpoints_on_the_host_leave_one_on_the_device():
    stock, cp = _pair(DENSE, TRL, TRL_LONG_CONTEXT)
    B = cp.boundary_bytes
    assert B == stock.boundary_bytes == (SEQ // 8) * DENSE.hidden * 2
    fixed = stock.boundaries_device - DENSE.layers * B  # the final norm's tensors
    assert cp.boundaries_device == B + fixed
    # Every layer input pinned through torch's caching host allocator (a power of two).
    assert cp.boundaries_host == DENSE.layers * (1 << (B - 1).bit_length())
    assert cp.boundaries_offloaded == DENSE.layers
    without = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp",
                       recipe=replace(TRL_LONG_CONTEXT, checkpoint_offload=False))
    assert without.boundaries_device == stock.boundaries_device
    assert without.boundaries_host == 0
    assert without.total - cp.total == (DENSE.layers - 1) * B


def test_chunked_loss_never_builds_the_logits():
    stock, cp = _pair(DENSE, TRL, TRL_LONG_CONTEXT)
    n, H, V, b = SEQ // 8, DENSE.hidden, DENSE.vocab, 2
    expect = 3 * b * n * H + 256 * V * (b + 8) + 37 * n + (b + 4) * V * H
    assert cp.vocab == expect
    assert cp.vocab < stock.vocab / 10  # stock's N x V logits in bf16 and fp32
    # A bigger chunk holds more logits, linearly.
    big = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp",
                   recipe=replace(TRL_LONG_CONTEXT, loss_chunk=512))
    assert big.vocab - cp.vocab == 256 * V * (b + 8)


def test_attention_as_pytorch_cp_holds_it():
    """allgather holds the whole K and V where alltoall holds two ring blocks; both add the
    fp32 accumulators of torch's ring backward."""
    gather = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp",
                      recipe=replace(TRL_LONG_CONTEXT, kv="allgather", hf_norms=False))
    ring = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp",
                    recipe=replace(TRL_LONG_CONTEXT, kv="alltoall", hf_norms=False))
    n, w_kv = SEQ // 8, DENSE.kv_heads * 2 * DENSE.head_dim
    assert gather.other - ring.other == 2 * SEQ * w_kv - 2 * 2 * n * w_kv
    stock = estimate(DENSE, TRL, SEQ)
    w_q = DENSE.heads * DENSE.head_dim
    mlp = 2 * DENSE.dense_ffn * n  # unfused: 4 F_d per token, not 3
    assert ring.other - stock.other == (4 + 2) * n * (w_q + w_kv) + 8 * n * w_kv + mlp


def test_hf_norms_and_tiled_mlp():
    base = replace(TRL_LONG_CONTEXT, hf_norms=False)
    plain = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=base)
    norms = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=replace(base, hf_norms=True))
    n, H = SEQ // 8, DENSE.hidden
    qk = (4 + 2) * n * (DENSE.heads + DENSE.kv_heads) * DENSE.head_dim  # Qwen3's q/k norms
    assert norms.other - plain.other == (8 + 2) * n * H + qk
    tiled = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=replace(base, tiled_mlp=True))
    assert plain.other - tiled.other == 2 * DENSE.dense_ffn * 4 * (n - H)


def test_model_state_on_the_device_or_the_host():
    on_device = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=TRL_LONG_CONTEXT)
    on_host = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp",
                       recipe=replace(TRL_LONG_CONTEXT, params_on_host=True))
    fsdp = estimate(DENSE, TRL, SEQ, baseline="fsdp2-offload")
    # FSDP2's CPU offload: the fsdp2-offload state, its output layer gathered by the loss.
    assert (on_host.weights, on_host.grads, on_host.optimizer_device) == \
        (fsdp.weights, fsdp.grads, 0)
    assert on_host.optimizer_host == fsdp.optimizer_host
    # On the device: 16 B per sharded parameter with the fp32 master, 4·b without it.
    from megatron_flat.plan.baselines import largest_layer_params

    unit = largest_layer_params(DENSE, TRL, 0, DENSE.layers)
    state = on_device.weights + on_device.grads + on_device.optimizer_device
    shard = math.ceil((on_device.params) / 8)
    assert state == 16 * shard + 2 * 2 * unit + 4 * unit
    bf16 = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp",
                    recipe=replace(TRL_LONG_CONTEXT, fp32_master=False))
    assert bf16.weights + bf16.grads + bf16.optimizer_device == 8 * shard + 2 * 2 * unit \
        + 2 * unit


def test_moe_keeps_stock_dispatch():
    layout = Layout(tp=1, cp=8, ep=8)
    stock, cp = _pair(MOE, layout, FSDP2_CP)
    assert cp.dispatch == stock.dispatch  # the recipe does not chunk dispatch


def test_recipe_only_for_fsdp2_cp_and_checked():
    with pytest.raises(PlanError, match="describes the fsdp2-cp baseline"):
        estimate(DENSE, TRL, SEQ, baseline="fsdp2-offload", recipe=FSDP2_CP)
    with pytest.raises(PlanError, match="kv 'ring'"):
        Fsdp2CP(kv="ring")
    with pytest.raises(PlanError, match="optimizer_on_host"):
        Fsdp2CP(params_on_host=True, optimizer_on_host=True)
    with pytest.raises(PlanError, match="loss_chunk"):
        Fsdp2CP(loss_chunk=0)


def test_step_counts_of_the_recipe():
    """save_on_cpu's copies on the compute stream, the chunked loss's extra forward, FSDP2's
    collectives without host copies when the state stays on the device."""
    stock = estimate(DENSE, TRL, SEQ)
    cp = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=TRL_LONG_CONTEXT)
    s, c = unit_costs(DENSE, TRL, stock, None), unit_costs(DENSE, TRL, cp, None)
    moved = DENSE.layers * cp.boundary_bytes
    assert c["boundaries"][0]["h2d_bytes"] == c["boundaries"][0]["d2h_bytes"] == moved
    assert c["boundaries"][1].copy_hidden == 0  # both copies on the compute stream
    assert c["boundaries"][0]["flops"] == s["boundaries"][0]["flops"]
    assert c["vocab"][0]["flops"] == pytest.approx(s["vocab"][0]["flops"] * 4 / 3)
    assert c["parameters"][0]["h2d_bytes"] == 0 and c["parameters"][0]["other_collective_bytes"] > 0
    assert "host_mem_bytes" not in c["optimizer"][0]  # AdamW on the device
    host = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=FSDP2_CP)
    h = unit_costs(DENSE, TRL, host, None)
    assert h["optimizer"][0]["host_mem_bytes"] > 0 and h["parameters"][0]["h2d_bytes"] > 0


# ------------------------------------------------------------------ megatron-offload

MEGA = Layout(tp=4, cp=2, ep=8)


def test_megatron_offload_keeps_what_no_group_covers():
    """Per layer and microbatch the router's input, its bookkeeping, the LSE and the norms'
    rstd stay; one layer's groups stay whole (the last of the first backward microbatch);
    the other layers' groups are on the host, each pinned rounded to a power of two."""
    from megatron_flat.plan.peaks import (
        ROUTER_BYTES_PER_ROUTE,
        ROUTER_BYTES_PER_TOKEN,
        ROUTER_BYTES_PER_TOKEN_EXPERT,
        skew_baseline,
    )
    from megatron_flat.plan.recipes import offloaded_per_layer

    stock = estimate(MOE, MEGA, SEQ, baseline="megatron-cpu-offload")
    off = estimate(MOE, MEGA, SEQ, baseline="megatron-offload")
    n = SEQ // MEGA.cp
    n_sp, H, b = n // MEGA.tp, MOE.hidden, 2
    sigma = skew_baseline(MOE, MEGA, 1.5)
    o = offloaded_per_layer(MOE, MEGA, n, n_sp, sigma, True)
    w_qkv = (MOE.heads * MOE.head_dim + MOE.kv_heads * 2 * MOE.head_dim) // MEGA.tp
    w_o = MOE.heads * MOE.head_dim // MEGA.tp
    assert o == 3 * b * n_sp * H + b * n * (w_qkv + w_o) \
        + int(b * sigma * MOE.topk * n_sp * (H + 2 * MOE.expert_ffn))
    router = n_sp * (ROUTER_BYTES_PER_TOKEN_EXPERT * MOE.experts
                     + ROUTER_BYTES_PER_ROUTE * MOE.topk + ROUTER_BYTES_PER_TOKEN)
    r = b * n_sp * H + router + 4 * n * MOE.heads // MEGA.tp + 8 * n_sp
    L = MOE.layers
    fixed = stock.boundaries_device - L * stock.boundary_bytes
    assert off.boundaries_device == L * r + o + fixed
    assert off.boundaries_host == (L - 1) * (1 << (o - 1).bit_length())
    assert off.offloaded_per_layer == o and off.boundaries_offloaded == L - 1
    # The model state is --optimizer-cpu-offload's; dispatch, other and vocab are stock's.
    for term in ("weights", "grads", "optimizer_device", "dispatch", "other", "vocab"):
        assert getattr(off, term) == getattr(stock, term), term
    assert off.optimizer_host == stock.optimizer_host
    # What stays per layer outweighs full recompute's one layer input.
    assert r > stock.boundary_bytes


def test_megatron_offload_needs_the_distributed_optimizer():
    from megatron_flat.plan.model import PlanError

    with pytest.raises(PlanError, match="distributed optimizer"):
        estimate(MOE, replace(MEGA, distributed_optimizer=False), SEQ,
                 baseline="megatron-offload")


def test_megatron_offload_step_runs_no_full_recompute():
    stock = estimate(MOE, MEGA, SEQ, baseline="megatron-cpu-offload")
    off = estimate(MOE, MEGA, SEQ, baseline="megatron-offload")
    s, c = unit_costs(MOE, MEGA, stock, None), unit_costs(MOE, MEGA, off, None)
    assert c["boundaries"][0]["flops"] == pytest.approx(s["boundaries"][0]["flops"] * 3 / 4)
    moved = (MOE.layers - 1) * off.offloaded_per_layer
    assert c["boundaries"][0]["h2d_bytes"] == c["boundaries"][0]["d2h_bytes"] == moved
    assert c["boundaries"][1].copy_hidden == 1.0  # side streams
    assert c["dispatch"][0]["flops"] < s["dispatch"][0]["flops"]  # experts run once forward
    assert c["optimizer"] == s["optimizer"]  # HybridDeviceOptimizer either way


def test_ulysses_exchanges_heads_where_they_split():
    from megatron_flat.plan.recipes import attention_method, ulysses_fits

    plain = replace(TRL_LONG_CONTEXT, hf_norms=False)
    uly = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=replace(plain, kv="ulysses"))
    ring = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=replace(plain, kv="alltoall"))
    stock = estimate(DENSE, TRL, SEQ)
    n, w_kv = SEQ // 8, DENSE.kv_heads * 2 * DENSE.head_dim
    w_q = DENSE.heads * DENSE.head_dim
    mlp = 2 * DENSE.dense_ffn * n
    # 8 K/V heads over CP 8: no replication; the all-to-all's second copy, no ring blocks.
    assert uly.other - stock.other == 2 * n * (w_q + w_kv) - 2 * 2 * n * w_kv + mlp
    assert uly.other < ring.other
    # K/V heads fewer than CP are replicated up to CP (Qwen3-30B-A3B: 4 over CP 8).
    cp8 = Layout(tp=1, cp=8, ep=8)
    assert ulysses_fits(MOE, cp8) and attention_method(FSDP2_CP, MOE, cp8) == "ulysses"
    a = estimate(MOE, cp8, SEQ, baseline="fsdp2-cp", recipe=replace(plain, kv="ulysses"))
    s = estimate(MOE, cp8, SEQ)
    w_kv, w_kv8 = 4 * 256, 8 * 256
    w_q = MOE.heads * MOE.head_dim
    assert a.other - s.other == 2 * n * (w_q + w_kv8) + 2 * n * (w_kv8 - w_kv) - 2 * 2 * n * w_kv
    # 32 query heads do not split over CP 64: auto falls back to ring blocks, asked refuses.
    wide = Layout(tp=1, cp=64, ep=1)
    assert not ulysses_fits(DENSE, wide) and attention_method(FSDP2_CP, DENSE, wide) == "alltoall"
    with pytest.raises(PlanError, match="Ulysses cannot split 32 query heads"):
        estimate(DENSE, wide, SEQ, baseline="fsdp2-cp", recipe=replace(plain, kv="ulysses"))


def test_zero3_optimizer_offload_state_and_pageable_checkpoints():
    """ALST's DeepSpeed ZeRO-3 with offload_optimizer: sharded parameters on the GPU, the
    gradient partitions (on the optimizer's device), master and moments on the host; its
    checkpoints copied to pageable memory (no power-of-two rounding)."""
    from megatron_flat.plan.baselines import largest_layer_params

    alst = replace(TRL_LONG_CONTEXT, params_on_host=False, optimizer_on_host=True,
                   pinned_checkpoints=False)
    r = estimate(DENSE, TRL, SEQ, baseline="fsdp2-cp", recipe=alst)
    unit = largest_layer_params(DENSE, TRL, 0, DENSE.layers)
    shard = math.ceil(r.params / 8)
    assert (r.weights, r.grads, r.optimizer_device) == (2 * shard + 4 * unit, 2 * unit, 0)
    assert r.optimizer_host == 16 * shard
    assert r.boundaries_host == DENSE.layers * r.boundary_bytes
    c = unit_costs(DENSE, TRL, r, None)["optimizer"][0]
    assert c["host_mem_bytes"] > 0 and c["d2h_bytes"] == c["h2d_bytes"] == 2 * shard
