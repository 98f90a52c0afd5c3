"""SCO behind the call shape of Megatron's ``tensor_parallel.checkpoint``.

``tensor_parallel_checkpoint(sco, ...)`` returns ``checkpoint(function,
distribute_saved_activations, *args)``, the signature Megatron-Core's
transformer block calls for ``recompute_granularity='full'`` (0.16.1:
``TransformerBlock._checkpointed_forward``; 0.19.2:
``megatron.core.recompute.checkpointed_forward``). It touches only arguments:
nothing here imports Megatron, the integration passes Megatron's pieces in.

- ``get_rng_tracker``: Megatron's ``tensor_parallel.random.get_cuda_rng_tracker``.
  Its named states (model-parallel dropout) are captured at forward and set
  for the recompute, then put back, as Megatron's ``CheckpointFunction`` does;
  the CPU and default device generators are handled by torch's checkpoint.
- ``offload_args``: positions of ``args`` that are boundaries. Megatron passes
  ``(hidden_states, attention_mask, context, context_mask, rotary_pos_emb...,
  padding_mask)``; only ``hidden_states`` (0) is a per-layer tensor, the rest
  are shared by every layer and kept by the caller, so offloading them would
  spend host budget and copies without freeing device memory.
- ``fallback``: Megatron's own ``tensor_parallel.checkpoint``, called as
  ``fallback(function, distribute_saved_activations, *args)`` for

  * ``distribute_saved_activations=True`` (SCO does not shard boundaries across
    tensor-parallel ranks; it offloads them whole); without a fallback it raises;
  * nested calls, made inside an SCO region's forward or recompute (MLP, MoE or
    attention recompute inside a fully recomputed layer). They must run the same
    way in the forward and in the recompute, whether or not the integration's
    patch of ``tensor_parallel.checkpoint`` is still in place during backward;
    the fallback gives that. Without one, nested calls run as plain
    non-reentrant checkpoint (consistent only when the patch stays in place).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

from megatron_flat.checkpoint.offload import SelectiveCheckpointOffload

__all__ = ["rng_tracker_context_fn", "tensor_parallel_checkpoint"]

_inside = threading.local()  # depth of SCO regions (forward or recompute) in this thread


@contextmanager
def _region(inner: ContextManager) -> Iterator[None]:
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        with inner:
            yield
    finally:
        _inside.depth -= 1


def rng_tracker_context_fn(get_rng_tracker: Callable[[], Any]) -> Callable[[], tuple]:
    """A ``context_fn`` that replays an RNG tracker's states in the recompute.

    The tracker needs ``get_states()`` (a snapshot) and ``set_states(states)``.
    """

    def context_fn() -> tuple:
        snapshot: dict = {}

        @contextmanager
        def forward() -> Iterator[None]:
            snapshot["states"] = get_rng_tracker().get_states()
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            tracker = get_rng_tracker()
            current = tracker.get_states()
            tracker.set_states(snapshot["states"])
            try:
                yield
            finally:
                tracker.set_states(current)

        return forward(), recompute()

    return context_fn


def tensor_parallel_checkpoint(
    sco: SelectiveCheckpointOffload,
    *,
    get_rng_tracker: Optional[Callable[[], Any]] = None,
    offload_args: Sequence[int] = (0,),
    fallback: Optional[Callable[..., Any]] = None,
    reentrant: bool = False,
) -> Callable[..., Any]:
    """``checkpoint(function, distribute_saved_activations, *args)`` routed through ``sco``.

    ``reentrant=True`` (needs ``fallback``): the region runs as ``fallback`` itself —
    Megatron's reentrant ``CheckpointFunction``, forward without grad, recompute and RNG
    replay its own — and SCO only moves the inputs it saves to the host pool and back.
    Its forward keeps nothing alive but those inputs, where torch's non-reentrant checkpoint
    builds the forward graph of Megatron's layers (module attributes hold parts of it until
    the next step). ``reentrant=False``: torch's non-reentrant checkpoint with the tracker's
    states replayed through ``context_fn``.
    """
    if reentrant and fallback is None:
        raise ValueError("the reentrant SCO checkpoint runs the fallback checkpoint; pass one")
    rng = rng_tracker_context_fn(get_rng_tracker) if get_rng_tracker else None
    positions = frozenset(offload_args)

    def context_fn() -> tuple:
        forward, recompute = rng() if rng is not None else (nullcontext(), nullcontext())
        return _region(forward), _region(recompute)

    def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
        if distribute_saved_activations and fallback is None:
            raise ValueError(
                "SCO offloads boundaries whole; distribute_saved_activations=True "
                "needs a fallback checkpoint"
            )
        nested = getattr(_inside, "depth", 0) > 0
        if fallback is not None and (distribute_saved_activations or nested):
            return fallback(function, distribute_saved_activations, *args)
        if reentrant:
            # Calls nested in this forward go to the fallback, as in its recompute (the
            # recompute runs in backward, outside the integration's routing).
            with _region(nullcontext()):
                return sco.run(function, args, offload_args=positions,
                               checkpoint_fn=lambda f, *a: fallback(f, False, *a))
        return sco.run(function, args, offload_args=positions, context_fn=context_fn)

    return checkpoint
