"""Layer specs that put megatron-flat's modules into Megatron-Core models (0.16.1 and 0.19.x).

Megatron builds a GPT model from specs: a ``TransformerLayer`` spec per layer (its ``mlp`` the
MoE spec — a ``ModuleSpec`` in 0.16, a ``functools.partial`` in 0.19) collected in a decoder
block spec. Here each megatron-flat technique that lives in a layer is a *layer-spec transform*
``(layer_spec, flat) -> layer_spec`` in :data:`LAYER_TRANSFORMS`; :func:`flat_layer_spec`
applies all of them, and the ``gpt_*`` functions wrap Megatron's own spec functions. Today the
one transform is PipelinedLLEP's: the MoE layer becomes ``FlatMoELayer`` when
``flat.dispatch != "off"``.

Ways in, one transform behind all of them:

* :class:`FlatSpecProvider` — a ``BackendSpecProvider`` (Megatron's local or transformer-engine
  provider, wrapped): pass it wherever Megatron takes a ``backend``; its MoE specs build the
  flat MoE layer. :func:`flat_gpt_spec` (or its ``layer_spec`` / ``decoder_block_spec``) gives
  the GPT layer or decoder block spec.
* :data:`flat_gpt_layer_spec` / :data:`flat_gpt_layer_te_spec` — for Megatron-LM's
  ``--spec megatron_flat.megatron.spec flat_gpt_layer_spec`` (Megatron-Core modules, with
  ``--transformer-impl local``) or ``... flat_gpt_layer_te_spec`` (transformer-engine modules).
  Either builds *Megatron's own spec for the line* with the flat modules swapped in, never a
  fixed layer: ``install()`` takes the name off the line (``args.spec = None``, see
  :func:`redirect_flat_spec`), so Megatron-LM's builder makes its own choice (dense/MoE pattern,
  q/k norms, MLA, MTP block, shared experts, biases, grouped GEMM, ...) and every decoder block
  it builds passes through :data:`LAYER_TRANSFORMS` (:func:`_block_submodules`). Built in code
  (``GPTModel(transformer_layer_spec=flat_gpt_layer_spec)``), the block is the one Megatron-LM's
  GPT builder makes for the model's ``TransformerConfig`` (:func:`megatron_decoder_spec`).
* :func:`flat_moe_specs` / :func:`wire_dispatch` — Megatron's *stock* spec functions return the
  flat MoE layer (how a model built by code we don't control, e.g. ``pretrain_gpt.py`` without
  ``--spec``, or a test harness, gets it).
* :func:`gpt_layer_local_spec`, :func:`gpt_layer_spec` (local or transformer-engine modules),
  :func:`gpt_decoder_block_spec` — Megatron's spec with the flat layers of an explicit FlatConfig.

Which FlatConfig: an explicit one wins; else the innermost :func:`flat_moe_specs` block, else
the one ``megatron_flat.install()`` installed, else ``FlatConfig()`` (everything off), see
:func:`current_flat`. Specs are copied, never mutated: Megatron shares spec objects between
layers and calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, List, Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_flat.config import FlatConfig
from megatron_flat.megatron import compat
from megatron_flat.runtime import extras, patching

__all__ = ["FLAT_SPECS", "FlatSpecProvider", "LAYER_TRANSFORMS", "LazyFlatLayerSpec",
           "current_flat", "flat_gpt_layer_spec", "flat_gpt_layer_te_spec", "flat_gpt_spec",
           "flat_layer_spec", "flat_moe_spec", "flat_moe_specs", "flat_spec_named",
           "flat_spec_problems", "gpt_decoder_block_spec", "gpt_layer_local_spec",
           "gpt_layer_spec", "is_moe_spec", "megatron_decoder_spec", "redirect_flat_spec",
           "wire_dispatch", "with_flat_moe"]

_OFF = FlatConfig()
_ACTIVE: List[FlatConfig] = []


def current_flat() -> FlatConfig:
    """The FlatConfig a spec built now follows: the innermost :func:`flat_moe_specs` block's,
    else the installed one (``megatron_flat.install``), else ``FlatConfig()``."""
    if _ACTIVE:
        return _ACTIVE[-1]
    from megatron_flat.megatron.state import installed

    return installed() or _OFF


# ---------------------------------------------------------------------------- layer transforms
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
    from megatron_flat.megatron.layer_kwargs_note import install_filter

    install_filter(FlatMoELayer)  # TransformerLayer's "Unknown MLP type" for it, see there
    return compat.replace_moe_module(moe_spec, FlatMoELayer, flat=flat)


def _moe_for(moe_spec: Any, flat: Optional[FlatConfig]) -> Any:
    """``moe_spec`` as ``flat`` wants it: the flat MoE layer when its dispatch is on, else as is."""
    if flat is None or flat.dispatch == "off":
        return moe_spec
    return flat_moe_spec(moe_spec, flat)


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
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.moe import FlatMoELayer

    module = compat.moe_spec_module(mlp)
    if issubclass(module, FlatMoELayer):
        return layer_spec  # already swapped (Megatron's spec functions build it when wired)
    if module is not MoELayer:
        # Swapping a subclass for FlatMoELayer would drop what the subclass adds.
        raise ValueError(f"--flat-dispatch replaces Megatron's MoELayer; this layer spec builds "
                         f"{module.__module__}.{module.__name__}, a subclass it would drop")
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(submodules, mlp=flat_moe_spec(mlp, flat)))


def _with_attn_tiles(layer_spec: Any, flat: FlatConfig) -> Any:
    if not flat.attn_tiles:
        return layer_spec
    from megatron_flat.megatron.attention_tiles import with_attn_tiles

    return with_attn_tiles(layer_spec, flat)


LAYER_TRANSFORMS: List[Callable[[Any, FlatConfig], Any]] = [with_flat_moe, _with_attn_tiles]
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


# ---------------------------------------------------------------------------- backend provider
class FlatSpecProvider(BackendSpecProvider):
    """Megatron's backend spec provider, wrapped, whose MoE specs carry ``FlatMoELayer``.

    ``flat``: the FlatConfig its specs follow; ``None`` reads :func:`current_flat` (the
    installed one) each time a spec is built. ``backend``: the provider to wrap; default
    ``TESpecProvider`` when transformer-engine is importable (or ``transformer_engine=True``),
    else ``LocalSpecProvider``.

    Every ``BackendSpecProvider`` method (and any other attribute, e.g. the transformer-engine
    provider's ``linear``) is the wrapped provider's, so the linear, norm, attention and expert
    modules are exactly Megatron's. What the plugin swaps is swapped in the MoE spec:

    * Megatron's ``get_moe_module_spec_for_backend`` hard-codes ``MoELayer``; constructing a
      provider wires it (process-wide, see :func:`flat_moe_specs`) so that, called with a
      FlatSpecProvider as ``backend``, it returns this provider's MoE spec — and so does every
      Megatron function that reaches it with ``backend`` (``get_mlp_module_spec_for_backend``,
      the experimental-attention-variant specs).
    * :meth:`moe_module_spec`, :meth:`mlp_module_spec`, :meth:`layer_spec`,
      :meth:`decoder_block_spec` build the specs directly.

    The GPT layer and block specs come from Megatron's spec functions for the wrapped kind
    (local or transformer-engine), which choose their provider themselves; a custom ``backend``
    only reaches the functions that take one.
    """

    def __init__(self, flat: Optional[FlatConfig] = None, *,
                 backend: Optional[BackendSpecProvider] = None,
                 transformer_engine: Optional[bool] = None):
        if transformer_engine is None:
            transformer_engine = extras.available("transformer_engine")
        if backend is None:
            backend = _megatron_backend(transformer_engine)
        self._flat = flat
        self.backend = backend
        self.transformer_engine = bool(transformer_engine)
        _patch_stock_moe_specs()

    @property
    def flat(self) -> FlatConfig:
        """The FlatConfig this provider's specs follow (read now when none was given)."""
        return self._flat if self._flat is not None else current_flat()

    def __repr__(self) -> str:
        given = "installed" if self._flat is None else repr(self._flat)
        return f"FlatSpecProvider(flat={given}, backend={type(self.backend).__name__})"

    # -- BackendSpecProvider, delegated (signatures differ between releases: pass through) --
    def column_parallel_linear(self) -> type:
        return self.backend.column_parallel_linear()

    def row_parallel_linear(self) -> type:
        return self.backend.row_parallel_linear()

    def fuse_layernorm_and_linear(self) -> bool:
        return self.backend.fuse_layernorm_and_linear()

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return self.backend.column_parallel_layer_norm_linear()

    def layer_norm(self, *args: Any, **kwargs: Any) -> Any:
        return self.backend.layer_norm(*args, **kwargs)

    def core_attention(self) -> type:
        return self.backend.core_attention()

    def grouped_mlp_modules(self, *args: Any, **kwargs: Any) -> Any:
        return self.backend.grouped_mlp_modules(*args, **kwargs)

    def activation_func(self) -> Any:
        return self.backend.activation_func()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: the wrapped provider's extras.
        if name.startswith("_") or "backend" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["backend"], name)

    # -- specs carrying the plugin's modules --
    def moe_module_spec(self, num_experts: int, **kwargs: Any) -> Any:
        """Megatron's MoE spec for this backend (``kwargs`` go to
        ``get_moe_module_spec_for_backend``), with ``FlatMoELayer`` when dispatch is on."""
        from megatron.core.models.gpt import moe_module_specs

        return moe_module_specs.get_moe_module_spec_for_backend(
            backend=self, num_experts=num_experts, **kwargs)

    def mlp_module_spec(self, num_experts: Optional[int] = None, **kwargs: Any) -> Any:
        """Megatron's dense MLP (``num_experts=None``) or MoE spec for this backend."""
        from megatron.core.models.gpt import gpt_layer_specs

        return gpt_layer_specs.get_mlp_module_spec_for_backend(
            backend=self, num_experts=num_experts, **kwargs)

    def layer_spec(self, **kwargs: Any) -> Any:
        """The GPT ``TransformerLayer`` spec (:func:`gpt_layer_spec`) for this provider's kind."""
        return gpt_layer_spec(self.flat, use_transformer_engine=self.transformer_engine, **kwargs)

    def decoder_block_spec(self, config: Any, **kwargs: Any) -> Any:
        """The GPT decoder block spec (:func:`gpt_decoder_block_spec`) for this provider's kind:
        dense and MoE layers as ``config`` says, this pipeline stage's slice. ``normalization``
        and ``qk_l2_norm`` default to ``config``'s, as Megatron-LM's GPT builder passes them."""
        for name in ("normalization", "qk_l2_norm"):
            if hasattr(config, name):
                kwargs.setdefault(name, getattr(config, name))
        return gpt_decoder_block_spec(config, self.flat,
                                      use_transformer_engine=self.transformer_engine, **kwargs)


