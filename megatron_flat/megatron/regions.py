"""Megatron's reentrant checkpoint re-runs its region inside a recompute region.

Graph-only recompute (:mod:`megatron_flat.dispatch.recompute`) needs to know when a forward
is the re-run of a checkpointed region whose outputs are only back-propagated through. In
Megatron-Core that is ``tensor_parallel.random.CheckpointFunction.backward`` (both releases):
it re-runs ``ctx.run_function`` on detached inputs under ``torch.enable_grad()`` and calls
``torch.autograd.backward(outputs, grads)``. Every Megatron recompute that rebuilds a whole
MoE layer goes through it: the transformer block's full recompute (0.16:
``TransformerBlock._checkpointed_forward``; 0.19: ``megatron.core.recompute``), MoE-module
recompute (``--moe-layer-recompute``, 0.19's ``--recompute-modules moe``), the MTP layers'
recompute, and SCO, whose reentrant path is this same function.

``enable()`` wraps that ``backward`` once per process so the re-run runs inside
:func:`~megatron_flat.dispatch.recompute.recompute_region`; nothing else changes (outputs,
RNG replay and gradients are Megatron's). Autograd looks ``backward`` up on the class at call
time, so the wrapper takes effect for every checkpoint. ``disable()`` restores Megatron's
function. TE's fp8 checkpoint (``te_checkpoint``) is not wrapped: its re-runs keep values.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from megatron_flat.dispatch.recompute import windowed

__all__ = ["disable", "enable", "enabled"]

_lock = threading.Lock()


def _checkpoint_function() -> Any:
    from megatron.core.tensor_parallel.random import CheckpointFunction

    return CheckpointFunction


def enabled() -> bool:
    """Whether Megatron's reentrant checkpoint opens recompute regions."""
    return hasattr(_checkpoint_function().backward, "__flat_original__")


def enable() -> None:
    """Make Megatron's reentrant checkpoint re-run its function in a recompute region.
    Idempotent."""
    with _lock:
        cls = _checkpoint_function()
        original = cls.backward
        if hasattr(original, "__flat_original__"):
            return

        @functools.wraps(original)
        def backward(ctx, *args):
            ctx.run_function = windowed(ctx.run_function)
            return original(ctx, *args)

        backward.__flat_original__ = original
        cls.backward = staticmethod(backward)


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled)."""
    with _lock:
        cls = _checkpoint_function()
        original = getattr(cls.backward, "__flat_original__", None)
        if original is not None:
            cls.backward = staticmethod(original)
