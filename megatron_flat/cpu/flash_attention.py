"""Megatron's core attention computed without its N×N score matrix, for CPU runs.

Megatron-Core's local ``DotProductAttention`` materialises the scores, their softmax and
their gradient: ``heads·N²`` values each, which on a long sequence dwarf every peak the
project flattens. GPU runs use transformer-engine's fused (flash) attention instead, which
keeps ``O(N)`` per head, and the planner models that (``plan.peaks.other_term``).
:class:`FlashCoreAttention` gives CPU runs (the demo and its context sweep) the same memory
behaviour through ``torch.nn.functional.scaled_dot_product_attention``, whose CPU flash
kernel saves only the output and its log-sum-exp.

Same inputs, outputs and math as ``DotProductAttention`` for causal self-attention: query
``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]`` (grouped-query heads repeated), output
``[sq, b, np·hn]``, scaled by ``softmax_scale``. Results agree to fp32 rounding, not bitwise
(the kernel sums in blocks); both runs of a comparison use the same module, so it never
separates stock from flat. Refused: attention dropout in training (its RNG would not follow
Megatron's tracker), a padding mask, packed sequences, attention bias, and — when the module is
built, so that no run computes another model's attention — attention sinks (``softmax_type``
other than ``vanilla``: a softmax offset the kernel has no place for) and sliding-window layers
(``window_size``: the kernel attends to the whole causal prefix).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_flat.attention.replay import flash_attention

__all__ = ["FlashCoreAttention", "with_flash_attention"]


class FlashCoreAttention(DotProductAttention):
    """``DotProductAttention`` through torch's fused attention (see the module doc).

    ``replay``: a ``ReplayStore`` (given by ``megatron.attention_replay.attach``) makes a
    checkpoint's first pass keep the kernel's output and its re-run return it without the
    kernel (``attention.replay``); None (the default): every call runs the kernel."""

    replay = None
    # Declared to megatron.attention_replay: this kernel keeps (O, LSE) and runs its
    # backward from them (attention.replay.flash_attention).
    replay_capable = True

    # Whether this class computes attention sinks and sliding windows itself (the CP
    # attention's masked path); else they are refused when the module is built.
    takes_sinks_and_windows = False

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.takes_sinks_and_windows:
            return
        problems = []
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            problems.append(f"attention sinks (softmax_type={config.softmax_type!r}, "
                            "--softmax-type)")
        if getattr(self.scale_mask_softmax, "window_size", None) is not None:
            problems.append(f"a sliding window on layer {self.layer_number} "
                            f"(window_size={config.window_size}, --window-size)")
        if problems:
            raise ValueError(f"{type(self).__name__} computes plain causal softmax attention and "
                             f"would drop {' and '.join(problems)}: use Megatron's "
                             "DotProductAttention (or transformer-engine's) for this model")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"FlashCoreAttention computes causal attention, got {mask_type}")
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("FlashCoreAttention: no packed sequences or attention bias")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("FlashCoreAttention: attention dropout is not supported "
                             "(set attention_dropout=0)")
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if heads > groups:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = flash_attention(q, k, v, scale=self.softmax_scale, store=self._replay_store(),
                              key=self.layer_number)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _replay_store(self):
        """The store for this call (``megatron.replay_wiring.current_store``)."""
        from megatron_flat.megatron.replay_wiring import current_store

        return current_store(self)


def with_flash_attention(layer_spec):
    """``layer_spec`` (a local GPT layer spec) with :class:`FlashCoreAttention` as its core
    attention."""
    import dataclasses

    attention = layer_spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules,
                                                  core_attention=FlashCoreAttention))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, self_attention=attention))