def _megatron_backend(transformer_engine: bool) -> BackendSpecProvider:
    if not transformer_engine:
        return LocalSpecProvider()
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider()


# ---------------------------------------------------------------------------- GPT specs
@contextlib.contextmanager
def _stock_moe() -> Iterator[None]:
    """Megatron's spec functions build the stock ``MoELayer`` inside the block, whatever is
    installed, so a transform applied afterwards sees (and decides from) the stock spec."""
    with flat_moe_specs(_OFF):
        yield


def gpt_layer_local_spec(flat: FlatConfig, **kwargs: Any) -> Any:
    """``get_gpt_layer_local_spec(**kwargs)`` (Megatron-Core modules only) with the flat layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with _stock_moe():
        stock = get_gpt_layer_local_spec(**kwargs)
    return flat_layer_spec(stock, flat)


def gpt_layer_spec(flat: FlatConfig, *, use_transformer_engine: bool = False,
                   **kwargs: Any) -> Any:
    """Megatron's GPT layer spec (local modules, or transformer-engine ones) with the flat
    layers; ``kwargs`` go to Megatron's spec function."""
    if not use_transformer_engine:
        return gpt_layer_local_spec(flat, **kwargs)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    with _stock_moe():
        stock = get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return flat_layer_spec(stock, flat)


