"""The Megatron settings ``--flat-dispatch`` refuses, in one table.

``FlatMoELayer`` (:mod:`megatron_flat.megatron.moe`) keeps ``MoELayer``'s router, experts and
shared experts and replaces its ``forward``: route → PipelinedLLEP (dispatch, expert compute,
combine) → add the shared experts. A Megatron setting is refused here when, with that layer,
it would be silently bypassed or would compute something else:

* it runs the MoE layer through another door than ``forward`` — the stock ``dispatch`` /
  ``combine`` methods called from Megatron's A2A-overlap schedule, or a CUDA graph around the
  layer (the flat dispatcher plans each step on the host from the routing: one host sync per
  forward pass and chunk sizes that follow the routing, which a graph cannot capture);
* it asks for work done inside the stock dispatcher (flex kernels, shared-expert overlap,
  padding, latent projections, delayed weight gradients);
* it keeps the expert weights where the flat dispatcher cannot take one expert's weights to a
  helper rank (sharded, fused or grouped into one parameter).

Each entry says what was asked (the Megatron-LM flag and the config field), why it conflicts
and what to use instead. :func:`refused_settings` reads plain attributes with defaults, so one
table serves Megatron-LM's args and a ``TransformerConfig`` of every release (a field a release
lacks reads as off); CUDA-graph spellings differ by release and are read through
:func:`megatron_flat.megatron.compat.cuda_graph_settings`. Nothing here imports Megatron.
``megatron_flat.install`` reports these with every other problem before anything is built, and
``FlatMoELayer`` checks them again before ``MoELayer`` builds its dispatcher.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

from megatron_flat.megatron import compat

__all__ = ["REFUSALS", "Refusal", "refused_settings"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One Megatron setting the flat dispatcher refuses."""

    flag: str  # the Megatron-LM flag (docs/flags.md's table names each)
    asked: Callable[[Any], Optional[str]]  # what the config asks, as written back; None: not set
    why: str
    instead: str

    def check(self, config: Any) -> Optional[str]:
        """The one-line refusal for ``config``, or None when it does not ask for this."""
        asked = self.asked(config)
        return None if asked is None else f"{asked}: {self.why}; {self.instead}"


def _shown(flag: str, field: str, value: Any) -> str:
    """``--flag value (field=value)``: as given on Megatron-LM's command line and in code."""
    return f"{flag}{'' if value is True else f' {value}'} ({field}={value!r})"


def _field(field: str, flag: Optional[str] = None,
           refused: Callable[[Any], bool] = bool) -> Callable[[Any], Optional[str]]:
    """Asks for the refusal when ``refused(config.field)``; absent fields read as None."""
    flag = flag or "--" + field.replace("_", "-")

    def asked(config: Any) -> Optional[str]:
        value = getattr(config, field, None)
        return _shown(flag, field, value) if value is not None and refused(value) else None

    return asked


def _any(*checks: Callable[[Any], Optional[str]]) -> Callable[[Any], Optional[str]]:
    """The first of ``checks`` that asks (several spellings of one setting)."""
    def asked(config: Any) -> Optional[str]:
        for check in checks:
            found = check(config)
            if found is not None:
                return found
        return None

    return asked


def _with_grouped_gemm(check: Callable[[Any], Optional[str]]) -> Callable[[Any], Optional[str]]:
    """``check``, only for grouped-GEMM experts (``--moe-grouped-gemm``)."""
    def asked(config: Any) -> Optional[str]:
        if not getattr(config, "moe_grouped_gemm", False):
            return None
        found = check(config)
        return None if found is None else f"--moe-grouped-gemm with {found}"

    return asked


def _expert_weight_shards(config: Any) -> Optional[str]:
    """0.19 on: expert weights sharded over an extra (GTP) axis and re-gathered per use."""
    etp = getattr(config, "expert_tensor_parallel_size", None) or 1
    shards = getattr(config, "expert_tensor_parallel_num_weight_shards", None)
    if shards is not None and shards > etp:
        return _shown("--expert-tensor-parallel-num-weight-shards",
                      "expert_tensor_parallel_num_weight_shards", shards)
    remat = getattr(config, "expert_gtp_weight_remat_size", None) or 1
    if remat > 1:
        return f"expert weight rematerialization (expert_gtp_weight_remat_size={remat})"
    return None


_MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")


def _graphed_moe(config: Any) -> Optional[str]:
    """The CUDA-graph settings that put an MoE layer (or part of it) inside a graph."""
    graphs = compat.cuda_graph_settings(config)
    if graphs.impl == "none":
        return None
    if graphs.impl == "full_iteration":
        return "--cuda-graph-impl full_iteration captures the whole training iteration"
    scopes = " ".join(graphs.scopes)
    asked = f"--cuda-graph-impl {graphs.impl}" + (
        f" {graphs.scope_flag} {scopes}" if scopes else f" (no {graphs.scope_flag}: whole layers)")
    if "full_iteration" in graphs.scopes:
        return f"{asked} captures the whole training iteration"
    moe = [s for s in graphs.scopes if s in _MOE_SCOPES]
    if moe:
        return f"{asked} captures {' and '.join(moe)} of each MoE layer"
    if not graphs.scopes:
        return f"{asked} captures whole layers, MoE included"
    if graphs.impl == "local" and "attn" in graphs.scopes:
        return f"{asked} captures whole layers (the local graphs wrap each layer with attention)"
    if graphs.impl == "local" and (graphs.inference == "block"
                                   or "full_iteration_inference" in graphs.scopes):
        return f"{asked} with block-level inference graphs captures MoE layers in inference"
    return None


