"""The install-time half of attention replay: ``--flat-attn-replay`` wired in, and each
replay-capable core attention's store handed out at its first checkpointed call.

:func:`wire_attn_replay` (called by ``install()``) turns on the phase marks of
``megatron.checkpoint_phase`` and lets :func:`store_for` give every replay-capable core
attention its store at first use, its pairs in SCO's host pool (``attention.replay_host``:
SCO's budget, pool and side streams). What cannot replay exactly falls back to the stock
recompute with one warning: the whole run at install (:func:`fallback_reasons`), Megatron's
local ``DotProductAttention`` when it is built. Kept apart from
``megatron.attention_replay`` (which walks built models for attentions that declare
:data:`REPLAY_CAPABLE`) so a core attention can ask for its store without an import circle.
"""

from __future__ import annotations

import argparse
import threading
import warnings
from typing import Any, List, Optional

from megatron_flat.megatron.checkpoint_phase import FIRST_PASS, RERUN, disable, enable, phase
from megatron_flat.megatron.state import setting
from megatron_flat.runtime import patching

__all__ = ["REPLAY_CAPABLE", "WATCH", "current_store", "fallback_reasons", "recompute_problems",
           "replay_capable", "store_for", "unwire", "warn_fallback", "warn_once",
           "wire_attn_replay", "wired"]

# The capability a core attention class declares (``replay_capable = True``) when it keeps
# (O, LSE) in a checkpoint's first pass through :func:`current_store` and runs its re-run's
# backward from them. Declared, not inferred: replay must never guess that a kernel can.
REPLAY_CAPABLE = "replay_capable"

_lock = threading.Lock()
_wiring: dict = {}  # "on": wired; "host": the ReplayHost every store shares (_shared_host)
_warned: set = set()


def recompute_problems(megatron: Any) -> List[str]:
    """Why ``--flat-attn-replay`` has nothing to replay with ``megatron``'s recompute
    settings (only settings present are checked): it skips the attention kernel in full
    recompute's re-run, so it needs full recompute."""
    granularity = setting(megatron, "recompute_granularity", default="absent")
    if granularity == "absent" or granularity == "full":
        return []
    return [f"--flat-attn-replay replays full recompute's re-run of each layer: it needs "
            f"--recompute-granularity full (got {granularity!r})"]


def fallback_reasons(flat: Any, megatron: Any) -> List[str]:
    """Why replay cannot be exact (or has nowhere to keep) for this whole run; empty when
    it can. Each is a fallback to the stock recompute, not an error."""
    reasons = []
    if not (flat.sco and flat.sco_host_budget_bytes > 0):
        reasons.append("no host budget: the kept outputs live in SCO's host pool (turn on "
                       "--flat-sco with --flat-sco-host-budget-gib > 0)")
    if setting(megatron, "fp8") and setting(megatron, "fp8_dot_product_attention", default=False):
        reasons.append("fp8 attention: its output is rescaled per call, not replayable "
                       "bitwise")
    # Megatron-LM's arguments name the layer implementation (a TransformerConfig carries the
    # field too, but its model may be built from any spec: local layers say so when built).
    if (isinstance(megatron, argparse.Namespace)
            and setting(megatron, "transformer_impl") == "transformer_engine"):
        from megatron_flat.megatron import te_replay

        reason = te_replay.unsupported()
        if reason is not None:
            reasons.append(reason)
        # TE's kernel keeps its dropout's [seed, offset] beside the statistics: replayed
    elif (setting(megatron, "attention_dropout") or 0) > 0:
        reasons.append("attention dropout outside transformer-engine: the CPU flash kernel "
                       "has none to replay")
    return reasons


def wire_attn_replay(flat: Any, megatron: Any = None) -> bool:
    """``--flat-attn-replay``: the phase marks on, stores handed out at first use; or, when
    :func:`fallback_reasons` finds any, one warning and nothing changed. True when wired."""
    reasons = fallback_reasons(flat, megatron)
    if reasons:
        warn_fallback(reasons)
        return False
    enable()
    with _lock:
        _wiring.clear()
        _wiring["on"] = True
    _watch_local_attention()
    from megatron_flat.megatron import te_replay

    if te_replay.unsupported() is None:  # TE importable: its fused attention replays too
        te_replay.enable(current_store, warn_once)
    return True


def _watching(init: Any) -> Any:
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if wired() and not replay_capable(self):
            warn_once("local", f"megatron-flat: --flat-attn-replay: {type(self).__name__} "
                               "keeps no log-sum-exp to run its backward from a kept output; "
                               "its layers recompute attention as stock does")

    return __init__


# Megatron's local DotProductAttention built while replay is wired says once that it cannot
# replay (a subclass declaring the capability is quiet).
WATCH = patching.Patch(
    "megatron.core.transformer.dot_product_attention.DotProductAttention", "__init__",
    _watching, expects="DotProductAttention.__init__",
    why="--flat-attn-replay says once when a layer's core attention falls back to recompute")


def _watch_local_attention() -> None:
    patching.apply(WATCH)


def warn_fallback(reasons: List[str]) -> None:
    """The one warning of a run whose replay falls back to the stock recompute."""
    warnings.warn("megatron-flat: --flat-attn-replay is off for this run; the stock "
                  "recompute runs: " + "; ".join(reasons), stacklevel=4)


def wired() -> bool:
    return bool(_wiring.get("on"))


def unwire() -> None:
    """Undo :func:`wire_attn_replay` (stores already handed out stay with their modules)."""
    with _lock:
        _wiring.clear()
        _warned.clear()
    disable()
    from megatron_flat.megatron import te_replay

    te_replay.disable()
    patching.revert(WATCH)


def _shared_host():
    """The ReplayHost on SCO's mover, made once SCO's pool exists to share."""
    from megatron_flat.attention.replay_host import ReplayHost
    from megatron_flat.megatron import sco

    host = _wiring.get("host")
    if host is None:
        offload = sco.enabled()
        if offload is None:
            return None
        host = _wiring["host"] = ReplayHost(offload.mover)
    return host


def warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, stacklevel=4)


def replay_capable(module: Any) -> bool:
    """Whether ``module``'s class declares :data:`REPLAY_CAPABLE`."""
    return getattr(type(module), REPLAY_CAPABLE, False) is True


def current_store(attention: Any) -> Optional[Any]:
    """The store ``attention`` (a replay-capable core attention, or TE's) uses for the call
    now starting: only in a checkpoint's no-grad first pass or its grad-enabled re-run (a
    forward outside both runs the kernel and keeps nothing); None otherwise, or when it has
    none (``attach`` gives one, ``--flat-attn-replay`` at its first call)."""
    import torch

    now, grad = phase(), torch.is_grad_enabled()
    if not ((now == FIRST_PASS and not grad) or (now == RERUN and grad)):
        return None
    return store_for(attention)


def store_for(attention: Any) -> Optional[Any]:
    """``attention``'s store when replay is wired (made at its first call), else None."""
    if getattr(attention, "replay", None) is not None or not wired():
        return getattr(attention, "replay", None)
    from megatron_flat.attention.replay import ReplayStore

    host = _shared_host()
    if host is None:
        warn_once("host", "megatron-flat: --flat-attn-replay found no SCO pool; the stock "
                           "recompute runs")
        return None
    attention.replay = ReplayStore(host)
    return attention.replay
