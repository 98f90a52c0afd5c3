"""The baselines' terms (plan.baselines): formulas, what they share with stock Megatron,
pinned-memory rounding, reach and the step-time counts."""

import math

import pytest

from megatron_flat.plan import Layout, estimate, max_context, preset
from megatron_flat.plan.baselines import (
    BASELINES,
    RECIPE_BASELINES,
    largest_layer_params,
    param_tensors,
    pinned_bytes,
)
from megatron_flat.plan.costs import unit_costs
from megatron_flat.plan.peaks import stage_params

GIB = 1 << 30
MODEL = preset("paper-120b")
LAYOUT = Layout(tp=8, cp=2, ep=16)
SEQ = 1 << 17


def _reports():
    return {name: estimate(MODEL, LAYOUT, SEQ, baseline=name) for name in BASELINES}


def test_megatron_is_the_default_estimate():
    assert estimate(MODEL, LAYOUT, SEQ) == estimate(MODEL, LAYOUT, SEQ, baseline="megatron")


def test_only_model_state_and_fsdp_vocab_change():
    r = _reports()
    stock = r["megatron"]
    for name in set(BASELINES) - set(RECIPE_BASELINES):  # the recipes: test_recipes.py
        assert r[name].dispatch == stock.dispatch
        assert r[name].boundaries_device == stock.boundaries_device
        assert r[name].other == stock.other
        assert r[name].baseline == name
    assert r["megatron-cpu-offload"].vocab == stock.vocab


def test_cpu_offload_moves_master_and_moments_to_the_host():
    r = _reports()
    stock, hdo = r["megatron"], r["megatron-cpu-offload"]
    assert hdo.optimizer_device == 0
    assert (hdo.weights, hdo.grads) == (stock.weights, stock.grads)
    shard = stock.optimizer_device // 12
    p = stage_params(MODEL, LAYOUT, 0, MODEL.layers, True, True)
    tensors = param_tensors(MODEL, LAYOUT, 0, MODEL.layers, True, True)
    assert sum(n * c for n, c, _ in tensors) == p["dense"] + p["expert"]
    grads = pinned_bytes(tensors, LAYOUT, 4)
    assert hdo.optimizer_host == 12 * shard + grads
    assert hdo.host_pinned == grads
    # torch's caching host allocator rounds each pinned gradient up to a power of two.
    assert 4 * shard <= grads < 2 * 4 * shard + 4096 * len(tensors)
    assert hdo.total == stock.total - stock.optimizer_device


def test_fsdp2_gathers_one_layer_and_prefetches_the_next():
    r = _reports()
    stock, fsdp = r["megatron"], r["fsdp2-offload"]
    b = MODEL.bytes_per_value
    unit = largest_layer_params(MODEL, LAYOUT, 0, MODEL.layers)
    assert fsdp.weights == 2 * b * unit and fsdp.grads == 4 * unit
    assert fsdp.optimizer_device == 0
    out_layer = math.ceil(MODEL.vocab / LAYOUT.tp) * MODEL.hidden
    assert fsdp.vocab == stock.vocab + (b + 4) * out_layer
    shard = stock.optimizer_device // 12
    tensors = param_tensors(MODEL, LAYOUT, 0, MODEL.layers, True, True)
    assert fsdp.optimizer_host == pinned_bytes(tensors, LAYOUT, 4, copies=2) + 8 * shard
    assert fsdp.total < r["megatron-cpu-offload"].total < stock.total


def test_reach_of_every_baseline_is_exact():
    reach = max_context(MODEL, LAYOUT, 141 * GIB, 2 << 40)
    assert set(reach.baselines) == set(BASELINES)
    assert reach.baseline == reach.baselines["megatron"] == 0
    budget = int(141 * GIB * 0.9)
    host = int((2 << 40) * 0.9) // 8
    g = reach.granularity
    for name in ("megatron-cpu-offload", "megatron-offload", "fsdp2-offload", "fsdp2-cp"):
        n = reach.baselines[name]
        assert n > 0
        inside = estimate(MODEL, LAYOUT, n, baseline=name)
        beyond = estimate(MODEL, LAYOUT, n + g, baseline=name)
        assert inside.total <= budget and inside.host_per_device <= host
        assert beyond.total > budget or beyond.host_per_device > host
    # The PyTorch recipe's checkpoints on the host and chunked loss reach furthest.
    assert reach.baselines["fsdp2-cp"] > reach.baselines["fsdp2-offload"]
    assert reach.strongest() == "fsdp2-cp"
    assert reach.ratio() == pytest.approx(reach.flat / reach.baselines["fsdp2-cp"])


def test_baselines_step_time_counts():
    r = _reports()
    hdo = unit_costs(MODEL, LAYOUT, r["megatron-cpu-offload"], None)
    counts, overlap = hdo["optimizer"]
    shard = r["megatron"].optimizer_device // 12
    tensors = sum(n for _, n, _ in param_tensors(MODEL, LAYOUT, 0, MODEL.layers, True, True))
    assert counts["d2h_bytes"] == counts["h2d_bytes"] == 4 * shard
    assert counts["host_mem_bytes"] == 28 * shard
    assert counts["syncs"] == tensors  # a host wait before each parameter's CPU update
    assert overlap.copy_hidden == 1.0
    assert hdo["parameters"][0] == {}
    fsdp = unit_costs(MODEL, LAYOUT, r["fsdp2-offload"], None)
    counts, overlap = fsdp["parameters"]
    assert counts["h2d_bytes"] == 12 * shard and counts["d2h_bytes"] == 4 * shard
    assert overlap.beside_flops == sum(fsdp[u][0].get("flops", 0)
                                       for u in ("dispatch", "vocab", "boundaries"))
    assert "h2d_bytes" not in fsdp["optimizer"][0]
