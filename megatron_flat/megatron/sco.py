"""SCO in Megatron-Core: the boundaries of full and of module recompute in host memory.

``enable(host_budget_bytes, prefetch)`` makes Megatron's recompute checkpoints run through a
:class:`~megatron_flat.checkpoint.SelectiveCheckpointOffload`; ``disable()`` puts Megatron
back exactly as it was. ``wire_sco(flat, megatron)`` is the ``install()`` entry for
``--flat-sco``. Two kinds of checkpoint are routed:

- **full recompute** (``recompute_granularity='full'``, methods ``uniform`` and ``block``, any
  ``recompute_num_layers``): one boundary per checkpointed layer (group), its
  ``hidden_states``;
- **module recompute** (``recompute_granularity='selective'`` with ``core_attn``, ``moe`` or
  ``mlp`` in ``recompute_modules``; 0.16's ``moe_layer_recompute``): one boundary per
  recomputed module, so two per layer for the usual MoE setting ``core_attn moe`` (the
  attention's query, key and value; the MoE layer's input). ``shared_experts`` is left to
  Megatron: its input is the MoE layer's input, which the router keeps on the device anyway.
  ``moe_act`` and ``layernorm`` are output-discarding checkpoints with no boundary of their
  own.

How it plugs in (release differences in ``compat.full_recompute_site`` and
``compat.module_recompute_sites``): each checkpoint call reads ``tensor_parallel.checkpoint``
from its own module's globals at call time (the block's full recompute: 0.16
``transformer_block`` in ``TransformerBlock._checkpointed_forward``, 0.19
``megatron.core.recompute`` in ``checkpointed_forward``; module recompute: ``attention``,
``moe.moe_layer``, ``transformer_layer`` and megatron-flat's ``megatron.moe``). Those module
globals are replaced by views of the real package whose ``checkpoint`` goes to SCO: in the
block's module *only while the transformer block's checkpointed forward runs* (a thread-local
set by a wrapper around ``TransformerBlock._checkpointed_forward`` in 0.16, around the name
``transformer_block.checkpointed_forward`` in 0.19); in the module-recompute modules always,
except inside ``MoELayer.shared_experts_compute``. Everything else in a view is the real
package, and every other user of ``tensor_parallel.checkpoint`` (MTP, the hybrid/Mamba block,
``CheckpointWithoutOutput``) reads the real package and never sees SCO. The fp8/fp4 path
(``te_checkpoint``) is not touched. A checkpoint nested in an SCO region (module recompute
inside a fully recomputed layer) runs as Megatron's own, in the forward and the recompute.

What SCO changes: only the per-layer boundary is offloaded (``hidden_states``; q, k and v
for ``core_attn``); masks and rotary tables are shared by every layer and stay where they
are. Each region still runs as Megatron's own reentrant ``CheckpointFunction`` — forward
without grad, recompute and RNG-tracker replay in backward — inside SCO's saved-tensor
hooks, so the boundary it saves waits in the host pool and comes back (prefetched) when its
backward starts; loss and gradients are bitwise those of plain recompute
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
``MoELayer.forward`` returns, and after each run of a ``moe`` module recompute's body
(forward and recompute), are detached (same values; the autograd graph, which is all
backward uses, is untouched), so a restored boundary is freed when its region's backward ends.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional

from megatron_flat.checkpoint import SelectiveCheckpointOffload, tensor_parallel_checkpoint
from megatron_flat.megatron import compat
from megatron_flat.runtime import patching

__all__ = ["disable", "enable", "enabled", "recompute_problems", "wire_sco"]

_DSA_MESSAGE = (
    "SCO (--flat-sco) offloads checkpoint boundaries whole to host memory; it cannot be "
    "combined with --distribute-saved-activations (distribute_saved_activations=True)"
)

_state = threading.local()  # .route: SCO's checkpoint while the block's checkpointed forward runs;
# .suppressed: inside a method whose checkpoint stays Megatron's (shared experts);
# .moe_layer: the MoELayer whose forward is running (its dispatcher state is detached)
_lock = threading.Lock()
_patch: Optional[dict] = None  # the SCO in force and its applied patches, for disable()


class _TensorParallelView:
    """``megatron.core.tensor_parallel`` as one calling module sees it: ``checkpoint`` goes to
    ``route_of()`` when that gives a route, else to the real package's."""

    def __init__(self, real: Any, route_of: Callable[[], Optional[Callable]]) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_route_of", route_of)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)

    def checkpoint(self, function: Callable, distribute_saved_activations: bool, *args: Any):
        route = self._route_of()
        if route is None:
            return self._real.checkpoint(function, distribute_saved_activations, *args)
        return route(function, distribute_saved_activations, *args)


