"""Nothing silently bypassed: every Megatron setting that would route around FlatMoELayer's
dispatch (or break what it computes) is refused by ``install()`` with ``--flat-dispatch``,
naming the flag, on the installed megatron-core — from Megatron-LM's args (every release's
spelling) and from a real ``TransformerConfig`` (the release's own normalization); the settings
that stay supported run the flat path. Run under each venv (0.16.1 and 0.19.2)."""

import pathlib
import re
import warnings

import pytest
import torch

import megatron_flat
from megatron_flat.config import FlatConfig
from megatron_flat.megatron import install as inst
from megatron_flat.testing.launch_args import megatron_args
from megatron_flat.megatron.moe_refusals import REFUSALS

PIPELINED = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=5, llep_min_tokens_per_gemm=1)
FLAGS_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "flags.md"


@pytest.fixture(autouse=True)
def fresh():
    inst._reset_for_tests()
    yield
    inst._reset_for_tests()


# (settings on Megatron-LM's args, text the refusal must contain). Fields a release lacks are
# plain attributes here: the check reads the spelling of every release, 0.16 to main.
REFUSED_ARGS = {
    "flex": (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type flex"),
    "deepep": (dict(moe_enable_deepep=True), "--moe-enable-deepep"),
    "a2a-overlap": (dict(overlap_moe_expert_parallel_comm=True),
                    "--overlap-moe-expert-parallel-comm"),
    "delay-wgrad": (dict(delay_wgrad_compute=True), "--delay-wgrad-compute"),
    "dispatch-bwd-wgrad": (dict(overlap_dispatch_backward_with_experts_wgrad=True),
                           "--overlap-dispatch-backward-with-experts-wgrad"),
    "graph-moe-router": (dict(cuda_graph_impl="transformer_engine",
                              cuda_graph_scope=["moe_router", "moe_preprocess"]),
                         "--cuda-graph-scope moe_router moe_preprocess"),
    "graph-moe-0.19": (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe"]),
                       "--cuda-graph-modules moe"),
    "graph-scope-before-validation": (dict(cuda_graph_impl="transformer_engine",
                                           cuda_graph_modules=[],
                                           cuda_graph_scope_deprecated=["moe_router"]),
                                      "--cuda-graph-scope moe_router"),
    "graph-full-scope": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["full"]),
                         "(no --cuda-graph-scope: whole layers)"),
    "graph-local-attn": (dict(cuda_graph_impl="local", cuda_graph_modules=["attn"]),
                         "--cuda-graph-impl local --cuda-graph-modules attn"),
    "graph-enable-cuda-graph": (dict(enable_cuda_graph=True), "--cuda-graph-impl local"),
    "graph-full-iteration": (dict(cuda_graph_impl="full_iteration"),
                             "--cuda-graph-impl full_iteration"),
    "graph-full-iteration-0.16": (dict(cuda_graph_impl="local",
                                       cuda_graph_scope=["full_iteration"]),
                                  "whole training iteration"),
    "graph-inference-block": (dict(cuda_graph_impl="local", cuda_graph_modules=["mamba"],
                                   inference_cuda_graph_scope="block"),
                              "block-level inference graphs"),
    "pad-to-capacity": (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
                        "--moe-pad-expert-input-to-capacity"),
    "router-padding": (dict(moe_router_padding_for_quantization=True),
                       "--moe-router-padding-for-quantization"),
    "router-padding-fp8": (dict(moe_router_padding_for_fp8=True), "--moe-router-padding-for-fp8"),
    "fp8": (dict(fp8="hybrid"), "--fp8-format hybrid"),
    "fp4": (dict(fp4="nvfp4"), "--fp4-format nvfp4"),
    "latent": (dict(moe_latent_size=16), "--moe-latent-size 16"),
    "expert-tp": (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size 2"),
    "expert-weight-shards": (dict(expert_tensor_parallel_size=1,
                                  expert_tensor_parallel_num_weight_shards=2),
                             "--expert-tensor-parallel-num-weight-shards 2"),
    "op-fuser": (dict(moe_grouped_gemm=True, use_transformer_engine_op_fuser=True),
                 "--moe-grouped-gemm with --use-transformer-engine-op-fuser"),
    "single-grouped-weight": (dict(moe_grouped_gemm=True, moe_single_grouped_weight=True),
                              "--moe-single-grouped-weight"),
    "inference-optimized": (dict(transformer_impl="inference_optimized"),
                            "--transformer-impl inference_optimized"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_ARGS))
