"""Searching the layout (``plan.layouts``) and the CLI's layouts: the search is exact where
it prunes, beats the old fixed layout, ranks every baseline on its own layouts, and
``--layout`` fixes sizes."""

import json

import pytest

from megatron_flat.plan import Layout, PlanError, default_layout, fit, max_context, preset
from megatron_flat.plan.baselines import BASELINES, PAPER_LABEL, paper_layout
from megatron_flat.plan.cli import main
from megatron_flat.plan.fit import TECHNIQUES, seq_granularity
from megatron_flat.plan.layouts import (
    EP_NOT_MONOTONE,
    LAYOUT_KEYS,
    SAME_SPEED,
    candidate_layouts,
    parse_layout,
    preference,
    search_layouts,
    step_seconds,
    unit_times,
)
from megatron_flat.plan.time import predict

GPU, HOST = 141 << 30, 2 << 40
PAPER = ["--seq", "1M", "--gpu-mem", "141GiB", "--host-mem", "2TiB"]
LIMIT = 1 << 26  # keeps the exhaustive reaches below cheap


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def sizes(layout):
    return (layout.tp, layout.cp, layout.pp, layout.dp, layout.ep)


@pytest.fixture(scope="module", params=[("paper-120b", 8, GPU, HOST),
                                        ("qwen3-30b-a3b", 8, 80 << 30, 1 << 40)],
                ids=["paper-120b-8", "qwen3-30b-a3b-8"])
def exhaustive(request):
    """Every candidate's reach for every run, no pruning (``max_context`` per layout)."""
    name, gpus, mem, host = request.param
    model = preset(name)
    reach = {}
    for layout in candidate_layouts(model, gpus):
        r = max_context(model, layout, mem, host, limit=LIMIT)
        reach[layout] = dict(r.baselines, flat=r.flat)
    return model, gpus, mem, host, reach


def test_search_is_the_exhaustive_top_three(exhaustive):
    """The pruned search returns exactly what evaluating every layout gives: per run, the
    three longest reaches (ties to the preferred layout), only layouts that fit something."""
    model, gpus, mem, host, reach = exhaustive
    search = search_layouts(model, gpus, mem, host, limit=LIMIT)
    assert search.candidates == len(reach)
    assert search.bisections < 4 * len(reach)  # it did prune
    for run in ("flat",) + BASELINES:
        ranked = sorted((lay for lay in reach if reach[lay][run]),
                        key=lambda lay: (-reach[lay][run],) + preference(lay))[:3]
        assert [(r.layout, r.reach) for r in search.reach[run]] == \
            [(lay, reach[lay][run]) for lay in ranked], run
    assert search.chosen == search.reach["flat"][0].layout and search.chosen_by == "reach"


def test_pruning_facts_hold_over_every_layout(exhaustive):
    """The search skips a narrower EP once a wider one falls short, and a DP > 1 once its
    layout with DP folded into CP falls short; both rest on these facts of the peak model."""
    model, gpus, mem, host, reach = exhaustive
    checked = {"ep": 0, "dp": 0}
    for lay, r in reach.items():
        for wide, rw in reach.items():
            if sizes(wide)[:4] == sizes(lay)[:4] and wide.ep > lay.ep:
                checked["ep"] += 1
                # EP 1 is evaluated for EP_NOT_MONOTONE runs whatever a wider EP reached.
                assert all(r[run] <= rw[run] for run in r
                           if run not in EP_NOT_MONOTONE or lay.ep > 1), (lay, wide)
        if lay.dp > 1:
            folded = lay.with_(cp=lay.cp * lay.dp, dp=1)
            if folded in reach and seq_granularity(folded) == seq_granularity(lay):
                checked["dp"] += 1
                assert all(r[run] <= reach[folded][run] for run in r), lay
    assert checked["ep"] > 10 and checked["dp"] > 10


@pytest.mark.parametrize("name, gpus", [("paper-120b", 16), ("paper-241b", 32),
                                        ("paper-667b", 64)])
