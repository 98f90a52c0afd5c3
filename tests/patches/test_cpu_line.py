"""``megatron_flat.rehearse.line``: what of a GPU launch line runs otherwise on CPU — each
substitution, drop and refusal on its own, against a parser view shaped like Megatron-LM's
(the integration with real parsers is in test_rehearse.py)."""

import pytest

from megatron_flat.rehearse import line as cpu_line

# Megatron-LM's defaults for the settings the plan reads (a GPU line that sets none of them).
DEFAULTS = {
    "transformer_impl": "transformer_engine", "attention_backend": "AttnBackend.auto",
    "apply_rope_fusion": True, "no_persist_layer_norm": False,
    "gradient_accumulation_fusion": True, "masked_softmax_fusion": True,
    "bias_swiglu_fusion": True, "bias_dropout_fusion": True, "swiglu": False,
    "moe_permute_fusion": False, "moe_router_fusion": False, "use_te_activation_func": False,
    "cross_entropy_loss_fusion": False, "cross_entropy_fusion_impl": "native",
    "moe_grouped_gemm": False, "cuda_graph_impl": "none", "enable_cuda_graph": False,
    "external_cuda_graph": False, "tp_comm_overlap": False, "te_rng_tracker": False,
    "use_flash_attn": False, "nccl_ub": False, "use_sharp": False, "fp8": None, "fp4": None,
    "fp8_param_gather": False, "use_precision_aware_optimizer": False,
}
OPTIONS = {
    "--transformer-impl": 1, "--spec": -1, "--attention-backend": 1, "--no-rope-fusion": 0,
    "--no-persist-layer-norm": 0, "--no-gradient-accumulation-fusion": 0,
    "--no-masked-softmax-fusion": 0, "--no-bias-swiglu-fusion": 0,
    "--no-bias-dropout-fusion": 0, "--moe-permute-fusion": 0, "--moe-router-fusion": 0,
    "--use-te-activation-func": 0, "--cross-entropy-loss-fusion": 0,
    "--cross-entropy-fusion-impl": 1, "--moe-grouped-gemm": 0, "--cuda-graph-impl": 1,
    "--cuda-graph-scope": -1, "--cuda-graph-warmup-steps": 1, "--enable-cuda-graph": 0,
    "--external-cuda-graph": 0, "--tp-comm-overlap": 0, "--tp-comm-overlap-cfg": 1,
    "--te-rng-tracker": 0, "--use-flash-attn": 0, "--use-nccl-ub": 0, "--fp8-format": 1,
    "--fp4-format": 1, "--fp8-param-gather": 0, "--use-precision-aware-optimizer": 0,
    "--num-layers": 1, "--bf16": 0,
}
CPU_FLAGS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-bias-dropout-fusion"]


def _plan(args, **values):
    return cpu_line.plan(args, {**DEFAULTS, **values}, OPTIONS)


def test_a_cpu_line_runs_as_written():
    values = dict(transformer_impl="local", apply_rope_fusion=False, no_persist_layer_norm=True,
                  gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                  bias_dropout_fusion=False)
    line = _plan(["--num-layers", "2"] + CPU_FLAGS, **values)
    assert line.changes == [] and line.refused == [] and line.block() == []
    assert line.args == ["--num-layers", "2"] + CPU_FLAGS
    assert cpu_line.strict_refusal(line) is None


def test_megatron_defaults_become_their_cpu_forms():
    line = _plan(["--num-layers", "2"])
    assert line.args == ["--num-layers", "2"] + CPU_FLAGS
    asked = [c.asked for c in line.changes]
    assert asked[0] == "--transformer-impl transformer_engine (Megatron-LM's default)"
    assert all(c.kind == cpu_line.SUBSTITUTED for c in line.changes)
    assert len(line.changes) == 6 and line.substitutions == 6
    assert all("(Megatron-LM's default)" in a for a in asked)
    block = line.block()
    assert block[0].startswith("6 setting(s) of the line run otherwise on CPU")
    assert "  [substituted] the fused RoPE kernel (Megatron-LM's default) -> --no-rope-fusion: " \
        in "\n".join(block)