def test_refused_from_megatron_lm_args(name):
    settings, flag = REFUSED_ARGS[name]
    # With --flat-dispatch off the stock MoE layer runs: nothing to refuse.
    assert megatron_flat.install(megatron_args(**settings)).dispatch == "off"
    inst._reset_for_tests()
    with pytest.raises(inst.FlatConfigError) as err:
        megatron_flat.install(megatron_args("--flat-dispatch", "pipelined", **settings))
    text = str(err.value)
    assert f"--flat-dispatch: {flag}" in text or ("--flat-dispatch: " in text and flag in text)
    line = next(line for line in text.splitlines() if flag in line)
    assert "; " in line, f"no alternative given: {line}"  # what was asked: why; instead
    assert inst.installed() is None


# Settings the flat dispatch honours (or that only choose the stock dispatcher's kernels, which
# it replaces): install() takes them.
ACCEPTED_ARGS = {
    "allgather": dict(moe_token_dispatcher_type="allgather"),
    "permute-fusion": dict(moe_permute_fusion=True),
    "token-dropping": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=False),
    "apply-probs-on-input": dict(moe_apply_probs_on_input=True),
    "shared-experts": dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=False),
    # Issued on the shared experts' stream before routing, joined after the routed experts.
    "shared-expert-overlap": dict(moe_shared_expert_intermediate_size=32,
                                  moe_shared_expert_overlap=True),
    "graph-te-attn": dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]),
    "graph-te-attn-0.19": dict(cuda_graph_impl="transformer_engine",
                               cuda_graph_modules=["attn", "mamba"]),
    "graph-local-mamba": dict(cuda_graph_impl="local", cuda_graph_modules=["mamba"],
                              inference_cuda_graph_scope="layer"),
    "graph-none": dict(cuda_graph_impl="none", cuda_graph_scope=["moe"]),
    "op-fuser-dense-only": dict(use_transformer_engine_op_fuser=True, moe_grouped_gemm=False),
    "grouped-bias-free": dict(moe_grouped_gemm=True, add_bias_linear=False),
    # GPT-OSS's experts: the bank swaps each expert's biases with its weights.
    "grouped-bias": dict(moe_grouped_gemm=True, add_bias_linear=True),
    "expert-tp-1": dict(expert_tensor_parallel_size=1, expert_tensor_parallel_num_weight_shards=1),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED_ARGS))
def test_accepted_from_megatron_lm_args(name, megatron_cpu):
    args = megatron_args("--flat-dispatch", "pipelined", **ACCEPTED_ARGS[name])
    assert megatron_flat.install(args).dispatch == "pipelined"


def _config(**overrides):
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated spellings, on purpose
        return transformer_config(TinyMoE(), **overrides)


# (TransformerConfig overrides, texts the refusal must contain), each constructible on CPU with
# 0.16.1 and 0.19.2: the config's own __post_init__ normalizes the values (scope lists become
# CudaGraphScope or, from 0.19, CudaGraphModule enums; "full_iteration" becomes an impl in 0.19).
REFUSED_CONFIGS = {
    "flex": (dict(dispatcher="flex"), ["--moe-token-dispatcher-type flex"]),
    "a2a-overlap": (dict(ep=2, bf16=True, overlap_moe_expert_parallel_comm=True),
                    ["--overlap-moe-expert-parallel-comm"]),
    "delay-wgrad": (dict(ep=2, bf16=True, overlap_moe_expert_parallel_comm=True,
                         delay_wgrad_compute=True), ["--delay-wgrad-compute"]),
    "graph-moe-router": (dict(cuda_graph_impl="transformer_engine",
                              cuda_graph_scope=["moe_router", "moe_preprocess"]),
                         ["--cuda-graph-impl transformer_engine", "moe_router moe_preprocess"]),
    "graph-whole-layers": (dict(cuda_graph_impl="transformer_engine"), ["whole layers"]),
    "graph-local-attn": (dict(cuda_graph_impl="local", cuda_graph_scope=["attn"]),
                         ["--cuda-graph-impl local", "attn captures whole layers"]),
    "graph-enable-cuda-graph": (dict(enable_cuda_graph=True), ["--cuda-graph-impl local"]),
    "graph-full-iteration": (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
                             ["whole training iteration"]),
    "pad-to-capacity": (dict(moe_router_load_balancing_type="aux_loss",
                             moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
                        ["--moe-pad-expert-input-to-capacity"]),
    "latent": (dict(moe_latent_size=16), ["--moe-latent-size 16"]),
    "expert-tp": (dict(expert_tensor_parallel_size=2), ["--expert-tensor-parallel-size 2"]),
}


@pytest.mark.parametrize("name", sorted(REFUSED_CONFIGS))
def test_refused_from_transformer_config(name, megatron_cpu):
    overrides, texts = REFUSED_CONFIGS[name]
    with pytest.raises(inst.FlatConfigError) as err:
        megatron_flat.install(PIPELINED, _config(**overrides))
    for text in texts:
        assert text in str(err.value)
    assert inst.installed() is None


@pytest.mark.parametrize("overrides", [
    dict(dispatcher="allgather"),
    dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]),
    dict(moe_router_load_balancing_type="aux_loss", moe_expert_capacity_factor=1.0),
    dict(moe_shared_expert_intermediate_size=32),
    dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
], ids=["allgather", "graph-te-attn", "token-dropping", "shared-experts",
        "shared-expert-overlap"])
