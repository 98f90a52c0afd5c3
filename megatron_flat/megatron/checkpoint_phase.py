"""Which half of Megatron's reentrant checkpoint is running: its first pass or its re-run.

Megatron's full recompute (and SCO's regions) run each layer through
``tensor_parallel.random.CheckpointFunction`` (both releases): ``forward`` runs the layer
under ``torch.no_grad()`` (the first pass), ``backward`` re-runs it under
``torch.enable_grad()`` (the re-run) and back-propagates. :func:`enable` adds a hook to both
halves (``megatron.checkpoint_hooks``, the one wrapper of that function) so that
:func:`phase` says which of the two the current call is in (the innermost one, per thread);
nothing else changes. :func:`disable` removes the hook.
Attention replay (``megatron.attention_replay``) keeps in the first pass and replays in the
re-run.
"""


from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from megatron_flat.megatron import checkpoint_hooks

__all__ = ["FIRST_PASS", "RERUN", "disable", "enable", "enabled", "phase"]

FIRST_PASS, RERUN = "first pass", "re-run"
HOOK = "attention replay: phase marks"
_state = threading.local()


def phase() -> Optional[str]:
    """``FIRST_PASS`` or ``RERUN`` for the innermost checkpoint this thread is running, or
    None outside one (or when :func:`enable` was not called)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _marked(name: str) -> Iterator[None]:
    stack = _state.__dict__.setdefault("stack", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def enabled() -> bool:
    return checkpoint_hooks.active(HOOK)


def enable() -> None:
    """Mark each checkpoint's halves. Idempotent; composes with the other hooks
    (``megatron.regions``), added before or after."""
    checkpoint_hooks.add(HOOK, forward=lambda ctx: _marked(FIRST_PASS),
                         backward=lambda ctx: _marked(RERUN))


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled)."""
    checkpoint_hooks.remove(HOOK)
