"""``megatron_flat.install``: the one call that turns megatron-flat on for a Megatron run.

Called once, before the model is built, with a ``FlatConfig`` or Megatron-LM's parsed
arguments (which carry the ``--flat-*`` flags). It validates the knobs against the
Megatron settings they depend on — every problem is reported at once, before any model,
process group or collective exists — and then wires in each enabled technique through
the registry below. With every technique off it changes nothing. Calling it again with
the same configuration is a no-op; with a different one it is an error (a half-swapped
model would train wrongly).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Union

from megatron_flat.config import FlatConfig
from megatron_flat.megatron.state import FlatConfigError, installed, set_installed
from megatron_flat.megatron.state import setting as _get

__all__ = ["FlatConfigError", "check_against_megatron", "install", "installed"]


def check_against_megatron(flat: FlatConfig, megatron: Any) -> List[str]:
    """Reasons ``flat`` cannot run with ``megatron`` (Megatron-LM args or TransformerConfig).

    Empty when compatible. Only settings present on ``megatron`` are checked.
    """
    problems = []
    if hasattr(megatron, "spec"):  # Megatron-LM's args: a flat --spec must name its modules
        from megatron_flat.megatron.spec import flat_spec_problems

        problems += flat_spec_problems(megatron)
    experts = _get(megatron, "num_moe_experts", "num_experts")
    ep = _get(megatron, "expert_model_parallel_size", default=1) or 1
    if flat.dispatch != "off":
        if not experts:
            problems.append(f"--flat-dispatch {flat.dispatch} needs an MoE model "
                            "(--num-experts is not set)")
        elif experts % ep:
            problems.append(f"--num-experts {experts} does not split over "
                            f"--expert-model-parallel-size {ep}")
        from megatron_flat.megatron.moe_refusals import refused_settings

        problems += [f"--flat-dispatch: {reason}" for reason in refused_settings(megatron)]
    if flat.sco:
        from megatron_flat.megatron.graph_refusals import sco_graph_problems
        from megatron_flat.megatron.sco import recompute_problems

        problems += recompute_problems(megatron)
        problems += sco_graph_problems(megatron)
    if flat.vocab:
        from megatron_flat.megatron.vocab import unsupported_settings

        problems += [f"--flat-vocab: {reason}" for reason in unsupported_settings(megatron)]
    if flat.optimizer_offload:
        optimizer = _get(megatron, "optimizer", default="adam")
        if optimizer != "adam":
            problems.append(f"--flat-optimizer-offload implements AdamW: it needs --optimizer adam "
                            f"(got {optimizer!r})")
        if _get(megatron, "optimizer_cpu_offload", default=False):
            problems.append("--flat-optimizer-offload replaces --optimizer-cpu-offload: use one")
    if flat.param_offload:
        from megatron_flat.megatron.param_offload import megatron_problems

        problems += [f"--flat-param-offload: {reason}" for reason in megatron_problems(megatron)]
    if flat.attn_tiles:
        problems += attn_tiles_problems(megatron)
    if flat.attn_replay:
        from megatron_flat.megatron.replay_wiring import recompute_problems as replay_problems

        from megatron_flat.megatron.graph_refusals import replay_graph_problems

        problems += replay_problems(megatron)
        problems += replay_graph_problems(megatron)
    return problems


FLAT_SPEC_MODULE = "megatron_flat.megatron.spec"


def attn_tiles_problems(megatron: Any) -> List[str]:
    """Why ``--flat-attn-tiles`` cannot run with ``megatron`` (only settings present are
    checked): the tiles split the attention block's sequence-parallel gather and
    reduce-scatter, so they need sequence parallelism over TP > 1, self-attention with a
    fused QKV projection or multi-latent attention (not its fused down projection), and
    (Megatron-LM) the flat layer spec that builds them."""
    problems = []
    tp = _get(megatron, "tensor_model_parallel_size", default=None)
    sp = _get(megatron, "sequence_parallel", default=None)
    if (tp is not None and tp <= 1) or sp is False:
        problems.append("--flat-attn-tiles tiles the attention block's sequence-parallel "
                        "all-gather and reduce-scatter: it needs --sequence-parallel with "
                        "--tensor-model-parallel-size > 1 (without them nothing is gathered)")
    if _get(megatron, "multi_latent_attention", default=False) and \
            _get(megatron, "mla_down_proj_fusion", default=False):
        problems.append("--flat-attn-tiles: --mla-down-proj-fusion builds FusedMLASelfAttention, "
                        "whose fused down projection is not tiled; drop --mla-down-proj-fusion "
                        "(MLASelfAttention's projections are tiled)")
    if hasattr(megatron, "spec"):  # Megatron-LM's args: the layer spec comes from --spec
        spec = getattr(megatron, "spec", None)
        if not spec or spec[0] != FLAT_SPEC_MODULE:
            problems.append("--flat-attn-tiles is built by the flat layer specs: add --spec "
                            f"{FLAT_SPEC_MODULE} flat_gpt_layer_spec (or flat_gpt_layer_te_spec)")
    return problems


# Technique name -> function(flat, megatron) that wires it in. A technique enters the
# registry when its Megatron integration lands; until then install() says so plainly.
WIRING: Dict[str, Callable[[FlatConfig, Any], None]] = {}


def _wire_sco(flat: FlatConfig, megatron: Any) -> None:
    """--flat-sco: the boundaries of full and module recompute go through SCO."""
    from megatron_flat.megatron.sco import wire_sco

    wire_sco(flat, megatron)


WIRING["sco"] = _wire_sco


def _wire_dispatch(flat: FlatConfig, megatron: Any) -> None:
    """--flat-dispatch: Megatron's stock MoE specs build FlatMoELayer (megatron.spec)."""
    from megatron_flat.megatron.spec import wire_dispatch

    try:
        wire_dispatch(flat, megatron)
    except ValueError as exc:
        raise FlatConfigError(f"megatron-flat cannot be installed:\n  - {exc}") from None