def gpt_decoder_block_spec(config: Any, flat: FlatConfig, *, use_transformer_engine: bool = False,
                           **kwargs: Any) -> Any:
    """``get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)`` (dense and MoE
    layers per ``config``, this pipeline stage's slice) with the flat layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    with _stock_moe():
        stock = get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)
    return _flat_block(stock, flat)


def flat_gpt_spec(flat: Optional[FlatConfig] = None, config: Any = None, *,
                  use_transformer_engine: Optional[bool] = None, **kwargs: Any) -> Any:
    """The GPT spec built with ``FlatSpecProvider(flat)``: the decoder block spec for
    ``config`` when given (what ``GPTModel(transformer_layer_spec=...)`` takes for mixed
    dense/MoE layers), else one layer spec (``kwargs`` then go to Megatron's layer spec
    function, e.g. ``num_experts=``). ``flat=None``: the installed FlatConfig;
    ``use_transformer_engine=None``: transformer-engine modules when importable."""
    provider = FlatSpecProvider(flat, transformer_engine=use_transformer_engine)
    if config is not None:
        return provider.decoder_block_spec(config, **kwargs)
    return provider.layer_spec(**kwargs)


# ---------------------------------------------------------------------------- --spec objects
class LazyFlatLayerSpec(ModuleSpec):
    """The object ``--spec megatron_flat.megatron.spec <name>`` names: Megatron's own spec for
    the model, with the flat modules of :func:`current_flat` swapped in.

    Megatron-LM imports it as it is and would repeat one layer spec over every layer, so it
    never reaches Megatron-LM's builder: ``install()`` takes it off the line
    (:func:`redirect_flat_spec`). Given to ``GPTModel`` in code, the decoder block is built by
    :func:`_block_submodules` from the model's ``TransformerConfig`` (what Megatron-LM's GPT
    builder builds for it without ``--spec``, :func:`megatron_decoder_spec`), this pipeline
    stage's slice. ``transformer_engine`` says which modules: transformer-engine's or
    Megatron-Core's local ones.

    Its fields (``module``, ``submodules``, ...) show the MoE layer of that spec, the stock
    ``get_gpt_layer_*_spec(num_experts)`` with the flat layers (read-only views, resolved when
    read; :meth:`resolve` gives a plain ``ModuleSpec``); they are not what a model is built from.
    """

    def __init__(self, build_stock: Callable[[], ModuleSpec], name: str, *,
                 transformer_engine: bool):
        # Not ModuleSpec.__init__: it would assign the fields, which are views here.
        self._build_stock = build_stock
        self._name = name
        self._stock: Optional[ModuleSpec] = None
        self.transformer_engine = transformer_engine

    def stock(self) -> ModuleSpec:
        """The stock MoE layer spec (``MoELayer`` whatever is installed); built on first call."""
        if self._stock is None:
            with _stock_moe():
                self._stock = self._build_stock()
        return self._stock

    def resolve(self, flat: Optional[FlatConfig] = None) -> ModuleSpec:
        """The MoE layer's plain ``ModuleSpec`` for ``flat`` (default :func:`current_flat`)."""
        return flat_layer_spec(self.stock(), flat if flat is not None else current_flat())

    module = property(lambda self: self.resolve().module)
    params = property(lambda self: self.resolve().params)
    submodules = property(lambda self: self.resolve().submodules)
    metainfo = property(lambda self: self.resolve().metainfo)

    def __repr__(self) -> str:
        return f"megatron_flat.megatron.spec.{self._name}"