_FLAT_A2A = "FlatMoELayer runs its own all-to-all over the expert-parallel group"
_NO_STOCK = "the flat layer never calls the stock dispatcher"

REFUSALS: Tuple[Refusal, ...] = (
    Refusal(
        "--moe-token-dispatcher-type flex",
        _any(_field("moe_token_dispatcher_type", refused=lambda v: v == "flex"),
             _field("moe_enable_deepep")),
        f"{_FLAT_A2A}, so the flex dispatcher (DeepEP / HybridEP / NCCL-EP) would never run",
        "use --moe-token-dispatcher-type alltoall, or --flat-dispatch off to keep flex"),
    Refusal(
        "--overlap-moe-expert-parallel-comm",
        _field("overlap_moe_expert_parallel_comm"),
        "Megatron's A2A-overlap schedule calls MoELayer's stock route / dispatch / combine "
        "methods itself, so the flat dispatcher would never run",
        "leave it off: PipelinedLLEP overlaps each chunk's expert compute with the next "
        "chunk's dispatch itself"),
    Refusal(
        "--delay-wgrad-compute",
        _field("delay_wgrad_compute"),
        "it defers the experts' weight gradients to MoELayer.backward_dw, called by the "
        "A2A-overlap schedule, while the flat dispatcher returns them (spilled experts' "
        "included) from its own backward",
        "leave it off"),
    Refusal(
        "--overlap-dispatch-backward-with-experts-wgrad",
        _field("overlap_dispatch_backward_with_experts_wgrad"),
        f"it hooks the stock MoELayer.dispatch and routed_experts_compute, which {_NO_STOCK} "
        "(the delayed expert weight gradients would never be computed)",
        "leave it off"),
    Refusal(
        "--cuda-graph-impl / --cuda-graph-scope (--cuda-graph-modules) capturing MoE layers",
        _graphed_moe,
        "the flat dispatcher cannot run inside a CUDA graph, as it plans each step on the host "
        "from the routing (one host sync per forward pass, chunk sizes that follow the routing)",
        "capture attention only (--cuda-graph-impl transformer_engine with --cuda-graph-scope "
        "attn, or --cuda-graph-modules attn from 0.19; not with --flat-attn-replay, nor with "
        "--flat-sco under core_attn recompute), or use --flat-dispatch off"),
    Refusal(
        "--moe-pad-expert-input-to-capacity",
        _field("moe_pad_expert_input_to_capacity"),
        "the flat dispatcher sends exactly the routed tokens and never pads expert inputs",
        "drop it (token dropping with --moe-expert-capacity-factor alone is supported)"),
    Refusal(
        "--moe-router-padding-for-quantization",
        _any(_field("moe_router_padding_for_quantization"),
             _field("moe_router_padding_for_fp8")),
        "the router then adds padding routes, which the flat dispatcher would take for the "
        "N·k real ones",
        "drop it (fp8 / fp4 experts are not supported by the flat dispatcher)"),
    Refusal(
        "--fp8-format / --fp4-format",
        _any(_field("fp8", "--fp8-format"), _field("fp4", "--fp4-format")),
        "the flat dispatcher's expert calls do not run fp8 / fp4 expert GEMMs",
        "train the experts in bf16, or use --flat-dispatch off"),
    Refusal(
        "--moe-latent-size",
        _field("moe_latent_size"),
        "MoELayer projects tokens to the latent size around the stock dispatch "
        "(fc1_latent_proj / fc2_latent_proj), which the flat layer's forward does not run",
        "use --flat-dispatch off for latent MoE"),
    Refusal(
        "--expert-tensor-parallel-size",
        _field("expert_tensor_parallel_size", refused=lambda v: v != 1),
        "the flat dispatcher moves whole experts between ranks and does not split them over an "
        "expert tensor-parallel group",
        "set --expert-tensor-parallel-size 1"),
    Refusal(
        "--expert-tensor-parallel-num-weight-shards",
        _expert_weight_shards,
        "expert weights are then sharded and re-gathered inside each grouped linear, so the flat "
        "dispatcher cannot send one expert's whole weights to a helper rank",
        "leave it unset"),
    Refusal(
        "--use-transformer-engine-op-fuser (with --moe-grouped-gemm)",
        _with_grouped_gemm(_field("use_transformer_engine_op_fuser")),
        "TEGroupedMLP then runs one fused op holding its own references to the expert weights, "
        "so the weights of a spilled expert, swapped in by the flat dispatcher, would not be used",
        "drop it (TEGroupedMLP without the op fuser is supported)"),
    Refusal(
        "--moe-single-grouped-weight",
        _field("moe_single_grouped_weight"),
        "all experts' weights become one grouped parameter, which the flat dispatcher cannot "
        "split per expert",
        "drop it (one weight per expert, TEGroupedMLP's default, is supported)"),
    Refusal(
        "--transformer-impl inference_optimized",
        _field("transformer_impl", refused=lambda v: v == "inference_optimized"),
        "its MoE layers use the inference dispatchers (NCCL / NVLS all-gather) and "
        "InferenceGroupedMLP's concatenated weights, which the flat layer bypasses (0.16: its "
        "spec builds no MoE layer at all)",
        "train with --transformer-impl transformer_engine or local; serve with --flat-dispatch "
        "off"),
)
"""Every refused setting, in the order docs/flags.md's table lists them."""


def refused_settings(config: Any) -> List[str]:
    """One line per setting of ``config`` (Megatron-LM args or TransformerConfig) that
    ``--flat-dispatch`` refuses: what was asked, why it conflicts, what to use instead."""
    return [line for line in (r.check(config) for r in REFUSALS) if line is not None]
