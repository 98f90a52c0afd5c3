"""Megatron's reentrant checkpoint, wrapped once, with named hooks around its two halves.

Megatron's full recompute, its module recompute and SCO's regions all run a layer through
``tensor_parallel.random.CheckpointFunction`` (both releases): ``forward`` runs it under
``torch.no_grad()`` (the first pass), ``backward`` re-runs it under ``torch.enable_grad()``
and back-propagates (the re-run). Two techniques need to act there: attention replay marks
which half is running (``megatron.checkpoint_phase``) and graph-only recompute makes the
re-run a recompute region (``megatron.regions``).

Each registers a hook with :func:`add`: a function of the autograd ``ctx`` returning a context
manager entered around that half (hooks run in the order added). The two declared patches
(``PATCHES``) are applied when the first hook arrives and reverted when the last leaves, so
with no hook Megatron's functions are its own. Autograd looks ``forward``/``backward`` up on the
class at call time, so every checkpoint sees the wrappers.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, ContextManager, Dict, Optional

from megatron_flat.runtime import patching

__all__ = ["FORWARD", "BACKWARD", "PATCHES", "active", "add", "remove"]

FORWARD, BACKWARD = "forward", "backward"
Hook = Callable[[Any], ContextManager[Any]]

_lock = threading.RLock()
_hooks: Dict[str, Dict[str, Hook]] = {FORWARD: {}, BACKWARD: {}}


def _around(half: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of one half: the current hooks, entered in order, around Megatron's."""

    def wrap(megatrons: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(megatrons)
        def run(ctx: Any, *args: Any) -> Any:
            hooks = list(_hooks[half].values())
            if not hooks:
                return megatrons(ctx, *args)
            with contextlib.ExitStack() as stack:
                for hook in hooks:
                    stack.enter_context(hook(ctx))
                return megatrons(ctx, *args)

        return run

    return wrap


_OWNER = "megatron.core.tensor_parallel.random.CheckpointFunction"
PATCHES = tuple(
    patching.Patch(_OWNER, half, _around(half), static=True,
                   expects=f"the reentrant checkpoint's {half}(ctx, ...)",
                   why="attention replay and graph-only recompute act on each half of a "
                       "checkpoint (megatron.checkpoint_hooks)")
    for half in (FORWARD, BACKWARD))


def add(name: str, *, forward: Optional[Hook] = None, backward: Optional[Hook] = None) -> None:
    """Register hook ``name`` (re-adding replaces it in place). The patches go in with the
    first hook."""
    with _lock:
        for half, hook in ((FORWARD, forward), (BACKWARD, backward)):
            if hook is not None:
                _hooks[half][name] = hook
        for patch in PATCHES:
            patching.apply(patch)


def remove(name: str) -> None:
    """Drop hook ``name`` (no-op when absent); with the last hook gone the patches come out
    (a patch wrapped again by someone else since stays, inert)."""
    with _lock:
        for hooks in _hooks.values():
            hooks.pop(name, None)
        if not any(_hooks.values()):
            for patch in PATCHES:
                patching.revert(patch)


def active(name: str) -> bool:
    """Whether hook ``name`` is registered and the checkpoint is wrapped."""
    with _lock:
        return (any(name in hooks for hooks in _hooks.values())
                and all(patching.is_applied(p) for p in PATCHES))
