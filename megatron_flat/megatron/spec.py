"""Layer specs that put megatron-flat's modules into Megatron-Core models (0.16.1 and 0.19.x).

Megatron builds a GPT model from specs: a ``TransformerLayer`` spec per layer (its ``mlp`` the
MoE spec — a ``ModuleSpec`` in 0.16, a ``functools.partial`` in 0.19) collected in a decoder
block spec. Here each megatron-flat technique that lives in a layer is a *layer-spec transform*
``(layer_spec, flat) -> layer_spec`` in :data:`LAYER_TRANSFORMS`; :func:`flat_layer_spec`
applies all of them, and the ``gpt_*`` functions wrap Megatron's own spec functions.

* :func:`gpt_layer_local_spec`, :func:`gpt_layer_spec` (local or transformer-engine modules),
  :func:`gpt_decoder_block_spec` — Megatron's spec with the flat layers.
* :func:`flat_moe_specs` — a context in which Megatron's *stock* spec functions return the flat
  MoE layer (how a model built by code we don't control, e.g. ``pretrain_gpt.py`` or a test
  harness, gets it); :func:`wire_dispatch` does the same for ``megatron_flat.install``.

Specs are copied, never mutated: Megatron shares spec objects between layers and calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, List, Optional

from megatron_flat.config import FlatConfig
from megatron_flat.megatron import compat

__all__ = ["LAYER_TRANSFORMS", "flat_layer_spec", "flat_moe_spec", "flat_moe_specs",
           "gpt_decoder_block_spec", "gpt_layer_local_spec", "gpt_layer_spec", "is_moe_spec",
           "wire_dispatch", "with_flat_moe"]


def is_moe_spec(spec: Any) -> bool:
    """Whether an ``mlp`` spec builds an ``MoELayer`` (or a subclass)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    module = compat.moe_spec_module(spec)
    return module is not None and issubclass(module, MoELayer)


def flat_moe_spec(moe_spec: Any, flat: FlatConfig) -> Any:
    """An MoE spec (either release's shape) that builds ``FlatMoELayer`` configured by ``flat``,
    with the same router, experts and shared experts."""
    from megatron_flat.megatron.moe import FlatMoELayer

    if not is_moe_spec(moe_spec):
        raise ValueError(f"not an MoE layer spec: {moe_spec!r}")
    return compat.replace_moe_module(moe_spec, FlatMoELayer, flat=flat)


def with_flat_moe(layer_spec: Any, flat: FlatConfig) -> Any:
    """A ``TransformerLayer`` spec whose MoE ``mlp`` is the flat MoE layer.

    Unchanged when ``flat.dispatch`` is ``"off"`` or the layer is dense.
    """
    if flat.dispatch == "off":
        return layer_spec
    submodules = getattr(layer_spec, "submodules", None)
    mlp = getattr(submodules, "mlp", None)
    if mlp is None or not is_moe_spec(mlp):
        return layer_spec
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(submodules, mlp=flat_moe_spec(mlp, flat)))


LAYER_TRANSFORMS: List[Callable[[Any, FlatConfig], Any]] = [with_flat_moe]
"""Layer-spec transforms applied in order by :func:`flat_layer_spec` (one per technique that
lives inside a transformer layer; each returns its input when its technique is off)."""


def flat_layer_spec(layer_spec: Any, flat: FlatConfig) -> Any:
    """``layer_spec`` with every technique of :data:`LAYER_TRANSFORMS` applied."""
    for transform in LAYER_TRANSFORMS:
        layer_spec = transform(layer_spec, flat)
    return layer_spec


def _flat_block(block_spec: Any, flat: FlatConfig) -> Any:
    return dataclasses.replace(
        block_spec, layer_specs=[flat_layer_spec(s, flat) for s in block_spec.layer_specs])


def gpt_layer_local_spec(flat: FlatConfig, **kwargs: Any) -> Any:
    """``get_gpt_layer_local_spec(**kwargs)`` (Megatron-Core modules only) with the flat layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return flat_layer_spec(get_gpt_layer_local_spec(**kwargs), flat)


def gpt_layer_spec(flat: FlatConfig, *, use_transformer_engine: bool = False,
                   **kwargs: Any) -> Any:
    """Megatron's GPT layer spec (local modules, or transformer-engine ones) with the flat
    layers; ``kwargs`` go to Megatron's spec function."""
    if not use_transformer_engine:
        return gpt_layer_local_spec(flat, **kwargs)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return flat_layer_spec(get_gpt_layer_with_transformer_engine_spec(**kwargs), flat)


def gpt_decoder_block_spec(config: Any, flat: FlatConfig, *, use_transformer_engine: bool = False,
                           **kwargs: Any) -> Any:
    """``get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)`` (dense and MoE
    layers per ``config``, this pipeline stage's slice) with the flat layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return _flat_block(get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs), flat)


# ---------------------------------------------------------------------------- stock specs
# Megatron's spec functions all obtain their MoE spec from
# ``moe_module_specs.get_moe_module_spec_for_backend``, imported by name into ``gpt_layer_specs``
# (0.16.1 and 0.19.x; ``get_moe_module_spec`` and the experimental-attention specs look it up on
# ``moe_module_specs`` at call time). Wrapping those two names makes every stock spec function
# return the flat MoE layer while a FlatConfig is active.
_ACTIVE: List[FlatConfig] = []
_PATCHED: dict = {}


def _active_flat() -> Optional[FlatConfig]:
    if _ACTIVE:
        return _ACTIVE[-1]
    from megatron_flat.megatron.install import installed

    flat = installed()
    return flat if flat is not None and flat.dispatch != "off" else None


def _patch_stock_moe_specs() -> None:
    if _PATCHED:
        return
    from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs

    stock = moe_module_specs.get_moe_module_spec_for_backend

    @functools.wraps(stock)
    def get_moe_module_spec_for_backend(*args: Any, **kwargs: Any) -> Any:
        spec = stock(*args, **kwargs)
        flat = _active_flat()
        if flat is None or flat.dispatch == "off":
            return spec
        return flat_moe_spec(spec, flat)

    get_moe_module_spec_for_backend._megatron_flat_stock = stock
    for module in (moe_module_specs, gpt_layer_specs):
        _PATCHED[module] = getattr(module, "get_moe_module_spec_for_backend")
        module.get_moe_module_spec_for_backend = get_moe_module_spec_for_backend


@contextlib.contextmanager
def flat_moe_specs(flat: FlatConfig) -> Iterator[None]:
    """Within the block, Megatron's stock GPT spec functions build ``FlatMoELayer`` per ``flat``
    (process-wide; nests; the previous behaviour returns on exit)."""
    _patch_stock_moe_specs()
    _ACTIVE.append(flat)
    try:
        yield
    finally:
        _ACTIVE.pop()


def wire_dispatch(flat: FlatConfig, megatron: Any = None) -> None:
    """``megatron_flat.install`` wiring for ``--flat-dispatch``: Megatron's stock spec functions
    build ``FlatMoELayer`` with the installed FlatConfig from now on. Checks the megatron-core
    release and, when given, the Megatron settings the layer needs."""
    compat.check_supported()
    if megatron is not None:
        from megatron_flat.megatron.moe import unsupported_settings

        problems = unsupported_settings(megatron)
        if problems:
            raise ValueError("--flat-dispatch cannot run this MoE configuration:\n  - "
                             + "\n  - ".join(problems))
    _patch_stock_moe_specs()
