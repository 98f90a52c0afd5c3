"""Letting go of a model: :func:`release`.

Megatron's ``DistributedDataParallel`` registers a hook on each parameter's gradient
accumulator whose closure holds the wrapper, and with it the model. The accumulators are
C++ autograd nodes, kept alive by the wrapper's ``grad_accs`` and by every autograd graph a
module still holds (the MoE dispatcher keeps its routing probabilities); Python's cyclic
collector cannot see through them, so a model wrapped in DDP outlives every reference to
it, stock or flat, with every device buffer and pinned host buffer it made. Anything that
builds more than one model in a process (reinforcement learning that rebuilds the policy,
evaluation loops, notebooks, test sessions) keeps them all.

:func:`release` cuts those cycles and gives back what megatron-flat holds for the model:

* each DDP chunk: the Python hooks on its gradient accumulators are removed and its
  accumulator list emptied, its forward pre-hooks (``--overlap-param-gather``) removed;
* param offload: the experts' gradient hooks removed, their host-tier weights and gradients
  and device slots given back (``ParamOffload.close``);
* each OffloadStreamAdamW (inner optimizers, ParamOffloadOptimizer's included): its host
  state and staging slots given back (``OffloadStreamAdamW.close``); the experts' pieces
  dropped;
* methods of the model's module classes cached with ``functools.lru_cache`` (Megatron's
  ``RotaryEmbedding.forward``): emptied, since such a cache keys on the module itself.

After it, once the caller drops its own references (``del model, optimizer``),
``gc.collect()`` frees the model, its DDP wrappers and the optimizer. A released model must
not be used again (its backward no longer reaches DDP, its offloaded experts have no
weights). Megatron-flat's process-wide pieces (``install()``'s patches, SCO's host pool,
the host tier's node budget) are not the model's and stay.
"""

from __future__ import annotations

from typing import Iterable, List, Union

import torch

__all__ = ["release"]


def release(model_chunks: Union[torch.nn.Module, Iterable[torch.nn.Module]],
            optimizer=None) -> None:
    """Release ``model_chunks`` (Megatron's model list: DDP-wrapped chunks, or a single
    module) and ``optimizer`` (Megatron's, chained or not; optional) so that they can be
    freed (module docstring). Idempotent."""
    chunks: List[torch.nn.Module] = ([model_chunks] if isinstance(model_chunks, torch.nn.Module)
                                     else list(model_chunks))
    if optimizer is not None:
        for sub in _sub_optimizers(optimizer):
            _release_optimizer(sub)
    for chunk in chunks:
        _release_chunk(chunk)


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _release_optimizer(sub) -> None:
    from megatron_flat.optim.offload_adamw import OffloadStreamAdamW

    inner = getattr(sub, "optimizer", None)
    if isinstance(inner, OffloadStreamAdamW):
        inner.close()
    shards = getattr(sub, "shards", None)
    if shards is not None:  # param offload's pieces view the host tier
        sub.shards = None


def _release_chunk(chunk: torch.nn.Module) -> None:
    for node in getattr(chunk, "grad_accs", None) or ():
        clear_node_hooks(node)
    if isinstance(getattr(chunk, "grad_accs", None), list):
        chunk.grad_accs.clear()
    handles = getattr(chunk, "remove_forward_pre_hook_handles", None)
    if isinstance(handles, dict):
        for handle in handles.values():
            handle.remove()
        handles.clear()
    grads = getattr(chunk, "flat_param_offload", None)  # param offload's DDP glue
    if grads is not None:
        grads.offload.close()
    module = getattr(chunk, "module", chunk)
    for sub in module.modules():
        offload = getattr(sub, "param_offload", None)
        if offload is not None:
            offload.close()
            sub.param_offload = None
            sub.__dict__.pop("routed_experts_flat", None)  # the instance's offloaded route
        _clear_method_caches(type(sub))


def _clear_method_caches(cls: type) -> None:
    """Empty the ``functools.lru_cache`` of every method of ``cls`` (and its bases): such a
    cache keys on ``self``, so it keeps the module (and what it returned) alive across
    models. Megatron's ``RotaryEmbedding.forward`` is one (32 entries: the rotary table of
    every model built since). Other live modules only recompute their entries."""
    for klass in cls.__mro__:
        for value in vars(klass).values():
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and hasattr(value, "cache_info"):
                clear()


def _noop(*args, **kwargs) -> None:
    return None


def clear_node_hooks(node) -> None:
    """Remove every Python hook from autograd ``node`` (a gradient accumulator). Hooks are
    kept in one dict per node; registering a no-op hands back a handle that refers to it
    (``RemovableHandle.hooks_dict_ref``), and emptying it removes them all, the no-op too."""
    handle = node.register_hook(_noop)
    hooks = handle.hooks_dict_ref()
    if hooks is None:
        handle.remove()
        return
    hooks.clear()
