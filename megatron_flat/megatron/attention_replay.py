"""Attention replay in Megatron-Core: each core attention that can replay gets a store.

Two ways in:

- ``install()`` with ``--flat-attn-replay`` (``megatron.replay_wiring``): every
  replay-capable core attention the model builds gets its store at its first checkpointed
  forward, its pairs in SCO's host pool; what cannot replay exactly falls back to the stock
  recompute with one warning (a core attention that cannot replay says so when built).
- :func:`attach` gives every replay-capable core attention of a built model a store at once
  (tests and scripts that build models themselves), on the device or in a given host tier.

A replay-capable attention (one whose class declares ``replay_capable = True``, as the CPU
backend's flash attention does; transformer-engine's ``DotProductAttention`` through
``megatron.te_replay``)
keeps (O, LSE) in a checkpoint's first pass and returns them in its re-run
(``attention.replay``). A no-grad forward outside a checkpoint (evaluation) keeps nothing;
a forward with autograd outside a re-run (no recompute) runs stock. Megatron's local
``DotProductAttention`` cannot replay: it keeps no log-sum-exp to run a backward from.
"""

from __future__ import annotations

from typing import Any, List

from megatron_flat.megatron.checkpoint_phase import disable as _disable_phase_marks
from megatron_flat.megatron.checkpoint_phase import (
    FIRST_PASS,
    RERUN,
    enable,
    enabled,
    phase,
)
__all__ = ["FIRST_PASS", "RERUN", "attach", "detach", "disable", "enable",
           "enabled", "phase"]


def _replayable(model: Any) -> List[Any]:
    """The core attentions in ``model`` (a module or a list of model chunks) that can
    replay."""
    from megatron_flat.megatron import te_replay
    from megatron_flat.megatron.replay_wiring import replay_capable

    chunks = model if isinstance(model, (list, tuple)) else [model]
    ours = [m for chunk in chunks for m in chunk.modules() if replay_capable(m)]
    return ours + (te_replay.attentions(model) if te_replay.kernel_module() else [])


def attach(model: Any, host: Any = None) -> List[Any]:
    """Give every replay-capable core attention in ``model`` (a module or a list of model
    chunks) a fresh ``ReplayStore`` (its pairs in ``host``, a shared ``ReplayHost``; None:
    on the device) and :func:`enable` the phase marks; returns the attentions.
    ``ValueError`` when the model has none (its core attention cannot replay: Megatron's
    local ``DotProductAttention`` keeps no log-sum-exp to run a backward from)."""
    from megatron_flat.attention.replay import ReplayStore

    from megatron_flat.megatron import te_replay

    found = _replayable(model)
    if not found:
        raise ValueError("attention replay needs a core attention that can run its backward "
                         "from a kept output (the CPU flash attention, transformer-engine's "
                         "fused attention); this model has none")
    enable()
    te = te_replay.attention_class()
    if te is not None and any(isinstance(a, te) for a in found):
        from megatron_flat.megatron.replay_wiring import current_store, warn_once

        te_replay.enable(current_store, warn_once)
    for attention in found:
        attention.replay = ReplayStore(host)
    return found


def detach(model: Any) -> None:
    """Drop the stores :func:`attach` gave (the phase marks stay: they are inert)."""
    for attention in _replayable(model):
        attention.replay = None


def disable() -> None:
    """The phase marks off and transformer-engine's kernel its own again (process-wide)."""
    from megatron_flat.megatron import te_replay

    _disable_phase_marks()
    te_replay.disable()
