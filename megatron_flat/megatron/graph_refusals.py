"""The CUDA-graph settings SCO and attention replay refuse.

A CUDA graph records a stream's work once and replays it; host code inside the captured
region runs only at capture. SCO's checkpoint call forks its copy stream (an offload's event
and wait), takes an offset in its host pool and queries events: inside a capture, the fork
is captured into the graph, the pool offset advances once and every replay copies into the
same host bytes, and ``Event.query`` on a captured event is an error. Attention replay keeps
each layer's O and LSE in the first pass and skips the attention kernel in the re-run by a
host-side decision per call: captured, the decision is frozen at capture. So each technique
refuses the graphs that would capture its own code:

* SCO, when a checkpoint call it offloads lies inside a captured region: the whole iteration
  (``--cuda-graph-impl full_iteration``, or 0.16's scope ``full_iteration``), whole layers
  (no scope; the local implementation wraps the whole layer whenever it captures
  attention), or a scope that holds a module it checkpoints under selective recompute
  (``core_attn`` inside ``attn``; ``mlp``; ``moe``). Graphs of modules *inside* a
  checkpointed region are fine: SCO's work runs before the region, outside the capture.
* Attention replay, whenever the attention kernel is captured: the whole iteration, whole
  layers, or the ``attn`` scope.

Read through :func:`megatron_flat.megatron.compat.cuda_graph_settings` (release-independent);
nothing here imports Megatron. ``install.check_against_megatron`` reports these with every
other problem before anything is built.
"""

from __future__ import annotations

from typing import Any, List, Optional

from megatron_flat.megatron import compat

__all__ = ["replay_graph_problems", "sco_graph_problems"]

# The scope a module SCO checkpoints (selective recompute) is captured in.
_SCOPE_OF = {"core_attn": "attn", "mlp": "mlp", "moe": "moe"}
_OFF = "turn CUDA graphs off (--cuda-graph-impl none)"


def _whole(config: Any) -> Optional[str]:
    """What the settings ask, when they capture the whole iteration or whole layers."""
    graphs = compat.cuda_graph_settings(config)
    if graphs.impl == "none":
        return None
    if graphs.impl == "full_iteration" or "full_iteration" in graphs.scopes:
        asked = ("--cuda-graph-impl full_iteration" if graphs.impl == "full_iteration" else
                 f"--cuda-graph-impl {graphs.impl} {graphs.scope_flag} full_iteration")
        return f"{asked} captures the whole training iteration"
    if not graphs.scopes:
        return (f"--cuda-graph-impl {graphs.impl} (no {graphs.scope_flag}) captures whole "
                "layers")
    if graphs.impl == "local" and "attn" in graphs.scopes:
        return (f"--cuda-graph-impl local {graphs.scope_flag} {' '.join(graphs.scopes)} "
                "captures whole layers (the local graphs wrap each layer with attention)")
    return None


def _checkpointed_modules(config: Any) -> List[str]:
    """The modules a selective recompute checkpoints one by one (none under full)."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return ["moe"] if getattr(config, "moe_layer_recompute", False) else []
    modules = getattr(config, "recompute_modules", None)
    return ["core_attn"] if modules is None else [str(m) for m in modules]


def sco_graph_problems(config: Any) -> List[str]:
    """Why ``--flat-sco`` cannot run under ``config``'s CUDA graphs; empty when it can."""
    whole = _whole(config)
    if whole is not None:
        return [f"--flat-sco: {whole}, SCO's checkpoint calls included: their copy-stream "
                "fork, host-pool offsets and event queries would be frozen at capture; "
                f"{_OFF}"]
    graphs = compat.cuda_graph_settings(config)
    if graphs.impl == "none":
        return []
    inside = [m for m in _checkpointed_modules(config) if _SCOPE_OF.get(m) in graphs.scopes]
    if not inside:
        return []
    scopes = " ".join(graphs.scopes)
    return [f"--flat-sco: --cuda-graph-impl {graphs.impl} {graphs.scope_flag} {scopes} "
            f"captures the recompute of {' and '.join(inside)} (--recompute-modules), SCO's "
            "checkpoint calls included: their copy-stream fork, host-pool offsets and event "
            "queries would be frozen at capture; capture only modules SCO does not "
            f"checkpoint, or {_OFF}"]


def replay_graph_problems(config: Any) -> List[str]:
    """Why ``--flat-attn-replay`` cannot run under ``config``'s CUDA graphs; empty when it
    can."""
    asked = _whole(config)
    if asked is None:
        graphs = compat.cuda_graph_settings(config)
        if graphs.impl == "none" or "attn" not in graphs.scopes:
            return []
        asked = (f"--cuda-graph-impl {graphs.impl} {graphs.scope_flag} "
                 f"{' '.join(graphs.scopes)} captures attention")
    return [f"--flat-attn-replay: {asked}: replay decides per call on the host whether the "
            "attention kernel runs or its kept output is used, which a graph would freeze at "
            f"capture; {_OFF}, or capture only modules other than attention"]