# Megatron's layer spec functions only ask whether num_experts is None (MoE or dense); the
# expert count itself comes from the TransformerConfig (--num-experts) when the layer is built.
_MOE_LAYER = 1


def _stock_local_moe_layer() -> ModuleSpec:
    # "RMSNorm" selects WrappedTorchNorm, which builds LayerNorm or RMSNorm as the config says.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=_MOE_LAYER, normalization="RMSNorm")


def _need_transformer_engine(name: str) -> None:
    if not extras.available("transformer_engine"):
        raise RuntimeError(f"megatron_flat.megatron.spec.{name} builds transformer-engine "
                           "modules, and transformer-engine is not importable here; use "
                           "flat_gpt_layer_spec (Megatron-Core modules) instead")


def _stock_te_moe_layer() -> ModuleSpec:
    _need_transformer_engine("flat_gpt_layer_te_spec")
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec(num_experts=_MOE_LAYER)


flat_gpt_layer_spec = LazyFlatLayerSpec(_stock_local_moe_layer, "flat_gpt_layer_spec",
                                        transformer_engine=False)
"""``--spec megatron_flat.megatron.spec flat_gpt_layer_spec`` (with ``--transformer-impl
local``): Megatron's own spec for the line, Megatron-Core modules, with the flat modules of the
installed FlatConfig (``FlatMoELayer`` for ``--flat-dispatch``, the tiled projections for
``--flat-attn-tiles``). The local attention does not support context parallelism."""

