"""The peak planner: will a long-context MoE run fit, which term binds, which knobs fit it.

    from megatron_flat.plan import estimate, fit, max_context, preset, search_layouts

    model = preset("paper-667b")
    search = search_layouts(model, 64, 141 << 30, 2 << 40, seq_len=1 << 20)
    layout = search.chosen                             # TP 8 x CP 8, EP 64: searched
    search.reach["fsdp2-offload"]                      # a baseline's own best layouts
    report = estimate(model, layout, seq_len=1 << 20)  # baseline: flat=None
    report.total, report.binding                       # bytes per GPU, e.g. "optimizer"
    chosen = fit(model, layout, 1 << 20, device_bytes=141 << 30, host_bytes=2 << 40)
    chosen.flat                                        # a FlatConfig to launch with
    max_context(model, layout, 141 << 30, 2 << 40)     # Reach(baseline=..., flat=...)

Modules: ``model`` (ModelSpec, Layout, presets, Hugging Face / Megatron-LM inputs),
``peaks`` (the formulas, one function per term), ``fit`` (knobs and reach), ``layouts``
(searching TP, CP, PP, DP and EP for flat and each baseline), ``units`` (sizes like ``1M``
and ``141GiB``), ``cli`` (``python -m megatron_flat plan``). ``default_layout`` is the
search-free layout (TP in the node, CP the rest).
"""

from megatron_flat.plan.fit import (
    KNOBS,
    TECHNIQUES,
    DoesNotFit,
    Fit,
    Reach,
    fit,
    max_context,
    tightest_report,
)
from megatron_flat.plan.model import (
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
from megatron_flat.plan.layouts import (
    LayoutSearch,
    candidate_layouts,
    parse_layout,
    search_layouts,
)
from megatron_flat.plan.peaks import DEFAULT_SKEW, PeakReport, estimate
from megatron_flat.plan.units import format_bytes, format_tokens, parse_bytes, parse_tokens

__all__ = [
    "DEFAULT_SKEW", "DoesNotFit", "Fit", "KNOBS", "Layout", "LayoutSearch", "ModelSpec", "PRESETS",
    "PeakReport", "PlanError", "Reach", "TECHNIQUES", "candidate_layouts", "default_layout",
    "estimate", "fit", "format_bytes", "format_tokens", "layout_from_megatron_args",
    "load_model", "max_context", "model_from_hf_config", "model_from_megatron_args",
    "parse_bytes", "parse_layout", "parse_tokens", "preset", "search_layouts", "tightest_report",
]
