"""benchmarks/gpu_check.sh: its CPU-safe parts (argument handling, the dry run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run(*args, timeout=300):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_usage_errors_exit_2():
    for args in ((), ("--dry-run",), ("a", "b"), ("--bogus",), ("--part", "4", "out"),
                 ("--stages", "ledger,bogus", "out"), ("--part", "out")):
        res = run(*args)
        assert res.returncode == 2, args
        assert "usage: benchmarks/gpu_check.sh [--dry-run] [--part 1|2|3 | --stages" \
            in res.stderr, args


def _stage_limits() -> dict:
    """Each stage's time limit, as the script's run_stage lines give it."""
    limits = {}
    for line in SCRIPT.read_text().splitlines():
        if line.startswith("run_stage "):
            name, limit = line.split()[1:3]
            limits[name] = int(limit)
    return limits


def _parts() -> list:
    parts = {}
    for line in SCRIPT.read_text().splitlines():
        if line.startswith("PART_"):
            name, _, rest = line.partition("=(")
            parts[name] = rest.rstrip(")").split()
    return [parts[f"PART_{i}"] for i in (1, 2, 3)]


def test_each_part_fits_in_eight_minutes_and_every_stage_is_in_one():
    limits = _stage_limits()
    parts = _parts()
    assert sorted(n for part in parts for n in part) == sorted(limits)
    for part in parts:
        assert sum(limits[n] for n in part) <= 8 * 60, part
    # what every figure rests on comes first: the device's constants, then the counts
    assert parts[0][:3] == ["calibrate", "ledger", "dispatch-syncs"]


def test_parts_run_into_one_outdir_add_up(tmp_path):
    out = tmp_path / "out"
    for part in ("2", "3", "1"):
        res = run("--dry-run", "--part", part, str(out))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = run("--dry-run", "--stages", "vocab,tier", str(out))  # a rerun replaces, once
    assert res.returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["stages"]) == list(_stage_limits())  # every stage, in script order
    assert [line.split("\t")[0] for line in (out / "stages.tsv").read_text().splitlines()
            ].count("vocab") == 1


def test_dry_run_plans_every_stage_and_runs_the_ledger_on_cpu(tmp_path):
    res = run("--dry-run", str(tmp_path / "out"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    stages = summary["stages"]
    assert list(stages) == ["tests", "races", "mutants", "tier", "meter", "calibrate", "ledger",
                            "sco", "optim",
                            "dispatch-syncs", "param-offload", "vocab", "replay", "replay-time",
                            "replay-te"]
    assert stages["ledger"]["rc"] == "0"
    assert all(s["rc"] == "planned" for n, s in stages.items() if n != "ledger")
    units = {(r["unit"], r["variant"]) for r in summary["ledger"]}
    assert units == {(u, v) for u in ("moe", "vocab", "sco", "optimizer")
                     for v in ("stock", "flat")}
    ledger = json.loads((out / "ledger-gpu.json").read_text())
    by = {(r["unit"], r["variant"]): r for r in ledger["records"]}
    # what the techniques are for, visible in the counts even at the tiny shape
    assert by[("sco", "flat")]["d2h_bytes"] > 0 and by[("sco", "stock")]["d2h_bytes"] == 0
    assert by[("optimizer", "flat")]["h2d_bytes"] > 0
    assert by[("vocab", "flat")]["peak_device_bytes"] < by[("vocab", "stock")]["peak_device_bytes"]
    for r in ledger["records"]:
        assert r["predicted_s"] > 0 and r["prediction"]["predicted"] is True
    assert "predicted (step-time model; calibrated constants when the calibrate stage ran)" in (out / "summary.txt").read_text()