def test_search_reaches_at_least_the_default_layout(name, gpus):
    model = preset(name)
    search = search_layouts(model, gpus, GPU, HOST)
    default = max_context(model, default_layout(model, gpus), GPU, HOST)
    assert search.best_reach("flat") >= default.flat > 0
    for run in BASELINES:
        assert search.best_reach(run) >= default.baselines[run]
    assert len({sizes(r.layout) for r in search.reach["flat"]}) == 3
    # Without the attention tiles, the gathered N x H makes TP 8 costly: at the paper's scale
    # the searched layout then reaches strictly further than TP 8 x CP rest.
    untiled = [t for t in TECHNIQUES if t != "attn_tiles"]
    search = search_layouts(model, gpus, GPU, HOST, allow=untiled)
    default = max_context(model, default_layout(model, gpus), GPU, HOST, allow=untiled)
    assert search.best_reach("flat") > default.flat > 0


def test_each_baseline_gets_its_own_best_layout():
    """paper-667b on 64 GPUs: FSDP2 and Megatron's CPU offload reach furthest on other layouts
    than flat, and further there than on flat's; the ratio compares best with best."""
    model = preset("paper-667b")
    # Without the attention tiles (with them, TP 8 x CP 8 is best for all three runs).
    untiled = [t for t in TECHNIQUES if t != "attn_tiles"]
    search = search_layouts(model, 64, GPU, HOST, seq_len=1 << 20, allow=untiled)
    flat = search.best("flat").layout
    for run in ("fsdp2-offload", "megatron-cpu-offload"):
        own = search.best(run)
        assert own.layout != flat
        on_flats = max_context(model, flat, GPU, HOST).baselines[run]
        assert own.reach > on_flats
    assert search.strongest() == "fsdp2-cp"
    assert search.ratio() == pytest.approx(search.best_reach("flat")
                                           / search.best_reach("fsdp2-cp"))
    assert search.reach["megatron"] == []  # 12 B/param of Adam state fits no layout