flat_gpt_layer_te_spec = LazyFlatLayerSpec(_stock_te_moe_layer, "flat_gpt_layer_te_spec",
                                           transformer_engine=True)
"""``--spec megatron_flat.megatron.spec flat_gpt_layer_te_spec`` (with ``--transformer-impl
transformer_engine``, Megatron-LM's default): as :data:`flat_gpt_layer_spec` with
transformer-engine modules; needs transformer-engine when the model is built."""

FLAT_SPECS = {"flat_gpt_layer_spec": flat_gpt_layer_spec,
              "flat_gpt_layer_te_spec": flat_gpt_layer_te_spec}
"""The names ``--spec megatron_flat.megatron.spec NAME`` takes."""

SPEC_MODULE = __name__


# ---------------------------------------------------------------------------- Megatron's spec
def megatron_decoder_spec(config: Any, *, use_transformer_engine: bool,
                          vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> Any:
    """The decoder spec Megatron-LM's GPT builder gives ``GPTModel`` for ``config`` when the
    line has no ``--spec`` (``gpt_builders.gpt_builder``, core_v0.16 to main): an MoE model's
    decoder block spec (``get_gpt_decoder_block_spec``: dense/MoE layers by
    ``moe_layer_freq``, this stage's slice), else the one dense layer spec. Stock modules
    (``MoELayer``), whatever is installed. Raises ``ValueError`` for the builder's other
    branches (experimental attention variants, heterogeneous layers), which the flat spec does
    not build in code: give Megatron-LM the line without ``--spec`` there."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    for name in ("experimental_attention_variant", "heterogeneous_block_specs"):
        if getattr(config, name, None):
            raise ValueError(f"the flat layer spec builds Megatron's GPT decoder; this config "
                             f"sets {name}: leave --spec out (install() wires the flat modules "
                             "into Megatron-LM's own builder)")
    if use_transformer_engine:
        _need_transformer_engine("flat_gpt_layer_te_spec")
    with _stock_moe():
        if config.num_moe_experts:
            return specs.get_gpt_decoder_block_spec(
                config, use_transformer_engine, normalization=config.normalization,
                qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage, pp_rank=pp_rank)
        dense = dict(num_experts=None, moe_grouped_gemm=config.moe_grouped_gemm,
                     qk_layernorm=config.qk_layernorm,
                     multi_latent_attention=config.multi_latent_attention,
                     qk_l2_norm=config.qk_l2_norm)
        if use_transformer_engine:
            return specs.get_gpt_layer_with_transformer_engine_spec(**dense)
        return specs.get_gpt_layer_local_spec(normalization=config.normalization, **dense)


_FLAT_BLOCKS: List[bool] = []  # [True] once install() took a flat --spec off the line


def flat_spec_named(spec_arg: Any) -> Optional[LazyFlatLayerSpec]:
    """The flat spec object Megatron-LM's ``--spec MODULE NAME`` value names, or None for any
    other spec (or none). Raises ``ValueError`` for an unknown name in this module."""
    if not spec_arg or len(spec_arg) != 2 or spec_arg[0] != SPEC_MODULE:
        return None
    if spec_arg[1] not in FLAT_SPECS:
        raise ValueError(f"--spec {SPEC_MODULE} {spec_arg[1]}: no such flat spec (there are "
                         f"{', '.join(FLAT_SPECS)})")
    return FLAT_SPECS[spec_arg[1]]


def flat_spec_problems(args: Any) -> List[str]:
    """Why Megatron-LM ``args`` naming a flat ``--spec`` cannot be honoured (empty when they
    can, or name none): the spec's modules must be the ones ``--transformer-impl`` asks for,
    since the model built without megatron-flat is made of those."""
    try:
        spec = flat_spec_named(getattr(args, "spec", None))
    except ValueError as exc:
        return [str(exc)]
    impl = getattr(args, "transformer_impl", None)
    if spec is None or impl is None:
        return []
    want = "transformer_engine" if spec.transformer_engine else "local"
    if impl == want:
        return []
    other = "flat_gpt_layer_te_spec" if want == "local" else "flat_gpt_layer_spec"
    return [f"--spec {SPEC_MODULE} {spec._name} builds "
            f"{'transformer-engine' if spec.transformer_engine else 'Megatron-Core local'} "
            f"modules, but the line has --transformer-impl {impl}: without megatron-flat "
            f"Megatron would build {impl} modules. Use --spec {SPEC_MODULE} {other}, or "
            f"--transformer-impl {want}"]


def redirect_flat_spec(args: Any) -> Optional[str]:
    """``install()``'s step for Megatron-LM ``args``: when ``--spec`` names a flat spec, take it
    off the line (``args.spec = None``) so that Megatron-LM's GPT builder builds its own spec
    for the line (its MTP block included, which its ``--spec`` path cannot build), and swap
    the flat modules into every decoder block it builds from then on. Returns the name taken
    off (kept as ``args.flat_spec``), or None. Call :func:`flat_spec_problems` first."""
    spec = flat_spec_named(getattr(args, "spec", None))
    if spec is None:
        return None
    args.spec = None
    args.flat_spec = spec._name
    _patch_block_submodules()
    if not _FLAT_BLOCKS:
        _FLAT_BLOCKS.append(True)
    return spec._name


def _each_layer(submodules: Any, transform: Callable[[Any, FlatConfig], Any]) -> Any:
    """A block's submodules (decoder or MTP) with ``transform(layer_spec, current_flat())``
    applied to each of its ``layer_specs``."""
    flat = current_flat()
    return dataclasses.replace(
        submodules, layer_specs=[transform(s, flat) for s in submodules.layer_specs])


def _block_submodules(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``transformer_block._get_block_submodules`` wrapped: a flat spec object becomes
    Megatron's own decoder spec for the config; the block's layer specs then get
    :data:`LAYER_TRANSFORMS` (for a flat spec object, or any block once ``install()`` took a
    flat ``--spec`` off the line). Other specs are Megatron's, untouched."""

    @functools.wraps(stock)
    def get_block_submodules(config: Any, spec: Any, vp_stage: Optional[int] = None,
                             pp_rank: Optional[int] = None) -> Any:
        flat_spec = isinstance(spec, LazyFlatLayerSpec)
        if flat_spec:
            spec = megatron_decoder_spec(config, use_transformer_engine=spec.transformer_engine,
                                         vp_stage=vp_stage, pp_rank=pp_rank)
        submodules = stock(config, spec, vp_stage, pp_rank)
        if not (flat_spec or _FLAT_BLOCKS):
            return submodules
        return _each_layer(submodules, flat_layer_spec)

    return get_block_submodules


BLOCK_SUBMODULES = patching.Patch(
    "megatron.core.transformer.transformer_block", "_get_block_submodules", _block_submodules,
    expects="the transformer block's layer-spec resolver",
    why="the flat spec is Megatron's own spec for the config, with the flat modules swapped "
        "into each layer")


def _flat_mtp_layer(layer_spec: Any, flat: FlatConfig) -> Any:
    """An MTP layer spec whose inner transformer layer has :data:`LAYER_TRANSFORMS` applied
    (a Mamba block or another shape is left as it is)."""
    submodules = getattr(layer_spec, "submodules", None)
    field = compat.mtp_layer_field(submodules)
    inner = getattr(submodules, field, None) if field else None
    if not hasattr(getattr(inner, "submodules", None), "self_attention"):
        return layer_spec
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        submodules, **{field: flat_layer_spec(inner, flat)}))


