"""``plan --emit-launch``: the Megatron-LM launch line of a plan, and the example scripts it
generates (examples/paper_*.sh), which must equal what the planner emits today."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flat.config import FlatConfig, add_flat_args
from megatron_flat.plan import cli, launch
from megatron_flat.plan.model import PAPER_GPUS, Layout, PlanError, preset

REPO = Path(__file__).resolve().parents[2]
PLAN = ["--gpu-mem", "141GiB", "--host-mem", "2TiB", "--seq", "1M"]


def _value(args, flag):
    return args[args.index(flag) + 1]


def _plan(*extra):
    return cli.plan(cli.build_parser().parse_args(list(extra) + PLAN))


@pytest.mark.parametrize("name", sorted(PAPER_GPUS))
def test_the_line_is_the_plan(name):
    res = _plan("--model", name, "--all-on")
    args = launch.launch_args(cli.launch_groups_of(res))
    lay, model = res.layout, res.model
    # the parallel layout and the shape are the plan's
    assert (int(_value(args, "--tensor-model-parallel-size")), int(_value(
        args, "--context-parallel-size")), int(_value(args, "--pipeline-model-parallel-size")),
        int(_value(args, "--expert-model-parallel-size"))) == (lay.tp, lay.cp, lay.pp, lay.ep)
    assert ("--sequence-parallel" in args) == (lay.tp > 1)
    assert int(_value(args, "--seq-length")) == res.seq_len == 1 << 20
    assert int(_value(args, "--num-layers")) == model.layers
    assert int(_value(args, "--num-experts")) == model.experts
    assert int(_value(args, "--num-query-groups")) == model.kv_heads
    assert int(_value(args, "--global-batch-size")) == res.global_batch
    assert {"--bf16", "--use-distributed-optimizer", "--moe-grouped-gemm"} <= set(args)
    assert _value(args, "--recompute-granularity") == "full"
    # the --flat-* flags give back the FlatConfig fit chose
    known, _ = add_flat_args(argparse.ArgumentParser()).parse_known_args(args)
    flat = FlatConfig.from_args(known)
    assert (flat.dispatch, flat.vocab, flat.sco, flat.optimizer_offload) == (
        res.flat.dispatch, res.flat.vocab, res.flat.sco, res.flat.optimizer_offload)
    assert flat.dispatch_chunk_tokens == res.flat.dispatch_chunk_tokens
    assert flat.optimizer_bucket_numel == res.flat.optimizer_bucket_numel
    assert abs(flat.sco_host_budget_gib - res.flat.sco_host_budget_gib) <= 1e-5 * max(
        1.0, res.flat.sco_host_budget_gib)
    assert args[args.index("--spec") + 2] == "flat_gpt_layer_te_spec"


def test_a_model_without_experts_or_with_mla_and_dense_layers():
    dense = preset("gpt-oss-20b")
    args = launch.launch_args(launch.launch_groups(
        dense, Layout(tp=2, ep=2, dp=1), seq_len=4096, global_batch=8, flat=FlatConfig(),
        flat_flags=""))
    assert "--spec" not in args and not any(a.startswith("--flat-") for a in args)
    assert _value(args, "--kv-channels") == "64"  # 64 heads x 64 != 2880
    with pytest.raises(PlanError, match="MLA"):
        launch.launch_groups(preset("deepseek-v3"), Layout(), seq_len=4096, global_batch=1,
                             flat=FlatConfig(), flat_flags="")


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_flat", "plan", *argv],
                          capture_output=True, text=True, cwd=REPO)


def test_cli_prints_a_command_and_json_carries_the_list():
    done = _cli("--model", "paper-120b", "--all-on", "--emit-launch", *PLAN)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# paper-120b at 1M tokens per sequence on 16 H200")
    command = [l for l in lines if not l.startswith("#")]
    assert command[0].startswith("torchrun --nnodes 2 --nproc-per-node 8 ")
    assert command[1].strip() == "pretrain_gpt.py \\"
    assert command[-1].lstrip().startswith("--spec megatron_flat.megatron.spec")
    as_json = _cli("--model", "paper-120b", "--all-on", "--emit-launch", "--json", *PLAN)
    record = json.loads(as_json.stdout)
    assert record["launch"] == launch.launch_args(cli.launch_groups_of(
        _plan("--model", "paper-120b", "--all-on")))
    # a plan that does not fit has no launch line
    tight = _cli("--model", "paper-667b", "--gpus", "8", "--emit-launch", "--gpu-mem", "8GiB",
                 "--seq", "1M")
    assert tight.returncode == 2 and "does not fit" in tight.stderr


def test_the_example_scripts_are_what_the_planner_emits():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "emit_examples.py"),
                           "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(PAPER_GPUS))
def test_example_dry_runs(name, tmp_path):
    res = _plan("--model", name, "--all-on")
    args = launch.launch_args(cli.launch_groups_of(res))
    script = REPO / "examples" / f"{name.replace('-', '_')}.sh"
    env = dict(os.environ, MEGATRON_LM=str(tmp_path), DRY_RUN="1", REHEARSE="1",
               PYTHON=sys.executable)
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    cut = words.index("--")
    # The attention tiles need TP > 1: the tiny world is TP 2 (x CP 2) then.
    tp = 2 if res.flat.attn_tiles else 1
    cp = 2 if res.layout.cp > 1 else 1
    nproc = str(max(2, tp * cp))
    assert words[cut - 4:cut] == ["megatron_flat", "rehearse", "--nproc-per-node", nproc]
    line = words[cut + 2:]
    # the planner's line, unchanged, then the shape overrides (argparse: the last one wins)
    assert [w.replace("\\", "") for w in line[:len(args)]] == args
    tiny = line[len(args):]
    assert _value(tiny, "--num-layers") == "2" and _value(tiny, "--seq-length") == "64"
    assert _value(tiny, "--context-parallel-size") == str(cp)
    assert _value(tiny, "--tensor-model-parallel-size") == str(tp)
    assert not any(t.startswith("--flat-") for t in tiny)  # the flat knobs run as planned
    env["RESUME_AT"] = "2"  # checkpoints cross too
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    crossing = done.stdout.split()
    cut = crossing.index("--")
    assert crossing[cut - 6:cut] == ["megatron_flat", "rehearse", "--nproc-per-node", nproc,
                                     "--resume-at", "2"]
    assert crossing[cut:] == words[words.index("--"):]
