"""Model descriptions (presets, Hugging Face config.json, Megatron args) and layouts."""

import argparse
import dataclasses
import json

import pytest

from megatron_flat.plan import (
    PRESETS,
    Layout,
    ModelSpec,
    PlanError,
    default_layout,
    layout_from_megatron_args,
    load_model,
    model_from_hf_config,
    model_from_megatron_args,
    preset,
)
from megatron_flat.plan.model import check_layout, stage_layers

# Published total parameter counts (billions), from each model's card / paper.
PUBLISHED_PARAMS_B = {
    "paper-120b": 120, "paper-241b": 241, "paper-667b": 667,
    # OpenAI's model card: 20.91B and 116.83B (biases and sinks included).
    "gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83, "deepseek-v3": 671, "qwen3-30b-a3b": 30.5,
    "qwen2-57b-a14b": 57.4,
    "qwen3-235b-a22b": 235, "mixtral-8x22b": 141, "llama-4-maverick": 400,
    # Moonshot publishes "1T total parameters"; the config's shapes give 1.026T.
    "kimi-k2": 1000,
    # Dense: the model cards' counts (Qwen3: 0.6B, 4.0B, 8.2B, 32.8B; Llama 3.1: 8.03B).
    "qwen3-0.6b": 0.6, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-32b": 32.8,
    "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6,
}
# Within 1 % of the published count, except the paper family (its attention shape is
# assumed) and Kimi K2 (published rounded to 1T).
TOLERANCE = {"paper-120b": 0.02, "paper-241b": 0.02, "paper-667b": 0.02, "kimi-k2": 0.03,
             "gpt-oss-20b": 0.001, "gpt-oss-120b": 0.001}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_match_published_sizes(name):
    model = preset(name)
    assert model.name == name and model.source
    assert model.total_params() / 1e9 == pytest.approx(PUBLISHED_PARAMS_B[name],
                                                       rel=TOLERANCE.get(name, 0.01))
    assert name in model.describe() or model.describe()


def test_llama4_interleave_is_modelled():
    """Maverick's dense and MoE layers alternate (the first dense): 24 MoE layers, not 48
    (48 would make it 778B), each with the always-on shared expert."""
    m = preset("llama-4-maverick")
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert m.moe_layers == 24 and m.shared_experts == 1
    assert "24 dense ffn 16384" in m.describe()


