"""SCO in Megatron-Core: the boundaries of ``recompute_granularity='full'`` in host memory.

``enable(host_budget_bytes, prefetch)`` makes the transformer block's full-recompute
checkpoints (methods ``uniform`` and ``block``, any ``recompute_num_layers``) run through a
:class:`~megatron_flat.checkpoint.SelectiveCheckpointOffload`; ``disable()`` puts Megatron
back exactly as it was. ``wire_sco(flat, megatron)`` is the ``install()`` entry for
``--flat-sco``.

How it plugs in (release differences in ``compat.full_recompute_site``): the block's
checkpoint call reads ``tensor_parallel.checkpoint`` from its own module's globals at call
time (0.16: ``transformer_block`` in ``TransformerBlock._checkpointed_forward``; 0.19:
``megatron.core.recompute`` in ``checkpointed_forward``). That one module global
``tensor_parallel`` is replaced by a view of the real package whose ``checkpoint`` goes to
SCO *only while the transformer block's checkpointed forward runs* (a thread-local set by a
wrapper around ``TransformerBlock._checkpointed_forward`` in 0.16, around the name
``transformer_block.checkpointed_forward`` in 0.19); everything else in the view is the
real package. Nothing else changes: MLP/MoE/attention recompute, ``CheckpointWithoutOutput``
and other users of ``tensor_parallel.checkpoint`` read the real package and never see SCO
(in 0.19 the hybrid/Mamba block, which shares ``checkpointed_forward``, is not wrapped, so
its calls go to Megatron's checkpoint too). The fp8/fp4 path (``te_checkpoint``) is not
touched.

What SCO changes: only ``hidden_states`` (argument 0, the per-layer boundary) is offloaded;
masks and rotary tables are shared by every layer and stay where they are. Each layer (or
group of layers) still runs as Megatron's own reentrant ``CheckpointFunction`` — forward
without grad, recompute and RNG-tracker replay in backward — inside SCO's saved-tensor
hooks, so the boundary it saves waits in the host pool and comes back (prefetched) when its
backward starts; loss and gradients are bitwise those of plain full recompute
(tests/checkpoint/test_megatron_sco*.py). Megatron's reentrant region matters: under torch's
non-reentrant checkpoint the forward builds the layers' autograd graph, and Megatron's
modules keep references into it (attention and MoE intermediates stayed alive after
backward and the step peak rose). ``distribute_saved_activations=True`` is refused: SCO
offloads boundaries whole instead of sharding them over TP ranks.

One more reference into a region's graph matters for SCO: Megatron's MoE token dispatcher
keeps the router probabilities of the layer's latest forward on itself (``self.probs``, with
their autograd graph), which reaches back to the layer's recompute input — the boundary SCO
restored — and keeps it on the device until that layer's next forward: one restored
boundary per MoE layer piled up in backward (6 on the device at once in the 4-layer test, the
bound is prefetch + 1). While SCO is enabled, tensors a dispatcher keeps after
``MoELayer.forward`` returns are detached (same values; the autograd graph, which is all
backward uses, is untouched), so a restored boundary is freed when its region's backward ends.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

from megatron_flat.checkpoint import SelectiveCheckpointOffload, tensor_parallel_checkpoint
from megatron_flat.megatron import compat

__all__ = ["disable", "enable", "enabled", "wire_sco"]

_DSA_MESSAGE = (
    "SCO (--flat-sco) offloads checkpoint boundaries whole to host memory; it cannot be "
    "combined with --distribute-saved-activations (distribute_saved_activations=True)"
)

_state = threading.local()  # .route: SCO's checkpoint while the block's checkpointed forward runs
_lock = threading.Lock()
_patch: Optional[dict] = None  # what enable() changed, for disable()


class _TensorParallelView:
    """``megatron.core.tensor_parallel`` as the block's checkpoint call sees it."""

    def __init__(self, real: Any) -> None:
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)

    def checkpoint(self, function: Callable, distribute_saved_activations: bool, *args: Any):
        route = getattr(_state, "route", None)
        if route is None:  # not inside the transformer block's checkpointed forward
            return self._real.checkpoint(function, distribute_saved_activations, *args)
        return route(function, distribute_saved_activations, *args)


def _delimit(original: Callable, route: Callable) -> Callable:
    """``original`` with ``route`` active in this thread for the duration of a call."""

    @functools.wraps(original)
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        previous = getattr(_state, "route", None)
        _state.route = route
        try:
            return original(*args, **kwargs)
        finally:
            _state.route = previous

    checkpointed_forward.__flat_sco_original__ = original
    return checkpointed_forward