def test_accepted_from_transformer_config(overrides, megatron_cpu):
    assert megatron_flat.install(PIPELINED, _config(**overrides)).dispatch == "pipelined"


# ---------------------------------------------------------------------------- the layer itself
def _layer(flat, **overrides):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    from megatron_flat.megatron import compat
    from megatron_flat.megatron.spec import flat_moe_spec

    spec = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=4)
    return compat.build_moe_layer(flat_moe_spec(spec, flat), _config(**overrides))


def test_layer_refuses_flex_before_building_the_flex_dispatcher(megatron_cpu):
    """Built directly (no install()), FlatMoELayer names the flag instead of failing inside
    MoEFlexTokenDispatcher's constructor (DeepEP / HybridEP, TP x EP > 1)."""
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout():
        with pytest.raises(ValueError, match="--moe-token-dispatcher-type flex"):
            _layer(PIPELINED, dispatcher="flex")
        assert _layer(FlatConfig(), dispatcher="alltoall").flat_dispatch is None  # off: stock


class _Untouchable:
    """Stands in for the layer's stock token dispatcher: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the stock token dispatcher was used ({name})")


def _run(layer, x, grad):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        x = x.clone().requires_grad_()
        out, _ = layer(x)
        out.backward(grad)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("overrides", [
    dict(dispatcher="allgather"),
    dict(moe_router_load_balancing_type="aux_loss", moe_expert_capacity_factor=0.5),
], ids=["allgather", "token-dropping"])
def test_supported_settings_run_the_flat_path(overrides, megatron_cpu):
    """The allgather dispatcher and token dropping (capacity factor, no padding): FlatMoELayer
    never touches the stock dispatcher and matches the stock alltoall layer with the same
    settings (EP=1, unchunked LLEP: the experts see the same rows, so bitwise)."""
    from megatron_flat.testing.distributed import megatron_layout

    flat = FlatConfig(dispatch="llep")
    x = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(2))
    stock_overrides = {**overrides, "dispatcher": "alltoall"}
    with megatron_layout():
        torch.manual_seed(3)
        stock = _layer(FlatConfig(), **stock_overrides)
        layer = _layer(flat, **overrides)
        layer.load_state_dict(stock.state_dict())
        assert layer.flat_dispatch is not None
        layer.token_dispatcher = _Untouchable()
        if "moe_expert_capacity_factor" in overrides:  # the router really drops routes here
            _, routing_map = stock.router(x.reshape(-1, 64))
            assert int(routing_map.sum()) < x.shape[0] * x.shape[1] * stock.config.moe_router_topk
        want, got = _run(stock, x, g), _run(layer, x, g)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- docs/flags.md
def test_readme_lists_every_refusal():
    text = FLAGS_DOC.read_text(encoding="utf-8")
    section = text.split("## Megatron settings the flat dispatcher refuses", 1)[1]
    section = section.split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    assert rows, "no refusal table"
    for refusal in REFUSALS:
        flag = re.findall(r"--[a-z0-9-]+", refusal.flag)[0]
        assert any(f"`{flag}" in row for row in rows), f"{flag} missing from docs/flags.md"
