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

``enable()`` adds a hook to that ``backward`` (``megatron.checkpoint_hooks``, the one
wrapper of that function) so the re-run runs inside
:func:`~megatron_flat.dispatch.recompute.recompute_region`; nothing else changes (outputs,
RNG replay and gradients are Megatron's). ``disable()`` removes the hook. TE's fp8 checkpoint (``te_checkpoint``) is not wrapped: its re-runs keep values.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from megatron_flat.dispatch.recompute import windowed
from megatron_flat.megatron import checkpoint_hooks

__all__ = ["disable", "enable", "enabled"]

HOOK = "graph-only recompute: recompute regions"


@contextlib.contextmanager
def _in_region(ctx: Any) -> Iterator[None]:
    ctx.run_function = windowed(ctx.run_function)
    yield


def enabled() -> bool:
    """Whether Megatron's reentrant checkpoint opens recompute regions."""
    return checkpoint_hooks.active(HOOK)


def enable() -> None:
    """Make Megatron's reentrant checkpoint re-run its function in a recompute region.
    Idempotent."""
    checkpoint_hooks.add(HOOK, backward=_in_region)


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled)."""
    checkpoint_hooks.remove(HOOK)
