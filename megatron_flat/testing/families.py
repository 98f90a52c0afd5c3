"""The MoE families users train, shrunk to a CPU test's size, and Megatron-LM's GPT builder.

:data:`FAMILIES` holds, per family, the ``TransformerConfig`` fields its production launch line
sets (Megatron-LM's example scripts and the Bridge recipes), at 2 layers and hidden 64: the
architecture is kept (dense/MoE pattern, attention kind, norms, biases, router settings, shared
experts, MTP), the sizes are not. :func:`family_config` makes the config for one layout.

:func:`build_like_megatron_lm` is what Megatron-LM's ``gpt_builders.gpt_builder``
(core_v0.16.1 to main) does with a parsed line, written from its behaviour: ``--spec`` is
imported and used as it is; without it the builder picks Megatron's own spec for the config;
the MTP block takes the decoder's last layer spec, and on the ``--spec`` path it fails as
Megatron-LM's does (``use_te`` is assigned only on the other branch). Tests build "the model
Megatron builds from the same line without megatron-flat" with it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Any, Dict, Iterator, Optional

import torch
import torch.nn.functional as F

__all__ = ["FAMILIES", "Family", "build_like_megatron_lm", "family_args", "family_config",
           "model_inventory", "moe_loss_scale_kept"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's shrunk line: its config fields and how the flat techniques meet it."""

    name: str
    fields: Dict[str, Any]
    mla: bool = False  # multi-latent attention: an MLATransformerConfig
    note: str = ""


_MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
            qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="yarn", rotary_scaling_factor=4.0,
            original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
            mscale_all_dim=1.0)
_DEEPSEEK_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
                        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)

FAMILIES: Dict[str, Family] = {f.name: f for f in (
    Family("deepseek_v3", dict(
        _MLA, **_DEEPSEEK_ROUTER, qk_layernorm=True, moe_layer_freq=[0, 1], num_moe_experts=8,
        moe_router_topk=2, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True,
        mtp_num_layers=1), mla=True,
        note="MLA with q/kv LoRA and YaRN, first layer dense, sigmoid router with expert bias "
             "and group-limited routing, shared expert (overlapped), MTP"),
    Family("kimi_k2", dict(
        _MLA, **_DEEPSEEK_ROUTER, qk_layernorm=True, moe_layer_freq=[0, 1], num_moe_experts=8,
        moe_router_topk=2, moe_router_num_groups=1, moe_router_group_topk=1,
        moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True), mla=True,
        note="DeepSeek-V3's architecture, one routing group"),
    Family("deepseek_v3_gqa", dict(
        **_DEEPSEEK_ROUTER, qk_layernorm=True, moe_layer_freq=[0, 1], num_moe_experts=8,
        moe_router_topk=2, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_shared_expert_intermediate_size=32, mtp_num_layers=1),
        note="DeepSeek-V3's layer pattern, router, shared expert and MTP with grouped-query "
             "attention in place of MLA (--moe-layer-freq '([0]*1+[1]*1)' --qk-layernorm)"),
    Family("qwen3_moe", dict(
        num_query_groups=2, qk_layernorm=True, num_moe_experts=8, moe_router_topk=2,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3),
        note="GQA with q/k RMSNorm, no shared expert"),
    Family("qwen2_moe", dict(
        num_query_groups=2, add_qkv_bias=True, num_moe_experts=8, moe_router_topk=2,
        moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True),
        note="qkv bias, gated shared expert"),
    Family("mixtral", dict(num_query_groups=2, num_moe_experts=8, moe_router_topk=2),
           note="top-2 of 8, GQA"),
    Family("llama4", dict(
        num_query_groups=2, moe_layer_freq=[0, 1], num_moe_experts=8, moe_router_topk=1,
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=64, qk_l2_norm=True),
        note="interleaved dense/MoE, always-on shared expert, top-1 sigmoid, L2 q/k norm"),
    Family("gpt_oss", dict(
        num_query_groups=2, num_moe_experts=8, moe_router_topk=4, add_bias_linear=True,
        add_qkv_bias=True, moe_grouped_gemm=True, softmax_type="learnable",
        window_size=(8, 0), window_attn_skip_freq=2, glu_linear_offset=1.0,
        activation_func_clamp_value=7.0),
        note="grouped-GEMM experts with biases, attention sinks, alternating sliding window, "
             "clamped GLU"),
)}