def test_chosen_layout_is_the_fastest_that_fits_by_brute_force(exhaustive):
    """At a length, every layout where flat fits is timed (fit's knobs, one sequence per
    step, so DP 1); the chosen one is, among those within SAME_SPEED of the quickest, the
    one reaching furthest, and the list goes on by reach among those, then by time."""
    model, gpus, mem, host, reach = exhaustive
    seq = 1 << 19
    steps = {}
    for lay in reach:
        if lay.dp != 1 or seq % (2 * lay.cp) or (lay.sp and (seq // lay.cp) % lay.tp):
            continue
        try:
            chosen = fit(model, lay, seq, mem, host)
        except PlanError:
            continue
        steps[lay] = step_seconds(unit_times(model, lay, chosen.report, chosen.flat, "H200"),
                                  1, lay.pp)
    assert len(steps) > 3
    quickest = min(steps.values())
    tied = sorted((lay for lay in steps if steps[lay] <= quickest * (1 + SAME_SPEED)),
                  key=lambda lay: (-reach[lay]["flat"],) + preference(lay))
    others = sorted((lay for lay in steps if lay not in tied),
                    key=lambda lay: (steps[lay],) + preference(lay))
    search = search_layouts(model, gpus, mem, host, seq_len=seq, limit=LIMIT)
    assert search.fits_at_seq == len(steps)
    assert [r.layout for r in search.fastest] == (tied + others)[:3]
    assert [r.reach for r in search.fastest] == [reach[lay]["flat"] for lay in
                                                 (tied + others)[:3]]
    assert [r.step_s for r in search.fastest] == pytest.approx(
        [steps[lay] for lay in (tied + others)[:3]])
    assert search.chosen == tied[0] and search.chosen_by == "fastest"


def test_with_nothing_at_the_length_the_longest_reach_is_chosen():
    model = preset("paper-667b")
    far = search_layouts(model, 64, GPU, HOST, seq_len=1 << 26)
    assert far.fastest == [] and far.fits_at_seq == 0 and far.chosen_by == "reach"
    assert far.chosen == far.best("flat").layout


def test_step_seconds_counts_the_pipeline_fill_and_drain():
    one = predict({"flops": 1e15})
    opt = predict({"mem_bytes": 1e12})
    times = {u: one for u in ("dispatch", "vocab", "boundaries", "parameters")}
    times["optimizer"] = opt
    per_mb = 4 * one.total_s
    assert step_seconds(times, 1) == pytest.approx(per_mb + opt.total_s)
    assert step_seconds(times, 4, stages=2) == pytest.approx(5 * per_mb + opt.total_s)


def test_global_batch_lets_dp_grow():
    model = preset("paper-120b")
    one = search_layouts(model, 16, GPU, HOST, seq_len=1 << 20)
    assert {r.layout.dp for r in one.fastest} == {1} and one.global_batch == 1
    eight = search_layouts(model, 16, GPU, HOST, seq_len=1 << 20, global_batch=8)
    assert eight.fits_at_seq > one.fits_at_seq
    for r in eight.fastest:
        assert r.microbatches * r.layout.dp == 8


def test_parse_layout():
    assert parse_layout("tp=8,cp=2,pp=1,ep=64") == {"tp": 8, "cp": 2, "pp": 1, "ep": 64}
    assert parse_layout(" TP=4 , dp=2 ") == {"tp": 4, "dp": 2}
    for text, message in (("xp=2", "key 'xp' is not one of tp, cp, pp, ep, dp"),
                          ("tp=0", "tp='0': not a positive integer"),
                          ("tp=two", "not a positive integer"),
                          ("tp=2,tp=4", "gives tp twice"),
                          ("tp", "is not key=value"),
                          ("", "--layout is empty")):
        with pytest.raises(PlanError, match=message):
            parse_layout(text)
    assert set(LAYOUT_KEYS) == {"tp", "cp", "pp", "ep", "dp"}


def test_layout_flag_fixes_sizes(capsys):
    rc, out, err = run(capsys, ["--model", "paper-667b", "--json", "--layout", "tp=8,cp=2"]
                       + PAPER)
    assert rc == 0, err
    data = json.loads(out)
    lay = data["layout"]
    assert (lay["tp"], lay["cp"]) == (8, 2) and lay["chosen"] == ["PP", "EP"]
    assert lay["fixed"] == {"tp": 8, "cp": 2}
    for run_ in data["layouts"].values():
        assert all((x["tp"], x["cp"]) == (8, 2) for x in run_)
    # --tp is a partial --layout; all four sizes fixed leave one candidate.
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--json", "--tp", "8", "--layout",
                              "cp=8,pp=1,ep=64"] + PAPER)
    lay = json.loads(out)["layout"]
    assert (lay["tp"], lay["cp"], lay["pp"], lay["dp"], lay["ep"]) == (8, 8, 1, 1, 64)
    assert lay["chosen"] == [] and lay["chosen_by"] == "fixed" and lay["candidates"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--layout", "tp=8,xp=2"], "--layout key 'xp' is not one of"),
    (["--layout", "tp=-1"], "not a positive integer"),
    (["--layout", "tp=8", "--tp", "4"], "--tp 4 and --layout tp=8 disagree"),
    (["--layout", "tp=16"], "TP 16 does not divide paper-667b's 56 attention heads"),
    (["--layout", "tp=8,cp=16"], "does not divide 64 GPUs"),
    (["--layout", "ep=128,tp=1,cp=1,pp=1"], "EP 128 must divide"),
    (["--microbatches", "2", "--global-batch", "4"], "not both"),
])
def test_bad_layout_gives_one_clear_error(capsys, argv, message):
    rc, out, err = run(capsys, ["--model", "paper-667b"] + argv + PAPER)
    assert rc == 2 and out == ""
    assert err.count("error:") == 1 and message in err


