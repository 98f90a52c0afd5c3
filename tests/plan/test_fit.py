"""Choosing the knobs (fit) and the longest context (max_context)."""

from dataclasses import replace

import pytest

from megatron_flat.config import FlatConfig
from megatron_flat.plan import (
    DoesNotFit,
    Layout,
    ModelSpec,
    PlanError,
    default_layout,
    estimate,
    fit,
    max_context,
    preset,
)
from megatron_flat.plan.fit import KNOBS, enabled, host_budget_per_device, seq_granularity

GPU = 141 << 30
HOST = 2 << 40
MILLION = 1 << 20


@pytest.fixture(scope="module")
def paper667():
    model = preset("paper-667b")
    return model, default_layout(model, 64)


def _fits(result, layout, host=HOST, margin=0.1):
    report = result.report
    host_budget = host_budget_per_device(layout, host, 0.1)
    return report.total <= int(GPU * (1 - margin)) and report.host_per_device <= host_budget


def test_fit_leaves_everything_off_when_the_baseline_fits():
    model = preset("qwen3-30b-a3b")
    layout = default_layout(model, 64)
    result = fit(model, layout, 8192, GPU, HOST)
    assert result.enabled == () and result.flat == FlatConfig()
    assert result.report.total == result.baseline.total <= result.budget


def test_fit_picks_knobs_that_fit(paper667):
    model, layout = paper667
    result = fit(model, layout, MILLION, GPU, HOST)
    assert result.baseline.total > result.budget       # the baseline does not fit
    assert _fits(result, layout)
    # The returned config reproduces the report.
    assert estimate(model, layout, MILLION, result.flat).total == result.report.total
    assert result.enabled and all(enabled(result.flat, t) for t in result.enabled)


def test_fit_turns_on_more_as_the_context_grows(paper667):
    model, layout = paper667
    short = fit(model, layout, MILLION, GPU, HOST)
    long = fit(model, layout, 4 * MILLION, GPU, HOST)
    assert len(long.enabled) > len(short.enabled)
    assert _fits(long, layout)


def test_relaxed_knobs_are_the_cheapest_that_fit(paper667):
    model, layout = paper667
    result = fit(model, layout, 4 * MILLION, GPU, HOST)
    # The memory knobs as relaxed, before attention replay (a speed knob) was added.
    cfg, budget = result.without_replay or result.flat, result.budget
    report = estimate(model, layout, 4 * MILLION, cfg)
    host = host_budget_per_device(layout, HOST, 0.1)

    def ok(c):
        r = estimate(model, layout, 4 * MILLION, c)
        return r.total <= budget and r.host_per_device <= host

    if cfg.dispatch == "pipelined":                    # one chunk fewer does not fit
        k = report.num_chunks
        n_sp = report.tokens_sp
        assert not ok(replace(cfg, dispatch_chunk_tokens=-(-n_sp // (k - 1)),
                              dispatch_max_chunks=k - 1))
    if cfg.sco:                                         # one boundary fewer on host does not fit
        n, B = report.boundaries_offloaded, report.boundary_bytes
        fewer = ((n - 1) * B + B // 2) / (1 << 30)
        assert n > 0 and not ok(replace(cfg, sco_host_budget_gib=fewer))
    if cfg.optimizer_offload:
        assert cfg.optimizer_num_slots == 2 and cfg.optimizer_bucket_numel == 100_000_000


def test_fit_respects_the_host_memory(paper667):
    model, layout = paper667
    # 64 GiB of host per node cannot hold the optimizer state (~150 GiB per GPU).
    with pytest.raises(DoesNotFit) as err:
        fit(model, layout, MILLION, GPU, 64 << 30)
    message = str(err.value)
    assert "does not fit" in message and "binding term: optimizer" in message
    assert "the host cannot hold the optimizer state" in message
    assert isinstance(err.value, PlanError)


def test_fit_refuses_with_a_clear_message_when_nothing_fits(paper667):
    model, layout = paper667
    with pytest.raises(DoesNotFit, match=r"paper-667b at 1,048,576 tokens does not fit: even with "
                                         r"PipelinedLLEP, Ring-DTP, SCO, OffloadStreamAdamW, "
                                         r"attention tiles, param offload at their smallest"):
        fit(model, layout, MILLION, 8 << 30, HOST)
    # 40 GiB: only param offload holds it (its experts' 62 GiB of state go to the host).
    assert "param_offload" in fit(model, layout, MILLION, 40 << 30, HOST).enabled
    without = tuple(k for k in KNOBS if k != "param_offload")
    with pytest.raises(DoesNotFit, match="OffloadStreamAdamW, attention tiles at their"):
        fit(model, layout, MILLION, 40 << 30, HOST, allow=without)
    # Only some techniques allowed.
    with pytest.raises(DoesNotFit, match="even with PipelinedLLEP, Ring-DTP at their"):
        fit(model, layout, MILLION, GPU, HOST, allow=("dispatch", "vocab"))
    with pytest.raises(PlanError, match="unknown technique"):
        fit(model, layout, MILLION, GPU, HOST, allow=("magic",))
    with pytest.raises(PlanError, match="margin"):
        fit(model, layout, MILLION, GPU, HOST, margin=1.5)


def test_fit_without_host_limit(paper667):
    model, layout = paper667
    result = fit(model, layout, 4 * MILLION, GPU, None)
    assert result.host_budget is None and result.report.total <= result.budget


def test_max_context_bisection_is_exact(paper667):
    model, layout = paper667
    g = seq_granularity(layout)
    reach = max_context(model, layout, 256 << 30, HOST)
    budget = int((256 << 30) * 0.9)
    assert reach.granularity == g and reach.baseline % g == 0 and reach.flat % g == 0
    assert 0 < reach.baseline < reach.flat
    assert estimate(model, layout, reach.baseline).total <= budget
    assert estimate(model, layout, reach.baseline + g).total > budget
    fit(model, layout, reach.flat, 256 << 30, HOST)     # fits ...
    with pytest.raises(DoesNotFit):                     # ... and one step more does not
        fit(model, layout, reach.flat + g, 256 << 30, HOST)


def test_max_context_is_monotone_in_memory(paper667):
    model, layout = paper667
    reaches = [max_context(model, layout, gib << 30, HOST) for gib in (120, 141, 192, 288)]
    assert [r.flat for r in reaches] == sorted(r.flat for r in reaches)
    assert [r.baseline for r in reaches] == sorted(r.baseline for r in reaches)
    assert all(r.flat >= r.baseline for r in reaches)


def test_max_context_zero_when_nothing_fits():
    model = preset("paper-667b")
    layout = default_layout(model, 64)
    reach = max_context(model, layout, 16 << 30, 64 << 30)
    assert reach.baseline == 0 and reach.flat == 0


def test_max_context_on_a_small_model_and_granularity():
    model = ModelSpec(name="s", hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64,
                      vocab=32000, experts=8, topk=2, expert_ffn=512)
    layout = Layout(tp=2, cp=2)
    assert seq_granularity(layout) == 1024
    reach = max_context(model, layout, 8 << 30, None, granularity=2048)
    assert reach.granularity == 2048 and reach.flat >= reach.baseline > 0
    with pytest.raises(PlanError, match="granularity"):
        max_context(model, Layout(cp=3), 8 << 30, granularity=1000)
