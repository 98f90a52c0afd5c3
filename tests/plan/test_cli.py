"""``python -m megatron_flat plan``: the table, the JSON object, errors; run in-process."""

import json

import pytest

from megatron_flat.__main__ import main as top_main
from megatron_flat.plan.cli import main
from megatron_flat.plan.costs import ATTN_TILE_TOKENS

PAPER = ["--seq", "1M", "--gpu-mem", "141GiB", "--host-mem", "2TiB"]
STOCK = ["--baseline", "megatron"]
BASELINES = ("megatron", "megatron-cpu-offload", "megatron-offload", "fsdp2-offload",
             "fsdp2-cp")
KEYS = {"dispatch", "vocab", "boundaries", "optimizer", "other", "total"}


def run(capsys, argv, entry=main):
    rc = entry(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name, gpus", [("paper-120b", 16), ("paper-241b", 32),
                                        ("paper-667b", 64)])
def test_table_for_the_paper_family(capsys, name, gpus):
    rc, out, err = run(capsys, ["--model", name] + PAPER + STOCK)
    assert rc == 0, err
    assert f"megatron-flat plan: {name}" in out
    # The layout is searched, not fixed: the layout line says so and shows the JSON's choice.
    rc, js, _ = run(capsys, ["--model", name, "--json"] + PAPER + STOCK)
    lay = json.loads(js)["layout"]
    assert (f"layout: {gpus} GPUs = TP {lay['tp']} x CP {lay['cp']} x PP {lay['pp']} x DP "
            f"{lay['dp']}, EP {lay['ep']}") in out
    assert "(chose TP, CP, PP, EP: the fastest predicted step where flat fits 1M" in out
    for label in ("dispatch (MoE layer transient)", "vocab (projection + loss)",
                  "checkpoint boundaries on device", "optimizer/model state",
                  "attention/other activations", "step peak", "binding term",
                  "host memory per node", "knobs (flat: the fewest techniques that fit",
                  "max context: flat", "baseline: megatron (stock Megatron-Core"):
        assert label in out
    fits = next(line for line in out.splitlines() if line.strip().startswith("fits"))
    assert fits.split()[1:] == ["NO", "yes"]
    # Every baseline has its line: peak, fits, reach, host, predicted step.
    for baseline in BASELINES:
        assert any(line.split()[:1] == [baseline] for line in out.splitlines()), baseline
    assert "strongest: " in out and "flat reaches" in out


def test_json_is_one_object_with_the_documented_shape(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--json"] + PAPER + STOCK)
    assert rc == 0
    data = json.loads(out)  # exactly one JSON document
    assert data["baseline_name"] == "megatron"
    for column in ("baseline", "flat"):
        assert set(data[column]) == KEYS
        assert all(isinstance(v, int) and v >= 0 for v in data[column].values())
        assert data[column]["total"] == data[column]["optimizer"] + data[column]["boundaries"] \
            + max(data[column]["dispatch"] + data[column]["other"], data[column]["vocab"])
    assert set(data["binding"]) == {"baseline", "flat"}
    assert data["binding"]["baseline"] in KEYS - {"total"}
    assert set(data["max_context"]) == {"baseline", "flat", "flat_without_attn_tiles",
                                        "flat_without_param_offload"}
    assert data["max_context"]["flat"] > data["max_context"]["baseline"]
    # Both reaches at the chosen layout: tiles can only lengthen it.
    on_layout = data["max_context_on_layout"]
    assert 0 < on_layout["flat_without_attn_tiles"] <= on_layout["flat"]
    assert data["max_context"]["flat_without_attn_tiles"] == on_layout["flat_without_attn_tiles"]
    # paper-667b on 64 GPUs: the node's host memory binds param offload (same reach without
    # it), and the plan says by how much.
    assert on_layout["flat_without_param_offload"] == on_layout["flat"]
    binds = data["param_offload_host_binds"]
    assert binds["reach"] == on_layout["flat"] and binds["host_bytes"] == 2 << 40
    assert binds["unlimited_host_with"] > binds["unlimited_host_without"] >= binds["reach"]
    assert binds["host_per_node_needed"] > 2 << 40
    assert data["knobs"]["optimizer_offload"] is True and "flags" in data["knobs"]
    assert data["host_bytes"]["available"] == 2 << 40
    assert data["host_bytes"]["flat"] <= 2 << 40
    assert data["fits"] == {"baseline": False, "flat": True}
    assert data["layout"]["gpus"] == 64 and data["seq_len"] == 1 << 20


def test_explicit_layout_and_json_flags(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--gpus", "64", "--tp", "4", "--ep", "32",
                              "--pp", "2", "--cp", "8", "--json"] + PAPER)
    assert rc == 0
    lay = json.loads(out)["layout"]
    assert (lay["tp"], lay["ep"], lay["pp"], lay["cp"], lay["dp"]) == (4, 32, 2, 8, 1)
    assert lay["chosen"] == []