def test_hf_config_llama4_text_config():
    cfg = {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 128, "num_experts_per_tok": 1, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 2, "vocab_size": 202048,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_qk_norm": True}}
    m = model_from_hf_config(cfg, name="maverick")
    ref = preset("llama-4-maverick")
    assert (m.moe_layers, m.dense_ffn, m.expert_ffn, m.shared_experts, m.shared_expert_ffn) == \
        (24, 16384, 8192, 1, 8192)
    assert m.total_params() == ref.total_params()
    # the L2 q/k norms and the sigmoid top-1 router reach the launch line
    assert m.arch_flags == ref.arch_flags == ("--qk-l2-norm", "--moe-router-score-function",
                                              "sigmoid")


def test_interleaved_launch_line_names_the_pattern():
    from megatron_flat.config import FlatConfig
    from megatron_flat.plan.launch import launch_args, launch_groups

    model = preset("llama-4-maverick")
    groups = launch_groups(model, default_layout(model, 64), seq_len=4096, global_batch=64,
                           flat=FlatConfig(), flat_flags="")
    args = launch_args(groups)
    pattern = args[args.index("--moe-layer-freq") + 1]
    assert eval(pattern) == [i % 2 for i in range(48)]
    assert args[args.index("--ffn-hidden-size") + 1] == "16384"


def test_paper_family_shape():
    for name, layers in (("paper-120b", 7), ("paper-241b", 14), ("paper-667b", 39)):
        m = preset(name)
        assert (m.hidden, m.experts, m.topk, m.expert_ffn, m.vocab, m.layers) == \
            (7168, 384, 8, 2048, 200_000, layers)


def test_preset_names_are_case_insensitive_and_unknown_ones_refused():
    assert preset("DeepSeek-V3") is preset("deepseek-v3")
    assert preset("Qwen3-30B-A3B").experts == 128
    with pytest.raises(PlanError, match="unknown model preset 'llama-moe'.*paper-120b"):
        preset("llama-moe")
    with pytest.raises(PlanError, match="does not exist"):
        load_model("/nonexistent/config.json")


def test_hf_config_qwen_style(tmp_path):
    cfg = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
           "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
           "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    path = tmp_path / "qwen" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert m.name == "qwen"
    assert (m.hidden, m.layers, m.heads, m.kv_heads, m.head_dim) == (2048, 48, 32, 4, 128)
    assert (m.experts, m.topk, m.expert_ffn, m.dense_layers, m.vocab) == (128, 8, 768, 0, 151936)
    assert m.total_params() == preset("qwen3-30b-a3b").total_params()


def test_hf_config_deepseek_style():
    cfg = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
           "moe_intermediate_size": 2048, "intermediate_size": 18432, "n_shared_experts": 1,
           "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "vocab_size": 129280, "num_nextn_predict_layers": 1}
    m = model_from_hf_config(cfg, name="dsv3")
    ref = preset("deepseek-v3")
    assert m.mtp_layers == ref.mtp_layers == 1  # DeepSeek-V3's MTP head
    assert "1 MTP head" in ref.describe()
    assert (m.head_dim, m.v_head_dim, m.kv_heads) == (192, 128, 128)
    assert (m.shared_experts, m.shared_expert_ffn, m.dense_layers, m.dense_ffn) == \
        (1, 2048, 3, 18432)
    assert m.total_params() == ref.total_params()


def test_hf_config_gpt_oss_style_and_defaults():
    # gpt-oss names: num_local_experts, experts_per_token, intermediate_size = expert width;
    # no head_dim / num_key_value_heads: defaults hidden/heads and heads.
    m = model_from_hf_config({"hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_local_experts": 8,
                              "experts_per_token": 2, "intermediate_size": 96,
                              "vocab_size": 1000})
    assert (m.kv_heads, m.head_dim, m.experts, m.topk, m.expert_ffn) == (4, 16, 8, 2, 96)


# openai/gpt-oss-120b's config.json, the keys the planner reads.
GPT_OSS_120B = {
    "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 128, "experts_per_token": 4, "intermediate_size": 2880,
    "vocab_size": 201088, "tie_word_embeddings": False, "attention_bias": True,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "swiglu_limit": 7.0, "torch_dtype": "bfloat16", "rope_theta": 150000}


def test_hf_config_gpt_oss_models_biases_sinks_windows_and_its_glu():
    m = model_from_hf_config(GPT_OSS_120B, name="gpt-oss-120b")
    ref = preset("gpt-oss-120b")
    assert (m.linear_bias, m.qkv_bias, m.sinks, m.glu) == (True, False, True, "quick-geglu")
    assert (m.window, m.window_skip_freq, m.rotary_base) == (128, 2, 150000)
    assert [m.is_window_layer(i) for i in range(4)] == [True, False, True, False]
    assert m.arch_flags == ref.arch_flags == ("--glu-linear-offset", "1",
                                              "--activation-func-clamp-value", "7")
    assert m.total_params() == ref.total_params()
    # biases: QKV's and the output's, every expert's fc1 (2F) and fc2 (H), the router's (E);
    # sinks: one per head
    plain = dataclasses.replace(ref, linear_bias=False, sinks=False)
    qkv = 64 * 64 + 2 * 8 * 64
    per_layer = qkv + 2880 + 128 * (2 * 2880 + 2880) + 128 + 64
    assert ref.total_params() - plain.total_params() == 36 * per_layer
    # a layer pattern that is not every N-th layer full has no Megatron flag
    odd = dict(GPT_OSS_120B, layer_types=["sliding_attention", "full_attention",
                                          "full_attention"] * 12)
    with pytest.raises(PlanError, match="every N-th layer full"):
        model_from_hf_config(odd)
    # Qwen2-style configs set sliding_window without layer_types: no window
    assert model_from_hf_config(dict(GPT_OSS_120B, model_type="qwen2_moe",
                                     layer_types=None)).window == 0


def test_windows_scale_the_attention_flops():
    from megatron_flat.plan.costs import attention_core_flops

    gpt_oss = preset("gpt-oss-120b")
    full = dataclasses.replace(gpt_oss, window=0, window_skip_freq=0)
    seq = 1 << 20
    assert full.attended_fraction(seq) == 1.0
    # half the layers see 128 keys a query instead of ~S/2
    assert gpt_oss.attended_fraction(seq) == pytest.approx(0.5 + 0.5 * 129 / ((seq + 1) / 2),
                                                           rel=1e-3)
    assert gpt_oss.attended_fraction(100) == 1.0  # the window covers the whole sequence
    assert gpt_oss.attended_fraction(1000) < 1.0
    layout = Layout(tp=1, ep=8, dp=8)
    ratio = attention_core_flops(gpt_oss, layout, seq, seq) / \
        attention_core_flops(full, layout, seq, seq)
    assert ratio == pytest.approx(gpt_oss.attended_fraction(seq))
    with pytest.raises(PlanError, match="glu"):
        dataclasses.replace(gpt_oss, glu="geglu")


def test_hf_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        model_from_hf_config(str(bad))
    with pytest.raises(PlanError, match="missing num_hidden_layers"):
        model_from_hf_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10})
    with pytest.raises(PlanError, match="top-k"):
        model_from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 5,
                              "moe_intermediate_size": 8})


def _megatron_args(**over):
    ns = dict(hidden_size=7168, num_layers=14, num_attention_heads=56, group_query_attention=True,
              num_query_groups=8, kv_channels=128, num_experts=384, moe_router_topk=8,
              moe_ffn_hidden_size=2048, ffn_hidden_size=18432, moe_layer_freq=1,
              padded_vocab_size=200_000, swiglu=True, untie_embeddings_and_output_weights=True,
              bf16=True, tensor_model_parallel_size=8, pipeline_model_parallel_size=1,
              context_parallel_size=4, expert_model_parallel_size=32, sequence_parallel=True,
              micro_batch_size=1, use_distributed_optimizer=True, world_size=32)
    ns.update(over)
    return argparse.Namespace(**ns)


