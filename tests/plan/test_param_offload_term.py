"""The planner's sixth term, param offload (``plan.param_offload``): the routed experts' model
state in the host tier, two slots of one MoE layer on the device. It agrees with the runtime's
own layout (``params.plan``), keeps the device state flat in depth, goes with the optimizer
state into the node's host budget, is tried by ``fit`` only after the five, and raises the
paper presets' reach where the host memory allows (and says by how much where it does not)."""

import dataclasses
import json

import pytest
import torch

from megatron_flat.config import FlatConfig
from megatron_flat.params.plan import ALIGNMENT, ParamOffloadPlan, layer_layout
from megatron_flat.plan import param_offload as po
from megatron_flat.plan.cli import main
from megatron_flat.plan.costs import unit_costs
from megatron_flat.plan.fit import (
    KNOBS,
    NEEDS,
    DoesNotFit,
    _Planner,
    fit,
    max_context,
    param_offload_host_binds,
    reach_techniques,
)
from megatron_flat.plan.layouts import fewest_gpus
from megatron_flat.plan.model import Layout, ModelSpec, PlanError, default_layout, preset
from megatron_flat.plan.peaks import estimate

GPU, HOST = 141 << 30, 2 << 40
TINY = ModelSpec(name="tiny-moe", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64,
                 vocab=1024, experts=8, topk=2, expert_ffn=128)
ON = FlatConfig(dispatch="pipelined", optimizer_offload=True, param_offload=True)
OFF = FlatConfig(dispatch="pipelined", optimizer_offload=True)


def test_the_term_is_the_runtime_layout():
    # One MoE layer's E_l experts as the runtime packs them (each expert's fc1 2F x H and
    # fc2 H x F in bf16): the slots and host tier the planner counts, up to the alignment.
    layout = Layout(tp=1, ep=2, dp=2)
    e_local = TINY.experts // layout.ep
    shapes = [((2 * TINY.expert_ffn, TINY.hidden), torch.bfloat16),
              ((TINY.hidden, TINY.expert_ffn), torch.bfloat16)] * e_local
    runtime = ParamOffloadPlan(tuple(layer_layout(shapes) for _ in range(TINY.layers)))
    term = po.term(TINY, layout, e_local * TINY.expert_params() * TINY.layers)
    slack = ALIGNMENT * len(shapes)  # at most one alignment pad per tensor per range
    assert 0 <= runtime.device_bytes - (term.device_weights + term.device_grads) \
        <= 4 * slack
    assert 0 <= runtime.host_bytes - term.host_bytes <= 2 * TINY.layers * slack
    h2d, d2h = runtime.microbatch_bytes(first=False)
    want_h2d, want_d2h = term.microbatch_bytes()
    # byte counts: the runtime's exceed the term's by alignment pads only (per layer:
    # weights up twice, gradients up once and down once)
    assert 0 <= h2d - want_h2d <= 3 * TINY.layers * slack
    assert 0 <= d2h - want_d2h <= TINY.layers * slack