def test_flags_reproduce_the_chosen_knobs(capsys):
    import argparse

    from megatron_flat.config import FlatConfig, add_flat_args

    rc, out, _ = run(capsys, ["--model", "paper-120b", "--json"] + PAPER)
    knobs = json.loads(out)["knobs"]
    args = add_flat_args(argparse.ArgumentParser()).parse_args(knobs["flags"].split())
    parsed = FlatConfig.from_args(args)
    for key in ("dispatch", "vocab", "sco", "optimizer_offload"):
        assert getattr(parsed, key) == knobs[key]


def test_all_on_shows_every_technique_at_its_smallest_setting(capsys):
    # --all-on runs no attention replay and ranks layouts without it: compare on that layout
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--json", "--without", "attn_replay"]
                     + PAPER)
    fitted = json.loads(out)
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--json", "--all-on"] + PAPER + STOCK)
    assert rc == 0
    data = json.loads(out)
    assert data["knobs"]["enabled"] == ["dispatch", "vocab", "sco", "optimizer_offload",
                                        "attn_tiles"]
    assert data["knobs"]["attn_tiles"] == ATTN_TILE_TOKENS
    assert data["flat_is"] == "smallest-memory settings"
    for key in ("dispatch", "vocab", "boundaries", "other", "total"):
        assert data["flat"][key] <= fitted["flat"][key]
        assert data["flat"][key] < data["baseline"][key]
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--all-on"] + PAPER)
    assert "every technique at its smallest-memory setting" in out


def test_does_not_fit_is_reported_not_raised(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--seq", "1M", "--gpu-mem", "8GiB",
                              "--host-mem", "2TiB"])
    assert rc == 0
    assert "does not fit: paper-667b at 1,048,576 tokens does not fit" in out
    assert "smallest-memory setting" in out
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--seq", "1M", "--gpu-mem", "8GiB",
                              "--json"])
    data = json.loads(out)
    assert data["fits"]["flat"] is False and "does not fit" in data["error"]


def test_hf_config_path(capsys, tmp_path):
    cfg = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16,
           "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 4,
           "moe_intermediate_size": 512, "vocab_size": 50000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = run(capsys, ["--model", str(path), "--seq", "128K", "--gpus", "8",
                                "--gpu-mem", "80GB", "--json"])
    assert rc == 0, err
    data = json.loads(out)
    assert data["seq_len"] == 131072 and data["host_bytes"]["available"] is None


@pytest.mark.parametrize("argv, message", [
    (["--model", "paper-667b", "--gpus", "60", "--tp", "8"] + PAPER, "does not divide"),
    (["--model", "paper-667b", "--gpus", "64", "--tp", "8", "--cp", "3"] + PAPER,
     "does not divide 64 GPUs"),
    (["--model", "paper-667b", "--ep", "7"] + PAPER, "EP 7"),
    (["--model", "llama-moe"] + PAPER, "unknown model preset 'llama-moe'"),
    (["--model", "gpt-oss-20b"] + PAPER, "give --gpus"),
    (["--model", "paper-667b", "--seq", "1MB", "--gpu-mem", "141GiB"], "token count"),
    (["--model", "paper-667b", "--seq", "1M", "--gpu-mem", "lots"], "memory size"),
    # A searched layout picks a CP that splits 1000 tokens; a fixed CP 8 cannot.
    (["--model", "paper-667b", "--seq", "1000", "--gpu-mem", "141GiB", "--cp", "8"],
     "multiple of 2·CP"),
    (["--model", "missing/config.json"] + PAPER, "does not exist"),
])
def test_bad_input_gives_a_clear_error(capsys, argv, message):
    rc, out, err = run(capsys, argv)
    assert rc == 2 and out == ""
    assert "error:" in err and message in err


def test_top_level_dispatcher(capsys):
    rc, out, _ = run(capsys, ["plan", "--model", "paper-120b", "--json"] + PAPER, top_main)
    assert rc == 0 and json.loads(out)["model"] == "paper-120b"
    rc, _, err = run(capsys, ["nope"], top_main)
    assert rc == 2 and "unknown command 'nope'" in err
    rc, _, err = run(capsys, [], top_main)
    assert rc == 2 and "plan" in err
    rc, out, _ = run(capsys, ["--help"], top_main)
    assert rc == 0 and "plan" in out


def test_predicted_time_costs_next_to_the_peaks(capsys):
    rc, out, err = run(capsys, ["--model", "paper-667b", "--all-on"] + PAPER)
    assert rc == 0, err
    assert "predicted time cost (H200)" in out
    assert "predicted time on H200" in out and "not a measurement" in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith("  ") and len(line.split()) > 1}
    # the optimizer offload's cost is its PCIe traffic: seconds, bound by transfers
    optimizer = next(line for line in out.splitlines() if "optimizer step (per step)" in line)
    assert "exposed transfers" in optimizer and " s " in optimizer
    assert "dispatch" in rows and rows["dispatch"].rstrip().endswith(")")