def test_json_layouts(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-120b", "--json"] + PAPER)
    data = json.loads(out)
    lay = data["layout"]
    assert {"gpus", "tp", "cp", "pp", "ep", "dp", "chosen_by", "candidates"} <= set(lay)
    assert lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"] == lay["gpus"] == 16
    assert set(data["layouts"]) == {"flat"} | set(BASELINES)
    for run_, ranked in data["layouts"].items():
        assert len(ranked) <= 3
        for x in ranked:
            assert set(x) == {"tp", "cp", "pp", "ep", "dp", "reach_tokens"}
            assert x["tp"] * x["cp"] * x["pp"] * x["dp"] == 16
        assert [x["reach_tokens"] for x in ranked] == \
            sorted((x["reach_tokens"] for x in ranked), reverse=True)
    assert data["layouts"]["flat"][0]["reach_tokens"] == data["max_context"]["flat"]
    for name, entry in data["baselines"].items():
        best = data["layouts"][name]
        if best:  # on its own best layout
            assert entry["layout"] == {k: best[0][k] for k in ("tp", "cp", "pp", "ep", "dp")}
            assert entry["max_context"] == best[0]["reach_tokens"]
    fastest = data["layouts_fastest"]
    assert fastest and {"predicted_step_s", "microbatches"} <= set(fastest[0])
    assert {k: fastest[0][k] for k in ("tp", "cp", "pp", "ep", "dp")} == \
        {k: lay[k] for k in ("tp", "cp", "pp", "ep", "dp")}


def test_the_baseline_as_the_paper_ran_it(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-667b"] + PAPER)
    assert rc == 0
    lines = out.splitlines()
    at = lines.index(f"  {PAPER_LABEL}:")
    assert PAPER_LABEL == "the baseline as the paper ran it (FSDP2 without sequence sharding)"
    assert lines[at + 1].split()[:11] == ["fsdp2-offload", "TP", "1", "CP", "1", "PP", "1",
                                          "DP", "64", "EP", "64"]
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--json"] + PAPER)
    data = json.loads(out)
    paper = data["paper_baseline"]
    assert paper["name"] == "fsdp2-offload" and paper["label"] == PAPER_LABEL
    assert paper["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 64, "ep": 64}
    model = preset("paper-667b")
    expect = max_context(model, paper_layout(model, 64), GPU, HOST).baselines["fsdp2-offload"]
    assert paper["max_context"] == expect
    # Without sequence sharding it reaches a fraction of the sharded FSDP2's context.
    assert 0 < paper["max_context"] < data["baselines"]["fsdp2-offload"]["max_context"] / 10
    assert paper["sequences_per_step"] == 64 and not paper["fits"]
    assert paper_layout(preset("gpt-oss-20b"), 8) == Layout(dp=8, ep=8)


def test_text_lists_the_best_layouts_of_every_run(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-241b"] + PAPER)
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layouts: "))
    section = lines[start:lines.index("", start)]
    assert section[0].startswith("layouts: 236 searched for 32 GPUs")
    labels = [line.split("  TP")[0].strip() for line in section[2:]
              if line.strip() and not line.startswith("  (")]
    for label in ("megatron-flat", "megatron-flat, fastest at 1M", "megatron-cpu-offload",
                  "fsdp2-offload", "fsdp2-cp"):
        assert label in labels
    assert "  megatron                      fits no length at any layout" in section
    assert sum("<- this layout" in line for line in section) == 1
    assert "strongest: fsdp2-cp; flat reaches" in out and "each at its own best layout" \
        in out


def test_without_seq_the_plan_is_at_flats_reach(capsys):
    rc, out, err = run(capsys, ["--model", "paper-120b", "--json", "--gpu-mem", "141GiB",
                                "--host-mem", "2TiB"])
    assert rc == 0, err
    data = json.loads(out)
    assert data["layout"]["chosen_by"] == "reach"
    assert data["seq_len"] == data["max_context"]["flat"] == data["layouts"]["flat"][0][
        "reach_tokens"]
    assert data["fits"]["flat"] and data["seq_len_from"] != "asked"