def test_each_substitution():
    te = ["--transformer-impl", "transformer_engine", "--spec",
          "megatron_flat.megatron.spec", "flat_gpt_layer_te_spec"]
    line = _plan(te + ["--swiglu", "--moe-grouped-gemm", "--moe-permute-fusion",
                       "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
                 swiglu=True, moe_grouped_gemm=True, moe_permute_fusion=True,
                 cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    by = {c.asked.split(" (")[0]: c for c in line.changes}
    assert by["--transformer-impl transformer_engine"].instead == "--transformer-impl local"
    spec = by["--spec megatron_flat.megatron.spec flat_gpt_layer_te_spec"]
    assert spec.instead == "--spec megatron_flat.megatron.spec flat_gpt_layer_spec"
    assert by["the fused bias-SwiGLU kernel"].instead == "--no-bias-swiglu-fusion"
    assert by["--moe-permute-fusion"].instead == "(unfused)"
    assert by["--cross-entropy-loss-fusion --cross-entropy-fusion-impl te"].instead == "(unfused)"
    assert "compute-capability check answered on CPU" in by["--moe-grouped-gemm"].instead
    assert len(line.changes) == 11
    args = line.args
    assert args.count("--transformer-impl") == 1 and args[args.index("--transformer-impl") + 1] \
        == "local"
    assert args[args.index("--spec") + 1:args.index("--spec") + 3] == [
        "megatron_flat.megatron.spec", "flat_gpt_layer_spec"]
    for gone in ("--moe-permute-fusion", "--cross-entropy-loss-fusion",
                 "--cross-entropy-fusion-impl", "te", "flat_gpt_layer_te_spec",
                 "transformer_engine"):
        assert gone not in args
    assert "--moe-grouped-gemm" in args and "--no-bias-swiglu-fusion" in args
    # Megatron's own transformer-engine spec has a local twin too
    megatron = _plan(["--spec", "megatron.core.models.gpt.gpt_layer_specs",
                      "get_gpt_layer_with_transformer_engine_spec"])
    at = megatron.args.index("--spec")
    assert megatron.args[at + 1:at + 3] == ["megatron.core.models.gpt.gpt_layer_specs",
                                            "get_gpt_layer_local_spec"]


def test_gpu_features_that_keep_the_math_are_dropped_with_their_values():
    line = _plan(["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "moe",
                  "--tp-comm-overlap", "--tp-comm-overlap-cfg", "ub.yaml", "--te-rng-tracker",
                  "--use-flash-attn", "--attention-backend", "flash", "--num-layers", "2"],
                 cuda_graph_impl="local", tp_comm_overlap=True, te_rng_tracker=True,
                 use_flash_attn=True, attention_backend="AttnBackend.flash")
    dropped = [c for c in line.changes if c.kind == cpu_line.DROPPED]
    assert [c.asked for c in dropped] == [
        "--attention-backend flash", "--cuda-graph-impl local --cuda-graph-scope attn moe",
        "--tp-comm-overlap --tp-comm-overlap-cfg ub.yaml", "--te-rng-tracker",
        "--use-flash-attn"]
    assert line.args == ["--num-layers", "2"] + CPU_FLAGS
    assert "replay" in dropped[1].why


def test_settings_that_change_the_math_are_refused():
    line = _plan(["--fp8-format", "hybrid", "--fp8-param-gather"], fp8="hybrid",
                 fp8_param_gather=True)
    assert len(line.refused) == 1 and line.refused[0].startswith("--fp8-format hybrid: ")
    assert "rehearse it without --fp8-format" in line.refused[0]
    assert _plan(["--fp4-format", "nvfp4"], fp4="nvfp4").refused[0].startswith("--fp4-format")
    assert _plan([], use_precision_aware_optimizer=True).refused


def test_strict_names_every_change():
    line = _plan(["--tp-comm-overlap"], tp_comm_overlap=True)
    refusal = cpu_line.strict_refusal(line)
    assert refusal.startswith("--strict: 7 setting(s)")
    assert "--tp-comm-overlap (dropped)" in refusal
    assert "--transformer-impl transformer_engine (Megatron-LM's default) (substituted)" \
        in refusal


def test_a_release_without_a_flag_is_left_alone():
    options = {k: v for k, v in OPTIONS.items() if k != "--no-bias-dropout-fusion"}
    line = cpu_line.plan([], DEFAULTS, options)
    assert "--no-bias-dropout-fusion" not in line.args and len(line.changes) == 5


@pytest.mark.parametrize("args, option, arity, kept, values", [
    (["--a", "1", "--b"], "--a", 1, ["--b"], ["1"]),
    (["--a=1", "--b"], "--a", 1, ["--b"], ["1"]),
    (["--s", "x", "y", "--b", "--s", "z"], "--s", -1, ["--b"], ["z"]),
    (["--f", "--b", "2"], "--f", 0, ["--b", "2"], []),
    (["--b", "2"], "--f", 0, ["--b", "2"], None),
])
def test_remove_option_and_values(args, option, arity, kept, values):
    assert cpu_line.remove_option(args, option, arity) == kept
    assert cpu_line.option_values(args, option, arity) == values