def _block_route() -> Optional[Callable]:
    """SCO's checkpoint while the transformer block's checkpointed forward runs."""
    return getattr(_state, "route", None)


def _delimit(original: Callable, route: Optional[Callable], attr: str = "route") -> Callable:
    """``original`` with ``_state.<attr> = route`` in this thread for the duration of a call."""

    @functools.wraps(original)
    def delimited(*args: Any, **kwargs: Any) -> Any:
        previous = getattr(_state, attr, None)
        setattr(_state, attr, route)
        try:
            return original(*args, **kwargs)
        finally:
            setattr(_state, attr, previous)

    return delimited


def module_recompute_sites() -> tuple:
    """Megatron's module-recompute sites (``compat``) and FlatMoELayer's, which makes its
    ``moe`` recompute's checkpoint call from its own module like MoELayer does."""
    from megatron_flat.megatron import moe as flat_moe

    return compat.module_recompute_sites() + (
        compat.ModuleRecomputeSite(("moe",), flat_moe, (0,)),)


def _module_route_of(route: Callable) -> Callable[[], Optional[Callable]]:
    def route_of() -> Optional[Callable]:
        if getattr(_state, "suppressed", None) is not None:
            return None
        return route
    return route_of


def _detaching(function: Callable, layer: Any) -> Callable:
    """``function`` (an MoE layer's recomputed body) that detaches what ``layer``'s dispatcher
    keeps once it returns, in the forward and in the recompute alike (see the module doc)."""

    @functools.wraps(function)
    def run(*args: Any) -> Any:
        try:
            return function(*args)
        finally:
            _detach_dispatcher_state(layer)

    return run


def enable(host_budget_bytes: int, prefetch: int = 1, *,
           sco: Optional[SelectiveCheckpointOffload] = None) -> SelectiveCheckpointOffload:
    """Route the transformer block's full-recompute checkpoints, and the module recomputes
    ``core_attn``, ``moe`` and ``mlp`` of selective recompute, through SCO.

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

    def adapter_for(offload_args: tuple) -> Callable:
        adapter = tensor_parallel_checkpoint(
            sco,
            offload_args=offload_args,
            # Megatron's own checkpoint, looked up at call time (other patches compose).
            fallback=lambda *a: real_tp.checkpoint(*a),
            reentrant=True,
        )

        def route(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
            if distribute_saved_activations:
                raise ValueError(_DSA_MESSAGE)
            layer = getattr(_state, "moe_layer", None)
            if layer is not None:
                function = _detaching(function, layer)
            return adapter(function, distribute_saved_activations, *args)

        return route

    global _patch
    with _lock:
        _disable_locked()
        patches = _patches(adapter_for)
        done = []
        try:
            for patch in patches:
                patching.apply(patch)
                done.append(patch)
        except Exception:
            for patch in reversed(done):
                patching.revert(patch)
            raise
        _patch = dict(sco=sco, patches=done)
    return sco


_TENSOR_PARALLEL = "Megatron's tensor_parallel package (its checkpoint read at call time)"


def _is_tensor_parallel(value: Any) -> bool:
    return callable(getattr(value, "checkpoint", None))


def _patches(adapter_for: Callable[[tuple], Callable]) -> List[patching.Patch]:
    """SCO's declared patches, at the release's seams (``compat``): each recompute caller's
    ``tensor_parallel`` global becomes a view routing ``checkpoint`` to SCO; the block's
    checkpointed forward delimits when the block's view routes; the shared experts' compute
    suppresses the module route; ``MoELayer.forward`` detaches its dispatcher's kept
    tensors."""
    caller, owner, name = compat.full_recompute_site()
    patches = [patching.Patch(
        caller.__name__, "tensor_parallel",
        lambda real: _TensorParallelView(real, _block_route), expects=_TENSOR_PARALLEL,
        check=_is_tensor_parallel,
        why="SCO takes the block's full-recompute checkpoints while its checkpointed "
            "forward runs")]
    for site in module_recompute_sites():
        route_of = _module_route_of(adapter_for(site.offload_args))
        patches.append(patching.Patch(
            site.caller.__name__, "tensor_parallel",
            lambda real, route_of=route_of: _TensorParallelView(real, route_of),
            expects=_TENSOR_PARALLEL, check=_is_tensor_parallel,
            why=f"SCO takes the module recompute {'/'.join(site.modules)}'s checkpoints"))
    shared_owner, shared_name = compat.shared_experts_site()
    return patches + [
        patching.Patch(patching.path_of(owner), name,
                       lambda f: _delimit(f, adapter_for((0,))),
                       expects="the transformer block's checkpointed forward",
                       why="SCO routes the block's checkpoints only while it runs"),
        patching.Patch(patching.path_of(shared_owner), shared_name,
                       lambda f: _delimit(f, True, attr="suppressed"),
                       expects="the MoE layer's shared-experts compute",
                       why="the shared experts' checkpoint stays Megatron's (its input is "
                           "the MoE layer's, kept on the device anyway)"),
        patching.Patch("megatron.core.transformer.moe.moe_layer.MoELayer", "forward",
                       _moe_forward, expects="MoELayer.forward",
                       why="the dispatcher's kept router tensors would hold a restored "
                           "boundary on the device until the layer's next forward"),
    ]


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


def _moe_forward(stock: Callable) -> Callable:
    """``MoELayer.forward`` that detaches the dispatcher's kept tensors afterwards (and makes
    the layer known to a module recompute made inside)."""

    @functools.wraps(stock)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(_state, "moe_layer", None)
        _state.moe_layer = self
        try:
            return stock(self, *args, **kwargs)
        finally:
            _state.moe_layer = previous
            _detach_dispatcher_state(self)

    return forward


def _disable_locked() -> None:
    global _patch
    if _patch is None:
        return
    p, _patch = _patch, None
    for patch in reversed(p["patches"]):
        patching.revert(patch)


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled): Megatron's own objects are back."""
    with _lock:
        _disable_locked()


