"""Megatron's attention projections with sequence tiles (``megatron_flat.attention``).

:class:`TiledColumnParallelLinear` (the QKV projection) and :class:`TiledRowParallelLinear`
(the output projection) are Megatron-Core's ``ColumnParallelLinear`` / ``RowParallelLinear``
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

from typing import Any, Optional, Tuple

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_flat.attention import SequenceTiles, rows_for_tokens, tiled_gather_linear
from megatron_flat.attention import tiled_linear_reduce_scatter

__all__ = ["TiledColumnParallelLinear", "TiledRowParallelLinear", "with_attn_tiles"]


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


def with_attn_tiles(layer_spec: Any, flat: Any) -> Any:
    """A ``TransformerLayer`` spec whose self-attention QKV and output projections are the
    tiled layers (``flat.attn_tiles`` tokens a tile); unchanged when the knob is 0.

    A transformer-engine QKV layer that fuses the input norm
    (``TELayerNormColumnParallelLinear``) becomes the backend's separate norm as the layer's
    ``input_layernorm`` followed by the tiled projection: the same norm on each rank's shard
    (norms are per token), then the tiled gather. Raises ``ValueError`` for an attention
    without ``linear_qkv``/``linear_proj`` (e.g. multi-latent attention) or other linears."""
    import dataclasses

    if not getattr(flat, "attn_tiles", 0):
        return layer_spec
    submodules = getattr(layer_spec, "submodules", None)
    attention = getattr(submodules, "self_attention", None)
    inner = getattr(attention, "submodules", None)
    if inner is None or not hasattr(inner, "linear_qkv") or not hasattr(inner, "linear_proj"):
        raise ValueError("--flat-attn-tiles needs self-attention with linear_qkv and "
                         "linear_proj (multi-latent attention is not tiled yet)")
    qkv_cls = inner.linear_qkv.module if hasattr(inner.linear_qkv, "module") else inner.linear_qkv
    layer_changes = {}
    if getattr(qkv_cls, "__name__", "") == "TELayerNormColumnParallelLinear":
        from megatron.core.extensions.transformer_engine import TENorm

        layer_changes["input_layernorm"] = TENorm  # the norm TE fused, kept as its own module
    inner = dataclasses.replace(
        inner, linear_qkv=_tiled(inner.linear_qkv, TiledColumnParallelLinear, flat.attn_tiles, _QKV),
        linear_proj=_tiled(inner.linear_proj, TiledRowParallelLinear, flat.attn_tiles, _PROJ))
    attention = dataclasses.replace(attention, submodules=inner)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        submodules, self_attention=attention, **layer_changes))
