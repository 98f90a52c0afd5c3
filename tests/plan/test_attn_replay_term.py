"""The planner's attention replay (``FlatConfig.attn_replay``): under full recompute each
layer's core-attention output O and its log-sum-exp wait in SCO's host pool, so the
recompute skips that kernel. Host bytes L_s·m·(O + LSE), one O + LSE prefetched on the
device, one core-attention forward less per layer and microbatch, its copies beside SCO's;
``fit`` turns it on where it fits and says why not elsewhere; ``plan`` shows the saving."""

import argparse
import json
from dataclasses import replace

import pytest

from megatron_flat.config import GIB, FlatConfig, add_flat_args
from megatron_flat.plan import (
    Layout,
    ModelSpec,
    default_layout,
    estimate,
    fit,
    layout_from_megatron_args,
    preset,
)
from megatron_flat.plan.cli import main
from megatron_flat.plan.costs import (
    attention_core_flops,
    attention_flops,
    attention_projection_flops,
    unit_costs,
)
from megatron_flat.plan.fit import TECHNIQUES
from megatron_flat.plan.model import PAPER_GPUS
from megatron_flat.plan.peaks import LSE_BYTES, replay_slot, sco_pool
from megatron_flat.plan.time import device

GPU, HOST, MILLION = 141 << 30, 2 << 40, 1 << 20
PAPER = ["--seq", "1M", "--gpu-mem", "141GiB", "--host-mem", "2TiB"]
SMALL = ModelSpec(name="small", hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32,
                  vocab=1000, experts=8, topk=2, expert_ffn=128)


def _on(budget_bytes: int) -> FlatConfig:
    return FlatConfig(sco=True, attn_replay=True, sco_host_budget_gib=budget_bytes / GIB)


# ------------------------------------------------------------------------------ bytes


