"""The attention block's working set: sequence tiles for its sequence-parallel projections.

``tiles`` plans them (pure), ``tiled_linear`` runs the QKV projection (gather, project, free
one tile at a time) and the output projection (project, reduce-scatter one tile at a time)
with autograd, so the gathered N × H input and the N × H partial output never exist.
"""

from megatron_flat.attention.tiled_linear import tiled_gather_linear, tiled_linear_reduce_scatter
from megatron_flat.attention.tiles import SequenceTiles, rows_for_bytes, rows_for_tokens

__all__ = ["SequenceTiles", "rows_for_bytes", "rows_for_tokens", "tiled_gather_linear",
           "tiled_linear_reduce_scatter"]