def enabled() -> Optional[SelectiveCheckpointOffload]:
    """The SCO in force, or None."""
    return None if _patch is None else _patch["sco"]


def recompute_problems(megatron: Any) -> List[str]:
    """Why ``megatron``'s recompute settings (Megatron-LM args or a TransformerConfig) leave
    SCO no boundary to offload; empty when they have some.

    SCO offloads the boundaries of full recompute and of the module recomputes ``core_attn``,
    ``moe`` and ``mlp`` (``recompute_modules`` unset means Megatron's default,
    ``core_attn``; 0.16's deprecated ``moe_layer_recompute`` means ``moe``).
    """
    granularity = getattr(megatron, "recompute_granularity", None)
    if granularity == "full" or getattr(megatron, "moe_layer_recompute", False):
        return []
    wanted = " ".join(compat.SCO_MODULES)
    if granularity == "selective":
        modules = getattr(megatron, "recompute_modules", None)
        modules = ["core_attn"] if modules is None else list(modules)
        if set(modules) & set(compat.SCO_MODULES):
            return []
        return [f"--flat-sco offloads the boundaries of full recompute or of the module "
                f"recomputes {wanted}; --recompute-modules {' '.join(modules) or '(none)'} "
                "checkpoints none of them"]
    return ["--flat-sco offloads checkpoint boundaries: it needs --recompute-granularity full, "
            f"or selective with --recompute-modules naming one of {wanted} "
            f"(got {granularity!r})"]


def wire_sco(flat: Any, megatron: Any = None) -> None:
    """``install()`` wiring for ``--flat-sco``: enable SCO with the FlatConfig's host budget
    (``sco_host_budget_bytes``) and prefetch distance (``sco_prefetch``).

    ``megatron`` (Megatron-LM args or a TransformerConfig), when given, is checked: SCO
    refuses ``distribute_saved_activations``. (The recompute settings are checked by
    ``install.check_against_megatron`` through :func:`recompute_problems`.)
    """
    if megatron is not None and getattr(megatron, "distribute_saved_activations", False):
        from megatron_flat.megatron.state import FlatConfigError

        raise FlatConfigError(f"megatron-flat cannot be installed:\n  - {_DSA_MESSAGE}")
    enable(flat.sco_host_budget_bytes, flat.sco_prefetch)