def test_predicted_time_json_and_device_flag(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--all-on", "--json",
                              "--device", "H100"] + PAPER + STOCK)
    assert rc == 0
    t = json.loads(out)["predicted_time"]
    assert t["device"] == "H100" and "not measured" in t["note"]
    assert set(t["units"]) == set(t["cost_s"]) == {"dispatch", "vocab", "boundaries",
                                                    "optimizer", "parameters"}
    for unit, pair in t["units"].items():
        assert pair["baseline"]["predicted"] and pair["flat"]["predicted"]
        assert t["cost_s"][unit] == pytest.approx(
            pair["flat"]["total_s"] - pair["baseline"]["total_s"])
    # OffloadStreamAdamW moves 24 B/param over PCIe: its step is transfer-bound, slower
    # than stock Megatron's AdamW on the device...
    opt = t["units"]["optimizer"]["flat"]
    assert opt["copy_s"] > opt["compute_s"] and t["cost_s"]["optimizer"] > 0
    # ...and faster than the CPU AdamW of the offloading baselines.
    for other in ("megatron-cpu-offload", "fsdp2-offload"):
        rc, out, _ = run(capsys, ["--model", "paper-667b", "--all-on", "--json", "--device",
                                  "H100", "--baseline", other] + PAPER)
        times = json.loads(out)["predicted_time"]
        assert times["cost_s"]["optimizer"] < 0, other
        assert times["units"]["optimizer"]["baseline"]["compute_s"] > opt["total_s"], other
    with pytest.raises(SystemExit) as exc:
        main(["--model", "paper-667b", "--device", "TPU"] + PAPER)
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_predicted_step_time_scales_with_microbatches(capsys):
    # On one layout (the search may pick another for a larger batch, where DP can grow).
    fixed = ["--layout", "tp=8,cp=8,pp=1,ep=64"]
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--all-on", "--json"] + fixed + PAPER)
    one = json.loads(out)["predicted_time"]
    rc, out, _ = run(capsys, ["--model", "paper-667b", "--all-on", "--json",
                              "--microbatches", "4"] + fixed + PAPER)
    four = json.loads(out)["predicted_time"]
    for variant in ("baseline", "flat"):
        opt = one["units"]["optimizer"][variant]["total_s"]
        assert four["step_s"][variant] - opt == pytest.approx(4 * (one["step_s"][variant] - opt))
    rc, _, err = run(capsys, ["--model", "paper-667b", "--microbatches", "0"] + PAPER)
    assert rc == 2 and "--microbatches must be >= 1" in err


@pytest.mark.parametrize("name", ["paper-120b", "paper-241b", "paper-667b"])
def test_reach_against_every_baseline_and_the_strongest(capsys, name):
    """The paper configurations against stock Megatron, Megatron's optimizer CPU offload and
    FSDP2 with CPU offload: each baseline's figures at the asked length, its reach, the
    strongest one (the default column) and flat's reach over it."""
    rc, out, err = run(capsys, ["--model", name, "--json"] + PAPER)
    assert rc == 0, err
    data = json.loads(out)
    base = data["baselines"]
    assert set(base) == set(BASELINES)
    for entry in base.values():
        assert {"total", "fits", "max_context", "host_bytes", "predicted_step_s"} <= set(entry)
        assert entry["fits"] == (entry["total"] <= data["usable_bytes"]) or not entry["fits"]
    # Stock Megatron's 12 B/param of Adam state alone exceeds the device at this scale.
    assert base["megatron"]["max_context"] == 0 and not base["megatron"]["fits"]
    # Both offloading baselines reach some context; FSDP2's per-layer gathers reach furthest.
    assert base["megatron-cpu-offload"]["max_context"] > 0
    strongest = data["strongest_baseline"]
    assert strongest == max(base, key=lambda n: base[n]["max_context"])
    assert data["baseline_name"] == strongest  # the default column
    reach = base[strongest]["max_context"]
    assert data["reach_ratio"] == pytest.approx(data["max_context"]["flat"] / reach)
    assert data["reach_ratio"] > 1
    assert data["max_context"]["baseline"] == reach
    # Offloading baselines hold host memory: fp32 master and moments at least.
    for offload in ("megatron-cpu-offload", "megatron-offload", "fsdp2-offload", "fsdp2-cp"):
        assert base[offload]["host_bytes"] > 0
        assert base[offload]["host_pinned_bytes"] <= base[offload]["host_bytes"]


