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

from typing import Optional, Tuple

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_flat.attention import SequenceTiles, rows_for_tokens, tiled_gather_linear
from megatron_flat.attention import tiled_linear_reduce_scatter

__all__ = ["TiledColumnParallelLinear", "TiledRowParallelLinear"]


class _TileSize:
    """The tile knob shared by both layers (set after construction, or by a subclass)."""

    tile_tokens: int = 0

    def _tiles(self, n_local: int) -> Optional[SequenceTiles]:
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if not self.tile_tokens or tp == 1 or not self.sequence_parallel:
            return None
        return SequenceTiles(n_local, tp, min(rows_for_tokens(self.tile_tokens, tp), n_local))

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
        tp = self.tp_group.size() if self.tp_group is not None else 1
        tiles = self._tiles(input_.shape[0] // tp) if input_.shape[0] % tp == 0 else None
        if tiles is None or not self.input_is_parallel or self.explicit_expert_comm:
            return super().forward(input_)
        output = tiled_linear_reduce_scatter(input_, self.weight, tiles, group=self.tp_group,
                                             main_grad=self._into_main_grad())
        if not self.skip_bias_add:
            return (output + self.bias if self.bias is not None else output), None
        return output, self.bias