WIRING["dispatch"] = _wire_dispatch


def _wire_vocab(flat: FlatConfig, megatron: Any) -> None:
    """--flat-vocab: every GPTModel computes projection + loss through Ring-DTP (megatron.vocab)."""
    from megatron_flat.megatron.vocab import wire_vocab

    try:
        wire_vocab(flat, megatron)
    except ValueError as exc:
        raise FlatConfigError(f"megatron-flat cannot be installed:\n  - {exc}") from None


WIRING["vocab"] = _wire_vocab


def _wire_optimizer_offload(flat: FlatConfig, megatron: Any) -> None:
    """--flat-optimizer-offload: get_megatron_optimizer builds OffloadStreamAdamW inner
    optimizers (megatron.optimizer); raises FlatConfigError itself."""
    from megatron_flat.megatron.optimizer import wire_optimizer_offload

    wire_optimizer_offload(flat, megatron)


WIRING["optimizer_offload"] = _wire_optimizer_offload

def _wire_attn_tiles(flat: FlatConfig, megatron: Any) -> None:
    """--flat-attn-tiles: nothing to patch; the flat layer specs read the installed FlatConfig
    when the model is built and put the tiled projections in (megatron.spec)."""


WIRING["attn_tiles"] = _wire_attn_tiles


def _wire_attn_replay(flat: FlatConfig, megatron: Any) -> None:
    """--flat-attn-replay: the checkpoint phase marks on; replay-capable core attentions get
    their stores at first use, in SCO's host pool (wired before, above); or one warning and
    the stock recompute where it cannot be exact (megatron.replay_wiring)."""
    from megatron_flat.megatron.replay_wiring import wire_attn_replay

    wire_attn_replay(flat, megatron)


WIRING["attn_replay"] = _wire_attn_replay


def _wire_param_offload(flat: FlatConfig, megatron: Any) -> None:
    """--flat-param-offload: every DDP built offloads its flat MoE layers' routed experts
    (megatron.param_offload) and the optimizer chain steps them on their host state
    (megatron.param_offload_optimizer; OffloadStreamAdamW is wired above)."""
    from megatron_flat.megatron.param_offload import wire_ddp
    from megatron_flat.megatron.param_offload_optimizer import wire_optimizer

    wire_ddp()
    wire_optimizer()


