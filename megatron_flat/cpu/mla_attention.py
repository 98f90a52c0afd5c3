"""Core attention for multi-latent attention (MLA) in the CPU backend.

Megatron-Core's MLA (``MLASelfAttention``: DeepSeek-V3, Kimi K2) builds its core attention with
``k_channels`` (the query/key head dim: ``qk_head_dim + qk_pos_emb_head_dim``) and
``v_channels`` (``v_head_dim``), which differ. On a GPU that core attention is
transformer-engine's; Megatron-Core's local ``DotProductAttention``, the CPU's, takes neither
argument, so an MLA line cannot even be built without transformer-engine.

:class:`MLADotProductAttention` is ``DotProductAttention`` that accepts them: its forward is the
stock one (scaled ``Q·Kᵀ`` with MLA's softmax scale, the stock mask/softmax and attention
dropout under the RNG tracker, ``P·V``), which already reads each head dim from its tensors; only
the output width changes to ``heads × v_channels``. The CPU backend (``cpu.backend``, patch "MLA
core attention") builds it wherever a spec asks for ``DotProductAttention`` with these
arguments, in stock and flat runs alike, and says so once in the log. On a GPU nothing changes.

Under context parallelism (CP > 1) Megatron's local attention has no CP at all; the CPU
backend's :class:`~megatron_flat.cpu.context_attention.ContextParallelCoreAttention`
(K/V all-gather, blocks merged by log-sum-exp) already reads each head dim from its tensors, so
:class:`MLAContextParallelCoreAttention` is that module with MLA's head dims.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["MLAContextParallelCoreAttention", "MLADotProductAttention", "announce_once"]

log = logging.getLogger(__name__)
_ANNOUNCED: List[bool] = []


def announce_once() -> None:
    """Log the substitution once per process."""
    if not _ANNOUNCED:
        _ANNOUNCED.append(True)
        log.warning("megatron-flat CPU backend: multi-latent attention's core attention is "
                    "MLADotProductAttention (Megatron's local DotProductAttention with separate "
                    "q/k and v head dims; transformer-engine's attention on a GPU)")


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` with MLA's head dims: ``k_channels`` for queries and keys,
    ``v_channels`` for values and the output (``[s, b, heads/TP × v_channels]``). Exact: the
    stock forward, unchanged."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 **kwargs: Any):
        if softmax_scale is None and k_channels is not None:
            softmax_scale = k_channels ** -0.5
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


def _context_parallel_base():
    from megatron_flat.cpu.context_attention import ContextParallelCoreAttention

    return ContextParallelCoreAttention


class MLAContextParallelCoreAttention(_context_parallel_base(), MLADotProductAttention):
    """The CPU backend's context-parallel core attention with MLA's head dims: queries and keys
    of ``k_channels``, values and the output of ``v_channels`` (``MLADotProductAttention``'s
    constructor, ``ContextParallelCoreAttention``'s forward)."""