def enable(host_budget_bytes: int, prefetch: int = 1, *,
           sco: Optional[SelectiveCheckpointOffload] = None) -> SelectiveCheckpointOffload:
    """Route the transformer block's full-recompute checkpoints through SCO.

    ``host_budget_bytes``/``prefetch`` build the :class:`SelectiveCheckpointOffload`, whose
    host pool comes from the process's host tier (``runtime.host_tier``): declared and checked
    against the node now, allocated (pinned, exactly that size) at the first offload, so
    enabling touches no device; or pass a ready ``sco`` (then ``host_budget_bytes`` is
    ignored). Enabling again replaces the previous SCO. Returns the SCO in force (its
    ``stats`` count the offloaded boundaries).
    """
    import megatron.core.tensor_parallel as real_tp

    compat.check_supported()
    if sco is None:
        from megatron_flat.runtime import host_tier

        pool = host_tier.tier().lazy_pool("sco", int(host_budget_bytes))
        sco = SelectiveCheckpointOffload(None, prefetch=prefetch, pool=pool)
    adapter = tensor_parallel_checkpoint(
        sco,
        offload_args=(0,),
        # Megatron's own checkpoint, looked up at call time (other patches compose).
        fallback=lambda *a: real_tp.checkpoint(*a),
        reentrant=True,
    )

    def route(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
        if distribute_saved_activations:
            raise ValueError(_DSA_MESSAGE)
        return adapter(function, distribute_saved_activations, *args)

    with _lock:
        _disable_locked()
        caller, owner, name = compat.full_recompute_site()
        global _patch
        _patch = dict(
            caller=caller, tp_global=caller.__dict__["tensor_parallel"],
            owner=owner, name=name, had_own=name in vars(owner), original=getattr(owner, name),
            sco=sco, moe=_patch_moe_forward(),
        )
        caller.tensor_parallel = _TensorParallelView(_patch["tp_global"])
        setattr(owner, name, _delimit(_patch["original"], route))
    return sco


def _detach_dispatcher_state(layer: Any) -> None:
    """Detach the tensors ``layer``'s token dispatcher keeps after its forward (values kept;
    only their autograd graph goes, which backward reaches through the layer's output)."""
    import torch

    dispatcher = getattr(layer, "token_dispatcher", None)
    state = getattr(dispatcher, "__dict__", None)
    if not state:
        return
    for name, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            state[name] = value.detach()


def _patch_moe_forward() -> Optional[tuple]:
    """Wrap ``MoELayer.forward`` so the dispatcher's kept tensors are detached afterwards;
    returns what to restore."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    stock = MoELayer.__dict__.get("forward")
    if stock is None or getattr(stock, "__flat_sco__", False):
        return None

    @functools.wraps(stock)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return stock(self, *args, **kwargs)
        finally:
            _detach_dispatcher_state(self)

    forward.__flat_sco__ = True
    MoELayer.forward = forward
    return (MoELayer, stock)


def _disable_locked() -> None:
    global _patch
    if _patch is None:
        return
    p, _patch = _patch, None
    if p.get("moe") is not None:
        owner, stock = p["moe"]
        owner.forward = stock
    p["caller"].tensor_parallel = p["tp_global"]
    if p["had_own"]:
        setattr(p["owner"], p["name"], p["original"])
    else:
        delattr(p["owner"], p["name"])


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled): Megatron's own objects are back."""
    with _lock:
        _disable_locked()


def enabled() -> Optional[SelectiveCheckpointOffload]:
    """The SCO in force, or None."""
    return None if _patch is None else _patch["sco"]


def wire_sco(flat: Any, megatron: Any = None) -> None:
    """``install()`` wiring for ``--flat-sco``: enable SCO with the FlatConfig's host budget
    (``sco_host_budget_bytes``) and prefetch distance (``sco_prefetch``).

    ``megatron`` (Megatron-LM args or a TransformerConfig), when given, is checked: SCO
    refuses ``distribute_saved_activations``. (``recompute_granularity='full'`` is checked by
    ``install.check_against_megatron``.)
    """
    if megatron is not None and getattr(megatron, "distribute_saved_activations", False):
        from megatron_flat.megatron.install import FlatConfigError

        raise FlatConfigError(f"megatron-flat cannot be installed:\n  - {_DSA_MESSAGE}")
    enable(flat.sco_host_budget_bytes, flat.sco_prefetch)
