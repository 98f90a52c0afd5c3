"""``plan --emit-launch``: the Megatron-LM launch line of a plan, and the example scripts it
generates (examples/paper_*.sh), which must equal what the planner emits today."""

import argparse
import dataclasses
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
    # An attention shape known only as a parameter count has no flags to emit.
    opaque = dataclasses.replace(preset("deepseek-v3"), mla=None)
    with pytest.raises(PlanError, match="parameter count"):
        launch.launch_groups(opaque, Layout(), seq_len=4096, global_batch=1,
                             flat=FlatConfig(), flat_flags="")


def _window_size(text):
    return tuple(int(v) for v in text.split(","))  # Megatron-LM's tuple_type


def _skip_freq(text):
    return int(text) if text.isdigit() else eval(text)  # Megatron-LM's moe_freq_type


def _megatron_parser():
    """The flags of the family lines as Megatron-LM 0.16 and main both define them (names,
    kinds and values: int, float, str choices, store_true)."""
    p = argparse.ArgumentParser()
    p.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"])
    p.add_argument("--window-size", type=_window_size)
    p.add_argument("--window-attn-skip-freq", type=_skip_freq)
    p.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    for flag in ("--glu-linear-offset", "--activation-func-clamp-value"):
        p.add_argument(flag, type=float)
    p.add_argument("--quick-geglu", action="store_true")
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "mrope",
                                                          "relative", "none", "yarn"])
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    for flag in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                 "--v-head-dim", "--moe-router-num-groups", "--moe-router-group-topk",
                 "--num-layers", "--hidden-size", "--num-attention-heads", "--num-experts",
                 "--moe-router-topk", "--moe-ffn-hidden-size", "--ffn-hidden-size",
                 "--moe-shared-expert-intermediate-size", "--mtp-num-layers",
                 "--num-query-groups", "--kv-channels", "--seq-length",
                 "--max-position-embeddings", "--rotary-base"):
        p.add_argument(flag, type=int)
    for flag in ("--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
                 "--moe-router-topk-scaling-factor", "--moe-aux-loss-coeff"):
        p.add_argument(flag, type=float)
    p.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"])
    p.add_argument("--moe-router-load-balancing-type",
                   choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"])
    p.add_argument("--moe-router-dtype", choices=["fp32", "fp64"])
    p.add_argument("--moe-layer-freq", type=eval)  # Megatron-LM evaluates the pattern
    for flag in ("--multi-latent-attention", "--qk-layernorm", "--moe-router-enable-expert-bias",
                 "--group-query-attention", "--add-qkv-bias", "--moe-shared-expert-gate",
                 "--swiglu", "--untie-embeddings-and-output-weights", "--qk-l2-norm"):
        p.add_argument(flag, action="store_true")
    return p


FAMILY_LINES = ["deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "qwen2-57b-a14b", "gpt-oss-120b",
                "mixtral-8x22b", "llama-4-maverick"]


@pytest.mark.parametrize("name", FAMILY_LINES)
def test_a_family_line_carries_its_architecture(name):
    """MLA's shape, the q/k norms, the router's settings, biases, sinks, windows, the GLU and
    the layer pattern reach the line, so it builds the family's model; read back, the line's
    shape is the preset's (parameters and MoE layers)."""
    from megatron_flat.plan.model import model_from_megatron_args

    model = preset(name)
    args = launch.launch_args(launch.launch_groups(
        model, Layout(tp=1, ep=8, dp=8), seq_len=4096, global_batch=8, flat=FlatConfig(),
        flat_flags=""))
    parsed, _ = _megatron_parser().parse_known_args(args)
    # every flag of the model group is one Megatron-LM defines, with a value of its kind
    _megatron_parser().parse_args(launch.launch_groups(
        model, Layout(tp=1, ep=8, dp=8), seq_len=4096, global_batch=8, flat=FlatConfig(),
        flat_flags="")[0][1])
    assert parsed.qk_layernorm == (model.mla is not None or name.startswith("qwen3"))
    assert parsed.add_bias_linear == (name == "gpt-oss-120b")
    assert parsed.add_qkv_bias == (name == "qwen2-57b-a14b")
    assert parsed.moe_shared_expert_gate == (name == "qwen2-57b-a14b")
    assert (parsed.swiglu, parsed.quick_geglu) == ((False, True) if name == "gpt-oss-120b"
                                                   else (True, False))
    if name == "gpt-oss-120b":
        assert parsed.softmax_type == "learnable"
        assert (parsed.window_size, parsed.window_attn_skip_freq) == ((128, 0), 2)
        assert (parsed.glu_linear_offset, parsed.activation_func_clamp_value) == (1.0, 7.0)
    else:
        assert parsed.softmax_type is None and parsed.window_size is None
    assert parsed.qk_l2_norm == (name == "llama-4-maverick")
    # the rotary base (config.json rope_theta) when it is not Megatron's default 10000
    assert parsed.rotary_base == (None if model.rotary_base == 10000 else model.rotary_base)
    assert name == "deepseek-v3" or model.rotary_base != 10000
    if name == "llama-4-maverick":  # dense first, then every other layer MoE; top-1 sigmoid
        assert parsed.moe_layer_freq == [0, 1] * 24
        assert parsed.moe_router_score_function == "sigmoid"
        assert parsed.moe_shared_expert_intermediate_size == 8192
    assert parsed.moe_layer_freq is None or len(parsed.moe_layer_freq) == model.layers
    if model.mla is not None:
        assert parsed.multi_latent_attention and not parsed.group_query_attention
        assert (parsed.q_lora_rank, parsed.kv_lora_rank, parsed.qk_head_dim,
                parsed.qk_pos_emb_head_dim, parsed.v_head_dim) == (
            1536, 512, 128, 64, 128)
        assert parsed.rotary_scaling_factor == model.mla.rotary_scaling_factor
        assert parsed.moe_router_score_function == "sigmoid" and \
            parsed.moe_router_enable_expert_bias
        assert parsed.moe_router_load_balancing_type == "seq_aux_loss"
        assert parsed.mtp_num_layers == model.mtp_layers or model.mtp_layers == 0
        groups = {"deepseek-v3": (8, 4, 2.5), "kimi-k2": (1, 1, 2.827)}[name]
        assert (parsed.moe_router_num_groups, parsed.moe_router_group_topk,
                parsed.moe_router_topk_scaling_factor) == groups
    else:
        assert parsed.group_query_attention and parsed.num_query_groups == model.kv_heads
        if name.startswith("qwen3"):
            assert parsed.moe_router_load_balancing_type == "aux_loss"
    back = model_from_megatron_args(argparse.Namespace(**vars(parsed), vocab_size=model.vocab,
                                                       bf16=True))
    assert back.moe_layers == model.moe_layers and back.experts == model.experts
    assert back.mla == model.mla and back.total_params() == model.total_params()
    assert (back.linear_bias, back.qkv_bias, back.sinks, back.window, back.glu,
            back.rotary_base) == (model.linear_bias, model.qkv_bias, model.sinks, model.window,
                                  model.glu, model.rotary_base)


def test_a_gpt_oss_plan_leaves_out_replay_on_sinks_and_windows():
    """Attention replay is unproven with sinks and windows: a GPT-OSS plan does not turn it
    on, even with every technique asked for; the other techniques stay."""
    res = _plan("--model", "gpt-oss-120b", "--gpus", "16", "--all-on")
    assert res.error is None
    args = launch.launch_args(cli.launch_groups_of(res))
    assert not res.flat.attn_replay and "--flat-attn-replay" not in args
    assert "--softmax-type" in args and "--disable-bias-linear" not in args


def test_a_family_plan_leaves_out_what_mla_cannot_run():
    """The attention-block peak term is not written for MLA's latents and replay is unproven
    there: a DeepSeek-V3 plan
    turns neither on, even with every technique asked for."""
    res = _plan("--model", "deepseek-v3", "--gpus", "256", "--all-on")
    args = launch.launch_args(cli.launch_groups_of(res))
    assert not res.flat.attn_tiles and not res.flat.attn_replay
    assert "--flat-attn-tiles" not in args and "--multi-latent-attention" in args


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


# The example scripts are what the planner emits: tests/plan/test_examples_emitted.py
# (in-process, so megatron-free).


EXAMPLES = {"paper-120b": ("paper_120b", 16), "paper-241b": ("paper_241b", 32),
            "paper-667b": ("paper_667b", 64), "deepseek-v3": ("deepseek_v3", 256),
            "qwen3-235b-a22b": ("qwen3_235b", 64), "gpt-oss-120b": ("gpt_oss_120b", 16)}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_dry_runs(name, tmp_path):
    stem, gpus = EXAMPLES[name]
    res = _plan("--model", name, "--gpus", str(gpus), "--all-on")
    args = launch.launch_args(cli.launch_groups_of(res))
    script = REPO / "examples" / f"{stem}.sh"
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