def test_a_slot_is_one_layers_o_and_lse():
    layout = Layout(tp=2, ep=2)
    n = 4096
    o = n * (SMALL.heads // 2) * SMALL.dv * SMALL.bytes_per_value
    lse = n * (SMALL.heads // 2) * LSE_BYTES
    assert replay_slot(SMALL, layout, n) == o + lse


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_under_cp_the_ring_keeps_one_partial_per_step(cp):
    """transformer-engine's CP ring runs its kernel once per step and merges the partials:
    replay keeps each step's (O, LSE), on the ring's last rank every one for all its queries
    (n: tokens on this CP rank)."""
    n = 4096
    pair = replay_slot(SMALL, Layout(tp=2, ep=2), n)
    assert replay_slot(SMALL, Layout(tp=2, ep=2, cp=cp), n) == cp * pair


def test_host_bytes_are_layers_times_slot_times_microbatches_in_flight():
    layout = Layout(tp=2, pp=2, ep=2)           # stage 0: 2 layers, 2 microbatches in flight
    seq = 4096
    slot = replay_slot(SMALL, layout, seq)
    plain = estimate(SMALL, layout, seq, FlatConfig(sco=True, sco_host_budget_gib=1.0), stage=0)
    layers, in_flight = 2, 2
    assert plain.boundaries_held == layers * in_flight
    whole = plain.boundaries_held * (plain.boundary_bytes + slot)
    r = estimate(SMALL, layout, seq, _on(whole), stage=0)
    assert r.replay_bytes == slot and r.replay_kept == layers * in_flight
    assert r.replay_host == r.replay_need == layers * in_flight * slot
    assert r.boundaries_offloaded == plain.boundaries_offloaded == r.boundaries_held
    # the pool is SCO's budget, allocated whole: replay's bytes are in it, not beside it
    assert r.boundaries_host == r.flat.sco_host_budget_bytes >= whole
    assert r.host_per_device == r.boundaries_host + r.optimizer_host
    # one O + LSE restored ahead of its layer, on top of SCO's restored boundaries
    assert r.replay_device == slot
    assert r.boundaries_device - plain.boundaries_device == slot
    assert r.total - plain.total == slot


def test_the_pool_is_filled_first_come_boundary_then_outputs():
    B, s = 100, 120
    assert sco_pool(10_000, 4, B) == (4, 0)                     # SCO alone
    assert sco_pool(4 * (B + s), 4, B, s) == (4, 4)             # room for everything
    assert sco_pool(2 * (B + s) + B, 4, B, s) == (3, 2)         # the third layer's O refused
    assert sco_pool(2 * (B + s) + B + 50, 4, B, s) == (3, 2)
    assert sco_pool(4 * s, 4, B, s) == (2, 2)                   # replay's bytes alone: not enough
    assert sco_pool(0, 4, B, s) == (0, 0)


def test_replay_keeps_nothing_without_full_recompute_or_a_host_budget():
    layout, seq = Layout(tp=2, ep=2), 4096
    big = 1 << 30
    assert estimate(SMALL, layout, seq, _on(big)).replay_kept == 4
    why = {
        "recompute": estimate(SMALL, replace(layout, full_recompute=False), seq, _on(big)),
        "SCO": estimate(SMALL, layout, seq, FlatConfig(attn_replay=True)),
        "host budget": estimate(SMALL, layout, seq, replace(_on(big), sco_host_budget_gib=0.0)),
    }
    for word, r in why.items():
        assert r.replay_kept == 0 and r.replay_device == 0 and word in r.replay_off, word
    assert estimate(SMALL, layout, seq, FlatConfig(sco=True)).replay_off is None  # not asked


def test_layout_from_megatron_args_reads_the_recompute():
    args = argparse.Namespace(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                              world_size=2, recompute_granularity="full")
    assert layout_from_megatron_args(args).full_recompute
    args.recompute_granularity = "selective"
    assert not layout_from_megatron_args(args).full_recompute


# ------------------------------------------------------------------------------ costs


def _boundaries(model, layout, seq, flat):
    report = estimate(model, layout, seq, flat)
    return report, unit_costs(model, layout, report, flat)["boundaries"][0]


def test_one_core_attention_forward_less_per_layer_and_microbatch():
    layout, seq = Layout(tp=2, ep=2), 4096
    n = seq // layout.cp
    plain_r, plain = _boundaries(SMALL, layout, seq, FlatConfig(sco=True, sco_host_budget_gib=1.0))
    r, on = _boundaries(SMALL, layout, seq, _on(1 << 30))
    core = attention_core_flops(SMALL, layout, seq, n)
    proj = attention_projection_flops(SMALL, layout, n)
    assert attention_flops(SMALL, layout, seq, n) == proj + core
    layers = SMALL.layers
    assert plain["flops"] == pytest.approx(4 * (proj + core) * layers)
    assert on["flops"] == pytest.approx((4 * proj + 3 * core) * layers)  # projections re-run
    assert plain["flops"] - on["flops"] == pytest.approx(layers * core)
    # each layer's O + LSE down in the forward, up in the backward, beside SCO's boundaries
    assert r.boundaries_offloaded == plain_r.boundaries_offloaded == layers
    for key in ("h2d_bytes", "d2h_bytes"):
        assert on[key] - plain[key] == layers * r.replay_bytes
    assert on["h2d_bytes"] == on["d2h_bytes"] == layers * (r.boundary_bytes + r.replay_bytes)


def test_layers_whose_outputs_the_pool_refused_run_the_kernel():
    layout, seq = Layout(tp=2, ep=2), 4096
    r0 = estimate(SMALL, layout, seq, _on(1 << 30))
    B, s = r0.boundary_bytes, r0.replay_bytes
    r, half = _boundaries(SMALL, layout, seq, _on(2 * (B + s) + B // 2))
    _, whole = _boundaries(SMALL, layout, seq, _on(1 << 30))
    assert (r.boundaries_offloaded, r.replay_kept) == sco_pool(2 * (B + s) + B // 2, 4, B, s)
    core = attention_core_flops(SMALL, layout, seq, seq)
    assert half["flops"] - whole["flops"] == pytest.approx((4 - r.replay_kept) * core)


# -------------------------------------------------------------------------------- fit


@pytest.fixture(scope="module")
def paper120():
    return preset("paper-120b"), Layout(tp=8, cp=2, ep=16)


def test_fit_turns_replay_on_where_the_host_holds_it(paper120):
    model, layout = paper120
    chosen = fit(model, layout, MILLION, GPU, HOST)
    r = chosen.report
    assert chosen.flat.attn_replay and chosen.attn_replay_why is None
    assert chosen.flat.sco and r.replay_kept == r.boundaries_held == model.layers
    # SCO's pool holds every boundary, then every layer's O + LSE (first come, in order)
    assert r.boundaries_offloaded == r.boundaries_held
    assert r.boundaries_host >= r.boundaries_held * (r.boundary_bytes + r.replay_bytes)
    assert r.boundaries_host - r.boundaries_held * (r.boundary_bytes + r.replay_bytes) < 1 << 21
    # replay is a speed knob: the memory techniques are what they were without it
    off = fit(model, layout, MILLION, GPU, HOST, allow=TECHNIQUES)
    assert chosen.without_replay == off.flat and not off.flat.attn_replay
    assert "not allowed" in off.attn_replay_why and chosen.enabled == off.enabled


def test_the_printed_budget_still_holds_every_layer(paper120):
    from megatron_flat.plan.cli import flat_flags

    model, layout = paper120
    chosen = fit(model, layout, MILLION, GPU, HOST)
    flags = flat_flags(chosen.flat)
    assert "--flat-attn-replay" in flags.split()
    parsed = FlatConfig.from_args(add_flat_args(argparse.ArgumentParser()).parse_args(
        flags.split()))
    assert parsed.attn_replay
    assert estimate(model, layout, MILLION, parsed).replay_kept == model.layers


def test_fit_leaves_replay_off_and_says_why(paper120):
    model, layout = paper120
    # 800 GiB per node: 90 GiB per GPU holds the optimizer state (85 GiB), not SCO's pool too
    small_host = fit(model, layout, MILLION, GPU, 800 << 30)
    assert not small_host.flat.attn_replay and small_host.attn_replay_why.startswith(
        "host memory")
    selective = fit(model, replace(layout, full_recompute=False), MILLION, GPU, HOST)
    assert not selective.flat.attn_replay and "full recompute" in selective.attn_replay_why
    # paper-667b on TP 8 x CP 8 x EP 32: every boundary already on host, and the prefetched
    # O + LSE no longer fits the device
    tight = fit(preset("paper-667b"), Layout(tp=8, cp=8, ep=32), MILLION, GPU, HOST)
    assert not tight.flat.attn_replay and tight.attn_replay_why.startswith("device memory")
    qwen = preset("qwen3-30b-a3b")
    baseline_fits = fit(qwen, default_layout(qwen, 64), 8192, GPU, HOST)  # runs stock Megatron
    assert baseline_fits.flat == FlatConfig() and "baseline fits" in baseline_fits.attn_replay_why


# ------------------------------------------------------------------------ plan and time


def _plan(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PAPER_GPUS))
def test_the_predicted_1m_step_drops_by_the_kernels_skipped(capsys, name):
    data = json.loads(_plan(capsys, ["--model", name, "--json"] + PAPER))
    replay = data["attn_replay"]
    model = preset(name)
    lay = data["layout"]
    layout = Layout(tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], dp=lay["dp"], ep=lay["ep"])
    assert replay["on"] and replay["why_off"] is None
    assert "--flat-attn-replay" in data["knobs"]["flags"].split() and data["knobs"]["attn_replay"]
    assert "attn_replay" in data["knobs"]["enabled"]
    assert replay["layers_kept"] == model.layers and replay["host_bytes_per_device"] == \
        model.layers * replay["bytes_per_layer"]
    assert replay["step_s"] == data["predicted_time"]["step_s"]["flat"]
    assert replay["saved_s"] == pytest.approx(replay["step_s_without"] - replay["step_s"])
    # the saving is the core-attention forwards skipped (one per layer), at the device's
    # matmul rate, less the first copy the pipeline leaves exposed
    dev = device("H200")
    n = MILLION // layout.cp
    skipped = model.layers * attention_core_flops(model, layout, MILLION, n)
    assert replay["saved_s"] == pytest.approx(skipped / (dev.flops * dev.matmul_efficiency),
                                              rel=0.01)
    assert 0.18 < replay["saved_s"] / replay["step_s_without"] < 0.25


def test_plan_without_replay_and_the_table(capsys):
    argv = ["--model", "paper-120b", "--layout", "tp=8,cp=2,pp=1,ep=16"] + PAPER
    off = json.loads(_plan(capsys, argv + ["--json", "--without", "attn_replay"]))
    assert not off["attn_replay"]["on"] and "not allowed" in off["attn_replay"]["why_off"]
    assert "--flat-attn-replay" not in off["knobs"]["flags"]
    on = json.loads(_plan(capsys, argv + ["--json"]))
    assert on["predicted_time"]["step_s"]["flat"] == pytest.approx(
        off["predicted_time"]["step_s"]["flat"] - on["attn_replay"]["saved_s"])
    assert on["attn_replay"]["step_s_without"] == pytest.approx(
        off["predicted_time"]["step_s"]["flat"])
    table = _plan(capsys, argv)
    assert "attention replay: O + LSE of 7 layers" in table
    assert "of which attention replay" in table and "--flat-attn-replay" in table
    table = _plan(capsys, argv + ["--without", "attn_replay"])
    assert "attention replay: off (not allowed (--without attn_replay))" in table
    all_on = json.loads(_plan(capsys, argv + ["--json", "--all-on"]))
    assert not all_on["knobs"]["attn_replay"] and "--all-on" in all_on["attn_replay"]["why_off"]