WIRING["param_offload"] = _wire_param_offload

_ENABLED = {
    "dispatch": lambda f: f.dispatch != "off",
    "vocab": lambda f: f.vocab,
    "sco": lambda f: f.sco,
    "optimizer_offload": lambda f: f.optimizer_offload,
    "attn_tiles": lambda f: f.attn_tiles > 0,
    "attn_replay": lambda f: f.attn_replay,
    "param_offload": lambda f: f.param_offload,
}


def _host_problems(flat: FlatConfig) -> List[str]:
    """The node check of the host budgets known at install (SCO's), nothing allocated."""
    if not flat.sco:
        return []
    from megatron_flat.runtime import host_tier

    trial = host_tier.HostTier(node_budget_bytes=flat.host_mem_per_node_bytes or None)
    try:
        trial.declare("sco", flat.sco_host_budget_bytes)
    except host_tier.HostTierError as exc:
        return [str(exc)]
    return []


def install(config_or_args: Union[FlatConfig, argparse.Namespace],
            megatron: Any = None) -> FlatConfig:
    """Validate and wire in megatron-flat; returns the FlatConfig in force.

    ``config_or_args``: a ``FlatConfig``, or Megatron-LM's args namespace (then the same
    namespace is also the Megatron configuration checked against, unless ``megatron`` is
    given — a TransformerConfig or args). Raises ``FlatConfigError`` listing every problem.
    """
    if isinstance(config_or_args, FlatConfig):
        flat = config_or_args
    else:
        flat = FlatConfig.from_args(config_or_args)
        megatron = config_or_args if megatron is None else megatron
    current = installed()
    if current is not None:
        if flat == current:
            return current
        raise FlatConfigError("megatron-flat is already installed with a different FlatConfig; "
                              "install() once per process, before the model is built")
    problems = check_against_megatron(flat, megatron) if megatron is not None else []
    problems += _host_problems(flat)
    missing = [name for name, on in _ENABLED.items() if on(flat) and name not in WIRING]
    problems += [f"--flat-{name.replace('_', '-')}: not available in this release of megatron-flat"
                 for name in missing]
    if problems:
        raise FlatConfigError("megatron-flat cannot be installed:\n  - " + "\n  - ".join(problems))
    # One host tier for SCO and OffloadStreamAdamW; nothing is allocated or pinned here (the
    # device may not be set yet): pools are created at first use.
    from megatron_flat.runtime import host_tier

    host_tier.configure(node_budget_bytes=flat.host_mem_per_node_bytes or None,
                        allow_pageable=flat.host_pageable)
    if megatron is not None and hasattr(megatron, "spec"):
        # A flat --spec means Megatron's own spec for the line with the flat modules swapped
        # in: Megatron-LM's builder builds it once the name is off the line.
        from megatron_flat.megatron.spec import redirect_flat_spec

        redirect_flat_spec(megatron)
    for name, on in _ENABLED.items():
        if on(flat):
            WIRING[name](flat, megatron)
    set_installed(flat)
    return flat


def _reset_for_tests() -> None:
    """Forget the installed FlatConfig and undo the process-wide wiring (tests only)."""
    set_installed(None)
    import sys

    optimizer = sys.modules.get("megatron_flat.megatron.optimizer")
    if optimizer is not None:
        optimizer.unwire_optimizer_offload()
    sco = sys.modules.get("megatron_flat.megatron.sco")
    if sco is not None and sco.enabled() is not None:
        sco.disable()
    spec = sys.modules.get("megatron_flat.megatron.spec")
    if spec is not None:
        spec._unredirect_for_tests()
    offload = sys.modules.get("megatron_flat.megatron.param_offload")
    if offload is not None:
        offload.unwire_ddp()
    offload_optimizer = sys.modules.get("megatron_flat.megatron.param_offload_optimizer")
    if offload_optimizer is not None:
        offload_optimizer.unwire_optimizer()
    replay = sys.modules.get("megatron_flat.megatron.replay_wiring")
    if replay is not None:
        replay.unwire()
    from megatron_flat.runtime import host_tier

    host_tier.configure()
    # dispatch and vocab wiring read installed() at model build / forward time: inert now.