def family_config(name: str, *, num_layers: int = 2, tp: int = 1, ep: int = 1, pp: int = 1,
                  **overrides: Any):
    """The shrunk ``TransformerConfig`` (``MLATransformerConfig`` for MLA families) of family
    ``name`` for one layout: CPU-runnable settings (no fused kernels, CPU initialisation)."""
    from megatron.core.transformer import TransformerConfig

    family = FAMILIES[name]
    kwargs = dict(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        moe_ffn_hidden_size=32, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp, sequence_parallel=tp > 1, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, bias_dropout_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0)
    kwargs.update(family.fields)
    kwargs.update(overrides)
    if family.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def family_args(config: Any, *, spec: Optional[list] = None,
                transformer_impl: str = "local") -> argparse.Namespace:
    """The parsed Megatron-LM arguments :func:`build_like_megatron_lm` reads, for ``config``
    (the ones a line sets through ``core_transformer_config_from_args`` are read from it)."""
    return argparse.Namespace(
        spec=spec, transformer_impl=transformer_impl, num_experts=config.num_moe_experts,
        normalization=config.normalization, qk_l2_norm=config.qk_l2_norm,
        mtp_num_layers=config.mtp_num_layers, experimental_attention_variant=None,
        heterogeneous_layers_config_path=None, multi_latent_attention=config.multi_latent_attention,
        qk_layernorm=config.qk_layernorm, moe_grouped_gemm=config.moe_grouped_gemm,
        num_layers=config.num_layers, tensor_model_parallel_size=config.tensor_model_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        sequence_parallel=config.sequence_parallel)


def _layer_spec_without_spec(args: argparse.Namespace, config: Any, use_te: bool,
                             vp_stage: Optional[int]):
    """The decoder spec Megatron-LM's builder chooses itself (no ``--spec``)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if args.num_experts:
        return specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    dense = dict(num_experts=None, moe_grouped_gemm=config.moe_grouped_gemm,
                 qk_layernorm=config.qk_layernorm,
                 multi_latent_attention=config.multi_latent_attention,
                 qk_l2_norm=config.qk_l2_norm)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**dense)
    return specs.get_gpt_layer_local_spec(normalization=config.normalization, **dense)


def build_like_megatron_lm(args: argparse.Namespace, config: Any, *, vocab_size: int,
                           max_sequence_length: int, pre_process: bool = True,
                           post_process: bool = True, vp_stage: Optional[int] = None):
    """The ``GPTModel`` Megatron-LM's GPT builder makes for ``args`` and ``config``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import import_module

    if args.spec is not None:
        layer_spec = import_module(args.spec)
        if args.mtp_num_layers is not None:
            # Megatron-LM assigns use_te only when --spec is absent, then reads it here.
            raise UnboundLocalError("cannot access local variable 'use_te' where it is not "
                                    "associated with a value")
        mtp_block_spec = None
    else:
        use_te = args.transformer_impl == "transformer_engine"
        layer_spec = _layer_spec_without_spec(args, config, use_te, vp_stage)
        mtp_block_spec = None
        if args.mtp_num_layers is not None:
            last = specs.get_gpt_decoder_layer_specs(
                config, use_transformer_engine=use_te, normalization=args.normalization,
                qk_l2_norm=args.qk_l2_norm)[-1]
            mtp_block_spec = specs.get_gpt_mtp_block_spec(
                config, last, use_transformer_engine=use_te, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, pre_process=pre_process,
                    post_process=post_process, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, mtp_block_spec=mtp_block_spec,
                    vp_stage=vp_stage)


def model_inventory(model: torch.nn.Module):
    """``(parameters, modules)`` of a model: ``[(name, shape, dtype)]`` in registration order
    and ``{qualified module name: class}``, what two builds of "the same model" must share."""
    parameters = [(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]
    modules = {name: type(m) for name, m in model.named_modules()}
    return parameters, modules


@contextlib.contextmanager
def moe_loss_scale_kept() -> Iterator[None]:
    """Put Megatron's process-wide MoE aux-loss scale back after the block: a forward and
    backward outside a training schedule (an equivalence check of a family's model) makes
    one, and a later schedule in the same process must set its own."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
