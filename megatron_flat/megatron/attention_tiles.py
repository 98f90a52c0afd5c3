"""Megatron's attention projections with sequence tiles (``megatron_flat.attention``).

:class:`TiledColumnParallelLinear` (the QKV projection) and :class:`TiledRowParallelLinear`
(the output projection; also multi-latent attention's sequence-gathering projections,
:class:`TiledMLASelfAttention`) are Megatron-Core's ``ColumnParallelLinear`` / ``RowParallelLinear``
with ``forward`` replaced where the tiles apply: sequence parallelism on, TP > 1, and the
plain case of the layer (no gathered output, no expert communication, no deferred embedding
gradients). Elsewhere they are Megatron's own layer, unchanged. Same parameters, same state
dict, same ``(output, bias)`` contract; ``tile_tokens`` (tokens per gathered tile, fixed
before launch) sets ``rows = tile_tokens // TP`` rows of each rank's shard per tile.

Weight gradients: with Megatron's ``gradient_accumulation_fusion`` and a ``main_grad`` (DDP's
fp32 buffer), each tile's gradient is added straight into ``main_grad`` and the layer reports
``grad_added_to_main_grad`` as Megatron's fused linear does (DDP's hook then skips its own
add); otherwise the fp32 sum over tiles is returned as the weight's gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_flat.attention import SequenceTiles, rows_for_tokens, tiled_gather_linear
from megatron_flat.attention import tiled_linear_reduce_scatter

__all__ = ["TiledColumnParallelLinear", "TiledMLASelfAttention", "TiledRowParallelLinear",
           "with_attn_tiles"]


class _TileSize:
    """The tile knob shared by both layers (``tile_tokens``: a constructor keyword, which a
    layer spec's ``params`` give; 0 leaves the layer Megatron's)."""

    tile_tokens: int = 0
    most_tiles: int = 0  # the most tiles one call has used (what a rehearsal reports)

    def __init__(self, *args, tile_tokens: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if tile_tokens < 0:
            raise ValueError(f"tile_tokens must be >= 0, got {tile_tokens}")
        self.tile_tokens = tile_tokens
        self.most_tiles = 0

    @property
    def _tp(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    def _tiles(self, n_local: int) -> Optional[SequenceTiles]:
        tp = self._tp
        if not self.tile_tokens or tp == 1 or not self.sequence_parallel:
            return None
        tiles = SequenceTiles(n_local, tp, min(rows_for_tokens(self.tile_tokens, tp), n_local))
        self.most_tiles = max(self.most_tiles, tiles.count)
        return tiles

    def _into_main_grad(self) -> bool:
        return bool(self.gradient_accumulation_fusion) and \
            getattr(self.weight, "main_grad", None) is not None


class TiledColumnParallelLinear(_TileSize, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose sequence-parallel all-gather + GEMM runs tile by tile."""

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        tiles = self._tiles(input_.shape[0])
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        plain = (tiles is not None and weight is None and not gather
                 and not self.explicit_expert_comm and not self.disable_grad_reduce
                 and not self.config.defer_embedding_wgrad_compute)
        if not plain:
            return super().forward(input_, weight, runtime_gather_output)
        bias = self.bias if not self.skip_bias_add else None
        output = tiled_gather_linear(input_, self.weight, tiles, bias=bias, group=self.tp_group,
                                     main_grad=self._into_main_grad())
        return output, (self.bias if self.skip_bias_add else None)