def _mtp_block_submodules(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``multi_token_prediction._get_mtp_block_submodules`` wrapped: once ``install()`` took a
    flat ``--spec`` off the line, each MTP layer's transformer layer gets
    :data:`LAYER_TRANSFORMS` as the decoder's layers do (Megatron-LM builds the MTP block
    from its own layer spec, not the decoder block's submodules)."""

    @functools.wraps(stock)
    def get_mtp_block_submodules(config: Any, spec: Any) -> Any:
        submodules = stock(config, spec)
        return _each_layer(submodules, _flat_mtp_layer) if _FLAT_BLOCKS else submodules

    return get_mtp_block_submodules


MTP_BLOCK_SUBMODULES = patching.Patch(
    "megatron.core.transformer.multi_token_prediction", "_get_mtp_block_submodules",
    _mtp_block_submodules, expects="the MTP block's layer-spec resolver",
    why="the MTP layers' transformer layers get the flat modules as the decoder's do")


def _patch_block_submodules() -> None:
    patching.apply(BLOCK_SUBMODULES)
    patching.apply(MTP_BLOCK_SUBMODULES)


def _unredirect_for_tests() -> None:
    """Forget that a flat ``--spec`` was taken off a line (``install._reset_for_tests``)."""
    _FLAT_BLOCKS.clear()


# The flat spec objects resolve at model build: the seam is in place once they exist.
_patch_block_submodules()


# ---------------------------------------------------------------------------- stock specs
# Megatron's spec functions all obtain their MoE spec from
# ``moe_module_specs.get_moe_module_spec_for_backend``, imported by name into ``gpt_layer_specs``
# (0.16.1 and 0.19.x; ``get_moe_module_spec`` and the experimental-attention specs look it up on
# ``moe_module_specs`` at call time). Wrapping those two names makes every stock spec function
# return the flat MoE layer while a FlatConfig is active, or when its backend is a
# FlatSpecProvider.
def _active_flat() -> Optional[FlatConfig]:
    if _ACTIVE:
        return _ACTIVE[-1]
    from megatron_flat.megatron.state import installed

    flat = installed()
    return flat if flat is not None and flat.dispatch != "off" else None


def _flat_moe_spec(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def get_moe_module_spec_for_backend(*args: Any, **kwargs: Any) -> Any:
        spec = stock(*args, **kwargs)
        backend = kwargs.get("backend", args[0] if args else None)
        if isinstance(backend, FlatSpecProvider):
            return _moe_for(spec, backend.flat)
        return _moe_for(spec, _active_flat())

    return get_moe_module_spec_for_backend


STOCK_MOE_SPECS = tuple(
    patching.Patch(f"megatron.core.models.gpt.{module}", "get_moe_module_spec_for_backend",
                   _flat_moe_spec, expects="Megatron's MoE spec function",
                   why="every stock spec function takes its MoE spec from it, so a line's own "
                       "spec builds FlatMoELayer with --flat-dispatch")
    for module in ("moe_module_specs", "gpt_layer_specs"))


def _patch_stock_moe_specs() -> None:
    for patch in STOCK_MOE_SPECS:
        patching.apply(patch)


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