def test_baseline_flag_and_its_refusal(capsys):
    rc, out, _ = run(capsys, ["--model", "paper-120b", "--json", "--baseline",
                              "megatron-cpu-offload"] + PAPER)
    data = json.loads(out)
    assert rc == 0 and data["baseline_name"] == "megatron-cpu-offload"
    from megatron_flat.plan import Layout, estimate, preset
    from megatron_flat.plan.model import PlanError

    # The peak table's column is that baseline on the chosen layout (the baselines table
    # has it on its own best layout).
    lay = {k: data["layout"][k] for k in ("tp", "cp", "pp", "dp", "ep")}
    on_layout = estimate(preset("paper-120b"), Layout(**lay), 1 << 20,
                         baseline="megatron-cpu-offload")
    assert data["baseline"]["total"] == on_layout.total
    # Without the distributed optimizer Megatron's CPU offload cannot run.

    with pytest.raises(PlanError, match="distributed optimizer"):
        estimate(preset("paper-120b"), Layout(tp=8, cp=2, ep=16, distributed_optimizer=False),
                 1 << 17, baseline="megatron-cpu-offload")
    with pytest.raises(PlanError, match="unknown baseline"):
        estimate(preset("paper-120b"), Layout(tp=8, cp=2, ep=16), 1 << 17, baseline="zero3")


def _layout_text(lay):
    return f"TP {lay['tp']} CP {lay['cp']} PP {lay['pp']} DP {lay['dp']} EP {lay['ep']}"


def test_readme_reach_table_is_what_the_planner_prints(capsys):
    """docs/planner.md "The paper's three configurations at 1M tokens": every row is the planner's,
    each run on its own layout."""
    import pathlib
    import re

    from megatron_flat.plan.units import format_bytes, format_tokens

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    section = text.split("## The paper's three configurations at 1M tokens", 1)[1]
    rows = [line for line in section.split("\n\n", 3)[2].splitlines() if line.startswith("|")]
    assert rows[0].count("|") == 9 and "layout" in rows[0]
    table, model = {}, None
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0]:
            model = cells[0].split(",")[0]
        table[(model, cells[1].replace("*", ""))] = cells[2:]

    def tokens(n):
        return format_tokens(n) if n else "none"

    def check(row, layout, entry):
        lay, peak, fits, reach, host, step = row
        assert lay == _layout_text(layout)
        assert peak == format_bytes(entry["total"])
        assert fits == ("yes" if entry["fits"] else "no")
        assert reach == tokens(entry["max_context"])
        assert host == format_bytes(entry["host_bytes"])
        assert step == f"{entry['predicted_step_s']:.2f} s"

    seen = 0
    for name in ("paper-120b", "paper-241b", "paper-667b"):
        rc, out, _ = run(capsys, ["--model", name, "--json"] + PAPER)
        data = json.loads(out)
        for baseline, entry in data["baselines"].items():
            check(table[(name, baseline)], entry["layout"], entry)
        check(table[(name, "fsdp2-offload, as the paper ran it")],
              data["paper_baseline"]["layout"], data["paper_baseline"])
        seen += len(data["baselines"]) + 1
        # flat on the chosen layout; its reach (bold, with the ratio) on its best layout
        best = data["layouts"]["flat"][0]
        same = all(best[k] == data["layout"][k] for k in ("tp", "cp", "pp", "dp", "ep"))
        row = table[(name, "megatron-flat" if same else "megatron-flat, fastest at 1M")]
        lay, peak, fits, reach, host, step = row
        assert lay == _layout_text(data["layout"])
        assert peak == format_bytes(data["flat"]["total"]) and fits == "yes"
        assert host == format_bytes(data["host_bytes"]["flat_per_device"])
        assert step == f"{data['predicted_time']['step_s']['flat']:.2f} s"
        if not same:
            assert reach == tokens(data["max_context_on_layout"]["flat"])
            fixed = ",".join(f"{k}={best[k]}" for k in ("tp", "cp", "pp", "ep"))
            rc, out, _ = run(capsys, ["--model", name, "--json", "--layout", fixed] + PAPER)
            at_best = json.loads(out)
            row = table[(name, "megatron-flat, longest reach")]
            lay, peak, fits, reach, host, step = row
            assert lay == _layout_text(best)
            assert peak == format_bytes(at_best["flat"]["total"]) and fits == "yes"
            assert host == format_bytes(at_best["host_bytes"]["flat_per_device"])
            assert step == f"{at_best['predicted_time']['step_s']['flat']:.2f} s"
            seen += 1
        flat_reach = re.match(r"\*\*(\S+) \(([\d.]+)×\)\*\*$", reach)
        assert flat_reach.group(1) == format_tokens(data["max_context"]["flat"])
        assert float(flat_reach.group(2)) == pytest.approx(data["reach_ratio"], abs=0.005)
        seen += 1
    assert len(table) == seen