@pytest.mark.parametrize("layers", [4, 8, 16])
def test_device_model_state_is_flat_in_depth(layers):
    model = dataclasses.replace(TINY, layers=layers)
    layout = Layout(tp=1, ep=2, dp=2)
    on, off = estimate(model, layout, 4096, ON), estimate(model, layout, 4096, OFF)
    e_layer = (model.experts // layout.ep) * model.expert_params()
    b = model.bytes_per_value
    assert on.params_slots == 2 * (b + 4) * e_layer  # whatever the depth
    assert on.params_offloaded == layers * e_layer
    assert on.params_host == (b + 4) * layers * e_layer
    assert off.weights + off.grads - (on.weights + on.grads) == \
        (b + 4) * layers * e_layer - on.params_slots
    # every expert stepped on every replica (expert-DP 2 here): 12 B each on the host
    dense_shard = (off.optimizer_host - 12 * -(-layers * e_layer // layout.expert_dp)) // 12
    assert on.optimizer_host == 12 * (dense_shard + layers * e_layer)
    assert on.host_per_device == on.boundaries_host + on.optimizer_host + on.params_host
    assert on.host_pinned == on.host_per_device


def test_estimate_refuses_where_install_does():
    with pytest.raises(PlanError, match="param offload needs expert parallelism"):
        estimate(TINY, Layout(tp=1, ep=1, dp=2), 4096, ON)
    assert po.applies(Layout(tp=1, ep=2, dp=2),
                      dataclasses.replace(TINY, experts=0, dense_ffn=64)) is not None


def test_fit_tries_it_only_after_the_five_and_only_with_what_it_needs():
    model = preset("paper-120b")
    layout = default_layout(model, 16)
    planner = _Planner(model, layout, GPU, HOST, 0.1, 0.1, 1.5, 1024, KNOBS)
    subsets = list(planner.subsets())
    first = next(i for i, s in enumerate(subsets) if "param_offload" in s)
    assert all("param_offload" not in s for s in subsets[:first])
    assert all("param_offload" in s and set(NEEDS["param_offload"]) <= set(s)
               for s in subsets[first:])
    # without one of what it needs it is not tried at all
    planner = _Planner(model, layout, GPU, HOST, 0.1, 0.1, 1.5, 1024,
                       tuple(k for k in KNOBS if k != "dispatch"))
    assert "param_offload" not in planner.allow


def test_fit_turns_it_on_only_where_the_five_do_not_fit():
    model = preset("paper-120b")
    layout = Layout(tp=8, cp=2, ep=16)
    assert "param_offload" not in fit(model, layout, 6 << 20, GPU, HOST).enabled
    chosen = fit(model, layout, 8 << 20, GPU, HOST)
    assert "param_offload" in chosen.enabled and chosen.flat.param_offload
    without = tuple(k for k in KNOBS if k != "param_offload")
    with pytest.raises(DoesNotFit):
        fit(model, layout, 8 << 20, GPU, HOST, allow=without)
    # the node check: with the host too small for the experts beside the optimizer state,
    # it is not chosen (and the error says why)
    small = 1000 << 30  # 112.5 GiB per GPU: 85 for the optimizer state, not 41 more
    with pytest.raises(DoesNotFit, match="cannot hold the routed experts"):
        fit(model, layout, 8 << 20, GPU, small)


def test_paper_reach_rises_where_the_host_allows():
    # paper-120b on 16 GPUs: >= 8M (6617K without); paper-667b on 64: the host binds.
    model = preset("paper-120b")
    reach = max_context(model, Layout(tp=8, cp=2, ep=16), GPU, HOST)
    assert reach.flat >= 8 << 20 and reach.flat_without_param_offload == 6617 * 1024
    assert reach.flat > reach.flat_without_param_offload
    assert reach_techniques(reach) == KNOBS
    assert param_offload_host_binds(model, Layout(tp=8, cp=2, ep=16), GPU, HOST, reach) is None
    model = preset("paper-667b")
    layout = Layout(tp=8, cp=8, ep=64)
    reach = max_context(model, layout, GPU, HOST)
    assert reach.flat == reach.flat_without_param_offload
    assert "param_offload" not in reach_techniques(reach)
    binds = param_offload_host_binds(model, layout, GPU, HOST, reach)
    assert binds.unlimited_with > binds.unlimited_without > reach.flat
    assert binds.host_per_node_needed > HOST


def test_step_time_counts_its_copies():
    model = preset("paper-120b")
    layout = Layout(tp=8, cp=2, ep=16)
    flat = fit(model, layout, 8 << 20, GPU, HOST).flat
    report = estimate(model, layout, 8 << 20, flat)
    units = unit_costs(model, layout, report, flat)
    counts, overlap = units["parameters"]
    p_e, b = report.params_offloaded, model.bytes_per_value
    assert counts == {"h2d_bytes": (2 * b + 4) * p_e, "d2h_bytes": 4 * p_e}
    assert overlap.copy_hidden == 1.0 and overlap.stages == model.moe_layers
    assert overlap.beside_flops > 0
    # the experts' optimizer step: their gradients up, their weights down (expert-DP 1 here)
    plain = unit_costs(model, layout, estimate(model, layout, 8 << 20,
                                               dataclasses.replace(flat, param_offload=False)),
                       dataclasses.replace(flat, param_offload=False))["optimizer"][0]
    opt = units["optimizer"][0]
    assert opt["h2d_bytes"] - plain["h2d_bytes"] == 4 * p_e
    assert opt["d2h_bytes"] - plain["d2h_bytes"] == b * p_e


def test_fewest_gpus_with_and_without():
    model = preset("paper-120b")
    found = fewest_gpus(model, 1 << 20, GPU, 4 << 40, counts=(4, 8))
    assert found["flat"].gpus == 4 and found["flat_without_param_offload"].gpus == 8
    assert found["flat"].layout.gpus == 4
    found = fewest_gpus(model, 1 << 20, GPU, HOST, counts=(4, 8))
    assert found["flat"].gpus == found["flat_without_param_offload"].gpus == 8


def test_cli_fewest_gpus(capsys):
    argv = ["--model", "paper-120b", "--seq", "1M", "--gpu-mem", "141GiB", "--host-mem",
            "4TiB", "--fewest-gpus"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fewest_gpus"]["flat"]["gpus"] == 4
    assert data["fewest_gpus"]["flat_without_param_offload"] == {
        "gpus": 8, "tp": 8, "cp": 1, "pp": 1, "ep": 8, "dp": 1}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "megatron-flat, no param offload      8   TP 8 CP 1 PP 1 DP 1 EP 8" in text
    assert main(argv[:2] + argv[4:]) == 2
    assert "--fewest-gpus needs --seq" in capsys.readouterr().err


def test_cli_reports_it(capsys):
    argv = ["--model", "paper-120b", "--gpus", "16", "--layout", "tp=8,cp=2,ep=16", "--seq",
            "8M", "--gpu-mem", "141GiB", "--host-mem", "2TiB"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "param offload: the routed experts' weights and fp32 gradients" in text
    assert "--flat-optimizer-num-slots 2 --flat-param-offload" in text
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["knobs"]["param_offload"] is True
    assert data["max_context_on_layout"]["flat_without_param_offload"] == 6617 * 1024
    assert data["param_offload_host_binds"] is None
