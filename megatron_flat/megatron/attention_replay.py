"""Attention replay in Megatron-Core: telling a checkpoint's first pass from its re-run.

Megatron's full recompute (and SCO's regions) run each layer through
``tensor_parallel.random.CheckpointFunction`` (both releases): ``forward`` runs the layer
under ``torch.no_grad()`` (the first pass), ``backward`` re-runs it under
``torch.enable_grad()`` (the re-run) and back-propagates. :func:`enable` wraps both, once
per process, so that :func:`phase` says which of the two the current call is in (the
innermost one, per thread); nothing else changes. Autograd looks both up on the class at
call time, so every checkpoint sees the wrappers; :func:`disable` restores Megatron's.

:func:`attach` gives every core attention of a model that supports replay
(``testing.flash_attention.FlashCoreAttention``: torch's CPU flash kernel) its own
:class:`~megatron_flat.attention.replay.ReplayStore`; such an attention keeps (O, LSE) in a
first pass and returns them in the re-run (``attention.replay``). A no-grad forward outside
a checkpoint (evaluation) keeps nothing; a forward with autograd outside a re-run (no
recompute) runs stock.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, List, Optional

__all__ = ["FIRST_PASS", "RERUN", "attach", "detach", "disable", "enable", "enabled", "phase"]

FIRST_PASS, RERUN = "first pass", "re-run"
_state = threading.local()
_lock = threading.Lock()


def _checkpoint_function() -> Any:
    from megatron.core.tensor_parallel.random import CheckpointFunction

    return CheckpointFunction


def phase() -> Optional[str]:
    """``FIRST_PASS`` or ``RERUN`` for the innermost checkpoint this thread is running, or
    None outside one (or when :func:`enable` was not called)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def _in(name: str, fn, *args):
    stack = _state.__dict__.setdefault("stack", [])
    stack.append(name)
    try:
        return fn(*args)
    finally:
        stack.pop()


def _mine(fn: Any) -> bool:
    # functools.wraps copies a wrapped function's attributes into its wrapper, so another
    # wrapper put on ours carries our marks too: ours is the one whose mark is itself.
    return getattr(fn, "__flat_replay_wrapper__", None) is fn


def enabled() -> bool:
    return _mine(_checkpoint_function().forward)


def enable() -> None:
    """Wrap ``CheckpointFunction.forward`` / ``backward`` to mark their phase. Idempotent;
    composes with other wrappers of ``backward`` (``megatron.regions``), put on before or
    after."""
    with _lock:
        cls = _checkpoint_function()
        if _mine(cls.forward):
            return
        forward, backward = cls.forward, cls.backward

        @functools.wraps(forward)
        def wrapped_forward(ctx, *args):
            return _in(FIRST_PASS, forward, ctx, *args)

        @functools.wraps(backward)
        def wrapped_backward(ctx, *args):
            return _in(RERUN, backward, ctx, *args)

        for wrapper, original in ((wrapped_forward, forward), (wrapped_backward, backward)):
            wrapper.__flat_replay_original__ = original
            wrapper.__flat_replay_wrapper__ = wrapper
        cls.forward = staticmethod(wrapped_forward)
        cls.backward = staticmethod(wrapped_backward)


def disable() -> None:
    """Undo :func:`enable` where our wrapper is outermost (no-op when not enabled). A
    ``backward`` wrapped again after :func:`enable` keeps our (inert) mark inside it."""
    with _lock:
        cls = _checkpoint_function()
        for name in ("forward", "backward"):
            fn = getattr(cls, name)
            if _mine(fn):
                setattr(cls, name, staticmethod(fn.__flat_replay_original__))


def attach(model: Any) -> List[Any]:
    """Give every replay-capable core attention in ``model`` (a module or a list of model
    chunks) a fresh ``ReplayStore`` and :func:`enable` the phase marks; returns the
    attentions. ``ValueError`` when the model has none (its core attention cannot replay:
    Megatron's local ``DotProductAttention`` keeps no log-sum-exp to run a backward from)."""
    from megatron_flat.attention.replay import ReplayStore
    from megatron_flat.testing.flash_attention import FlashCoreAttention

    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = [m for chunk in chunks for m in chunk.modules() if isinstance(m, FlashCoreAttention)]
    if not found:
        raise ValueError("attention replay needs a core attention that can run its backward "
                         "from a kept output (the CPU flash attention); this model has none")
    enable()
    for attention in found:
        attention.replay = ReplayStore()
    return found


def detach(model: Any) -> None:
    """Drop the stores :func:`attach` gave (the phase marks stay: they are inert)."""
    from megatron_flat.testing.flash_attention import FlashCoreAttention

    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, FlashCoreAttention):
                m.replay = None
