"""Which half of Megatron's reentrant checkpoint is running: its first pass or its re-run.

Megatron's full recompute (and SCO's regions) run each layer through
``tensor_parallel.random.CheckpointFunction`` (both releases): ``forward`` runs the layer
under ``torch.no_grad()`` (the first pass), ``backward`` re-runs it under
``torch.enable_grad()`` (the re-run) and back-propagates. :func:`enable` wraps both, once
per process, so that :func:`phase` says which of the two the current call is in (the
innermost one, per thread); nothing else changes. Autograd looks both up on the class at
call time, so every checkpoint sees the wrappers; :func:`disable` restores Megatron's.
Attention replay (``megatron.attention_replay``) keeps in the first pass and replays in the
re-run.
"""


from __future__ import annotations

import functools
import threading
from typing import Any, Optional

__all__ = ["FIRST_PASS", "RERUN", "disable", "enable", "enabled", "phase"]

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
