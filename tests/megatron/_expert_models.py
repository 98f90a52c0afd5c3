"""The tiny GPT with each expert module kind the CPU backend builds (shared by the expert
sharding and expert-TP tests; not a test module)."""

import torch.nn.functional as F

# kind -> the experts class Megatron builds for it
KINDS = {"sequential": "SequentialMLP", "grouped-mlp": "GroupedMLP",
         "te-grouped": "TEGroupedMLP"}


def experts_spec(kind: str):
    """The experts spec of a grouped ``kind``: 0.16's ``GroupedMLP`` (the CPU reference
    grouped GEMM), or ``TEGroupedMLP`` over the CPU grouped linears."""
    from megatron_flat.cpu.grouped import (
        CpuColumnParallelGroupedLinear,
        CpuRowParallelGroupedLinear,
    )
    from megatron_flat.megatron import compat

    if kind == "grouped-mlp":
        from megatron.core.transformer.spec_utils import ModuleSpec

        return ModuleSpec(module=compat.grouped_mlp_class())
    return compat.te_grouped_mlp_spec(CpuColumnParallelGroupedLinear,
                                      CpuRowParallelGroupedLinear)


def build_model(tiny, kind: str, layout: tuple, glu: bool, bias: bool):
    """The tiny GPT with ``kind`` experts at ``layout`` (inside its ``megatron_layout``)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flat.megatron import compat
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, transformer_config

    tp, ep, etp = layout
    config = transformer_config(tiny, tp=tp, ep=ep, expert_tensor_parallel_size=etp,
                                gated_linear_unit=glu, activation_func=F.silu if glu else F.gelu,
                                add_bias_linear=bias, moe_grouped_gemm=kind != "sequential")
    spec = get_gpt_layer_local_spec(num_experts=tiny.num_experts, normalization="RMSNorm")
    if kind != "sequential":
        mlp = compat.replace_experts(spec.submodules.mlp, experts_spec(kind))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                        mlp=mlp))
    return build_tiny_gpt(tiny, config, layer_spec=spec), config