def test_megatron_args():
    args = _megatron_args()
    m = model_from_megatron_args(args)
    assert m.total_params() == preset("paper-241b").total_params()
    layout = layout_from_megatron_args(args)
    assert (layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.sp) == \
        (8, 4, 1, 1, 32, True)
    # moe_layer_freq as a pattern: zeros are dense layers.
    m2 = model_from_megatron_args(_megatron_args(moe_layer_freq=[0, 0] + [1] * 12))
    assert m2.dense_layers == 2 and m2.dense_ffn == 18432
    with pytest.raises(PlanError, match="hidden_size"):
        model_from_megatron_args(argparse.Namespace(num_layers=2))
    with pytest.raises(PlanError, match="does not divide"):
        layout_from_megatron_args(_megatron_args(world_size=36))


def test_megatron_args_of_a_gpt_oss_line():
    """GPT-OSS's flags read back as the preset: biases (Megatron's default), sinks, the
    window on every other layer (an int or the equivalent pattern) and quick-GEGLU."""
    gpt_oss = dict(hidden_size=2880, num_layers=36, num_attention_heads=64, num_query_groups=8,
                   kv_channels=64, num_experts=128, moe_router_topk=4, moe_ffn_hidden_size=2880,
                   ffn_hidden_size=2880, padded_vocab_size=201_088, swiglu=False,
                   quick_geglu=True, add_bias_linear=True, softmax_type="learnable",
                   window_size=(128, 0), window_attn_skip_freq=2)
    m = model_from_megatron_args(_megatron_args(**gpt_oss))
    ref = preset("gpt-oss-120b")
    assert (m.gated, m.glu, m.linear_bias, m.sinks, m.window, m.window_skip_freq) == \
        (True, "quick-geglu", True, True, 128, 2)
    assert m.total_params() == ref.total_params()
    listed = model_from_megatron_args(_megatron_args(**dict(
        gpt_oss, window_attn_skip_freq=[1, 0] * 18)))
    assert listed.window_skip_freq == 2
    with pytest.raises(PlanError, match="every N-th"):
        model_from_megatron_args(_megatron_args(**dict(
            gpt_oss, window_attn_skip_freq=[1, 0, 0] * 12)))
    # a line without biases or sinks (--disable-bias-linear, vanilla softmax)
    plain = model_from_megatron_args(_megatron_args(add_bias_linear=False))
    assert not (plain.linear_bias or plain.sinks or plain.window)


def test_layout_errors_are_clear():
    with pytest.raises(PlanError, match=r"TP 8 x CP 3 x PP 1 = 24 does not divide 64 GPUs"):
        Layout.for_gpus(64, tp=8, cp=3)
    with pytest.raises(PlanError, match="EP 3 must divide"):
        Layout(tp=2, ep=3, dp=2)
    with pytest.raises(PlanError, match="tp must be a positive integer"):
        Layout(tp=0)
    model = preset("paper-120b")
    with pytest.raises(PlanError, match="TP 16 does not divide .* 56 attention heads"):
        check_layout(model, Layout(tp=16))
    with pytest.raises(PlanError, match="EP 5 does not divide .* 384 experts"):
        check_layout(model, Layout(ep=5, dp=5))


def test_default_layouts_for_the_paper_family():
    for name, gpus, cp in (("paper-120b", 16, 2), ("paper-241b", 32, 4), ("paper-667b", 64, 8)):
        lay = default_layout(preset(name), gpus)
        assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, lay.gpus) == (8, cp, 1, 1, gpus, gpus)
    # Given sizes are kept, the rest is filled in.
    lay = default_layout(preset("paper-667b"), 64, tp=4, pp=2)
    assert (lay.tp, lay.pp, lay.cp, lay.ep) == (4, 2, 8, 32)
    lay = default_layout(preset("gpt-oss-20b"), 8)
    assert (lay.tp, lay.ep) == (8, 8)
    with pytest.raises(PlanError, match="does not divide"):
        default_layout(preset("paper-667b"), 60, tp=8)


def test_stage_layers_split_contiguously():
    m = preset("deepseek-v3")  # 61 layers
    stages = stage_layers(m, Layout(pp=4))
    assert stages == [(0, 16), (16, 16), (32, 16), (48, 13)]


def test_model_validation():
    with pytest.raises(PlanError, match="do not group"):
        ModelSpec(name="x", hidden=8, layers=1, heads=3, kv_heads=2, head_dim=4, vocab=10,
                  dense_ffn=8)
    with pytest.raises(PlanError, match="dense_ffn"):
        ModelSpec(name="x", hidden=8, layers=1, heads=2, kv_heads=2, head_dim=4, vocab=10)
    with pytest.raises(PlanError, match="dtype"):
        ModelSpec(name="x", hidden=8, layers=1, heads=2, kv_heads=2, head_dim=4, vocab=10,
                  dense_ffn=8, dtype="int3")