class TiledRowParallelLinear(_TileSize, RowParallelLinear):
    """``RowParallelLinear`` whose GEMM + sequence-parallel reduce-scatter runs tile by tile."""

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        tp = self._tp
        tiles = self._tiles(input_.shape[0] // tp) if input_.shape[0] % tp == 0 else None
        if tiles is None or not self.input_is_parallel or self.explicit_expert_comm:
            return super().forward(input_)
        output = tiled_linear_reduce_scatter(input_, self.weight, tiles, group=self.tp_group,
                                             main_grad=self._into_main_grad())
        if not self.skip_bias_add:
            return (output + self.bias if self.bias is not None else output), None
        return output, self.bias


# ---------------------------------------------------------------------------- layer specs
def _tiled(module: Any, tiled_cls: type, flat_tokens: int, stock: Tuple[str, ...]) -> Any:
    """``tiled_cls`` as a spec with the tile size, in place of the linear ``module`` (a class
    or a ModuleSpec of one) whose class name is one of ``stock``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    cls = module.module if isinstance(module, ModuleSpec) else module
    if cls is tiled_cls:
        return module  # already tiled: the transform is idempotent
    if not isinstance(cls, type) or cls.__name__ not in stock:
        raise ValueError(f"--flat-attn-tiles tiles Megatron's {' / '.join(stock)}; this layer "
                         f"spec has {getattr(cls, '__name__', cls)!r}")
    params = dict(module.params) if isinstance(module, ModuleSpec) else {}
    return ModuleSpec(module=tiled_cls, params={**params, "tile_tokens": flat_tokens})


_QKV = ("ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear")
_PROJ = ("RowParallelLinear", "TERowParallelLinear")
_FUSED_NORM = "TELayerNormColumnParallelLinear"
# Multi-latent attention's column projections that gather the sequence under SP: the q
# projection without a q LoRA, and the up projections (their inputs are the LoRA latents).
# The down projections are TELinear (duplicated: each rank projects its own rows, nothing is
# gathered) in transformer-engine's spec; the local spec's ColumnParallelLinear down
# projections gather the hidden states and are tiled by TiledMLASelfAttention.
_MLA_COLUMNS = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
_MLA_DOWN = ("linear_q_down_proj", "linear_kv_down_proj")
# A fused up projection's norm, kept as the attention's own norm module: projection -> norm.
_MLA_NORMS = {"linear_q_up_proj": "q_layernorm", "linear_kv_up_proj": "kv_layernorm"}


def _class_name(module: Any) -> str:
    cls = module.module if hasattr(module, "module") else module
    return getattr(cls, "__name__", "")


def _te_norm() -> type:
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm


def with_attn_tiles(layer_spec: Any, flat: Any) -> Any:
    """A ``TransformerLayer`` spec whose self-attention projections that meet the sequence-
    parallel collectives are the tiled layers (``flat.attn_tiles`` tokens a tile); unchanged
    when the knob is 0. Self-attention: ``linear_qkv`` and ``linear_proj``. Multi-latent
    attention: ``linear_proj``, the q projection or q up projection, the kv up projection,
    and the local spec's ColumnParallelLinear down projections (:class:`TiledMLASelfAttention`;
    transformer-engine's TELinear down projections gather nothing and stay).

    A transformer-engine column layer that fuses a norm (``TELayerNormColumnParallelLinear``)
    becomes the backend's separate norm followed by the tiled projection: the layer's
    ``input_layernorm`` before the QKV projection, MLA's ``q_layernorm`` / ``kv_layernorm``
    before its up projections (norms are per token, so each rank's shard is normalised as
    the fused layer would). The layer's ``sharded_state_dict_keys_map`` maps the separate
    norm's checkpoint keys to the fused layer's, so checkpoints cross between stock and flat.
    Raises ``ValueError`` for another attention (0.19's FusedMLASelfAttention among them) or
    projection classes it does not know. (0.19's MLA with q/k norms and no q LoRA replaces a
    q projection that does not fuse the norm with transformer-engine's fused one: that
    projection stays Megatron's, untiled; the model is the same.)"""
    if not getattr(flat, "attn_tiles", 0):
        return layer_spec
    submodules = getattr(layer_spec, "submodules", None)
    attention = getattr(submodules, "self_attention", None)
    inner = getattr(attention, "submodules", None)
    kind = _class_name(attention)
    if kind in ("MLASelfAttention", "TiledMLASelfAttention"):
        return _with_mla_tiles(layer_spec, flat.attn_tiles)
    if inner is None or not hasattr(inner, "linear_qkv") or not hasattr(inner, "linear_proj"):
        raise ValueError(f"--flat-attn-tiles tiles self-attention (linear_qkv, linear_proj) "
                         f"and MLASelfAttention; this layer has {kind or attention!r}")
    layer_changes, keys = {}, {}
    if _class_name(inner.linear_qkv) == _FUSED_NORM:
        layer_changes["input_layernorm"] = _te_norm()  # the norm TE fused, its own module
        keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    inner = dataclasses.replace(
        inner,
        linear_qkv=_tiled(inner.linear_qkv, TiledColumnParallelLinear, flat.attn_tiles, _QKV),
        linear_proj=_tiled(inner.linear_proj, TiledRowParallelLinear, flat.attn_tiles, _PROJ))
    return _replace_attention(layer_spec, dataclasses.replace(attention, submodules=inner),
                              layer_changes, keys)


def _with_mla_tiles(layer_spec: Any, tokens: int) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = layer_spec.submodules.self_attention
    inner = attention.submodules
    changes, keys = {}, {}
    for name in _MLA_COLUMNS:
        linear = getattr(inner, name, None)
        if linear is None:
            continue
        if _class_name(linear) == _FUSED_NORM:
            norm = _MLA_NORMS[name]
            changes[norm] = _te_norm()
            keys[f"self_attention.{norm}."] = f"self_attention.{name}.layer_norm_"
        changes[name] = _tiled(linear, TiledColumnParallelLinear, tokens, _QKV)
    changes["linear_proj"] = _tiled(inner.linear_proj, TiledRowParallelLinear, tokens, _PROJ)
    params = {**dict(attention.params or {}), "tile_tokens": tokens}
    tiled = ModuleSpec(module=TiledMLASelfAttention, params=params,
                       submodules=dataclasses.replace(inner, **changes))
    return _replace_attention(layer_spec, tiled, {}, keys)


def _replace_attention(layer_spec: Any, attention: Any, layer_changes: dict,
                       keys: dict) -> Any:
    submodules = layer_spec.submodules
    if keys:
        layer_changes["sharded_state_dict_keys_map"] = {
            **dict(submodules.sharded_state_dict_keys_map or {}), **keys}
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        submodules, self_attention=attention, **layer_changes))


def _retype(linear: Any, tiled_cls: type, tokens: int) -> None:
    """Make an already-built Megatron linear its tiled subclass in place (same parameters,
    buffers and hooks; only ``forward`` and the tile knob are added)."""
    linear.__class__ = tiled_cls
    linear.tile_tokens, linear.most_tiles = tokens, 0


class TiledMLASelfAttention(MLASelfAttention):
    """Megatron's ``MLASelfAttention`` whose sequence-gathering down projections are tiled
    (its other projections come tiled from the spec); ``tile_tokens`` as the linears'."""

    def __init__(self, *args, tile_tokens: int = 0, **kwargs) -> None:
        if tile_tokens < 0:
            raise ValueError(f"tile_tokens must be >= 0, got {tile_tokens}")
        super().__init__(*args, **kwargs)
        # MLA accepts only Megatron's own classes for its down projections (it checks them
        # by identity), so the local spec's ColumnParallelLinear ones are built as Megatron's
        # and made tiled here; TELinear (duplicated) gathers nothing and is left as built.
        for name in _MLA_DOWN:
            linear = getattr(self, name, None)
            if type(linear) is ColumnParallelLinear:
                _retype(linear, TiledColumnParallelLinear, tile_tokens)
