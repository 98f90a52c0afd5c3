"""Core attention with context parallelism for the CPU backend.

Megatron-Core runs context parallelism (CP) only inside transformer-engine's attention;
its local ``DotProductAttention`` refuses ``context_parallel_size > 1``. This module gives
CPU runs (tests, the demo, the rehearsal) an exact CP core attention so every flat
technique can be proven under the layouts long-context plans use. The CPU backend
(``cpu.backend``, patch "core attention under context parallelism") builds it wherever a
spec asks for ``DotProductAttention`` with CP > 1, and says so once in the log. On a GPU the
CPU backend changes nothing: transformer-engine's attention does CP, and this module is
never built.

Layout (Megatron's load-balanced split, what ``get_batch_on_this_cp_rank`` hands each
rank): the sequence is cut into ``2·CP`` chunks of ``c`` tokens; CP rank ``i`` holds chunks
``i`` and ``2·CP−1−i``, in that order. Rotary embeddings are already sliced the same way
by Megatron's ``RotaryEmbedding``, so q and k arrive rotated by their global positions.

Scheme: key/value all-gather. Each rank gathers the K/V of the whole sequence over the CP
group (``O(N)`` per head; the backward of the gather is a reduce-scatter, so every K/V
gradient lands on the rank that owns the token), puts the chunks in global order, and
computes each of its query chunks ``g`` against keys ``[0, (g+1)·c)`` as two flash blocks:
the prefix ``[0, g·c)`` with no mask and the diagonal block causal. The blocks merge by
their log-sum-exps, and the backward runs torch's flash backward per block with the merged
output and log-sum-exp, which gives each block's exact share of the gradient (the ring-
attention identity). No ``N×N`` score, softmax or mask tensor is ever built.

Results agree with single-rank causal attention to fp32 rounding (blocks sum in another
order), forward and backward. Attention sinks and sliding windows take a masked path
(:class:`ContextParallelCoreAttention`). Refused, as for ``FlashCoreAttention``: attention
dropout in training, padding masks, packed sequences and attention bias.
"""

from __future__ import annotations

import copy
from typing import List

import torch
import torch.distributed as dist

from megatron_flat.cpu.flash_attention import FlashCoreAttention

__all__ = ["ContextParallelCoreAttention", "load_balanced_chunks", "gather_sequence",
           "attention_flops"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - tensor.shape[-1]
    return tensor if extra == 0 else torch.nn.functional.pad(tensor, (0, extra))


def _flash(q, k, v, dropout, causal, *, scale):
    """torch's CPU flash kernel (O, LSE), also for values narrower or wider than queries and
    keys (multi-latent attention): the kernel wants one head size, so the narrower side is
    padded with zero columns, which change neither Q·Kᵀ nor the softmax (the scale is given),
    and the output keeps the values' width."""
    width = max(q.shape[-1], v.shape[-1])
    out, lse = _FLASH(_pad(q, width), _pad(k, width), _pad(v, width), dropout, causal,
                      scale=scale)[:2]
    return out[..., :v.shape[-1]], lse


def _flash_backward(grad_out, q, k, v, out, lse, dropout, causal, *, scale):
    """dq, dk, dv of :func:`_flash`: the zero columns of the padded operands get zero
    gradients and are dropped (the padded output's extra columns are exactly zero)."""
    width = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = _FLASH_BACKWARD(_pad(grad_out, width), _pad(q, width), _pad(k, width),
                                 _pad(v, width), _pad(out, width), lse, dropout, causal,
                                 scale=scale)[:3]
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


def load_balanced_chunks(cp_rank: int, cp_size: int) -> List[int]:
    """The global chunk indices CP rank ``cp_rank`` holds, in its local order (of ``2·cp_size``
    chunks): ``[cp_rank, 2·cp_size − 1 − cp_rank]``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} outside a CP group of {cp_size}")
    return [cp_rank, 2 * cp_size - 1 - cp_rank]


def _global_order(cp_size: int) -> torch.Tensor:
    """Positions, in the gathered ``[rank 0's 2 chunks, rank 1's 2 chunks, ...]`` layout, of
    global chunks ``0 .. 2·cp_size−1``."""
    where = {}
    for rank in range(cp_size):
        for slot, chunk in enumerate(load_balanced_chunks(rank, cp_size)):
            where[chunk] = 2 * rank + slot
    return torch.tensor([where[j] for j in range(2 * cp_size)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: reduce-scatter (sum) of the grad."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = tensor.new_empty((size * tensor.shape[0],) + tuple(tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` ([s_local, ...], this rank's two chunks) of every CP rank, in global sequence
    order ([2·CP·c, ...]); differentiable (the gradient goes back to the owning rank)."""
    size = dist.get_world_size(group)
    gathered = _GatherSequence.apply(tensor, group)
    chunk = tensor.shape[0] // 2
    pieces = gathered.view((2 * size, chunk) + tuple(tensor.shape[1:]))
    return pieces[_global_order(size)].flatten(0, 1)


def _prefix_forward(q, k, v, scale):
    """(O, LSE) of queries ``q`` ([b, n, c, d], one chunk at global positions ``[T−c, T)``)
    against keys and values ``[b, n, T, d]`` (positions ``[0, T)``), causal by global
    position."""
    c, total = q.shape[2], k.shape[2]
    out, lse = _flash(q, k[:, :, total - c:], v[:, :, total - c:], 0.0, True, scale=scale)
    if total > c:
        prefix_out, prefix_lse = _flash(q, k[:, :, :total - c], v[:, :, :total - c], 0.0,
                                        False, scale=scale)
        merged = torch.logaddexp(prefix_lse, lse)
        # Merged in fp32 (the lse is), returned in the queries' dtype as a flash kernel
        # writes O: a bf16 model's output projection takes bf16.
        out = (prefix_out * torch.exp(prefix_lse - merged).unsqueeze(-1)
               + out * torch.exp(lse - merged).unsqueeze(-1)).to(q.dtype)
        lse = merged
    return out, lse


def _prefix_backward(grad_out, q, k, v, out, lse, scale):
    """dq, dk, dv of :func:`_prefix_forward` from its merged output and log-sum-exp."""
    c, total = q.shape[2], k.shape[2]
    grad_out = grad_out.contiguous()
    dq, dk, dv = _flash_backward(grad_out, q, k[:, :, total - c:], v[:, :, total - c:],
                                 out, lse, 0.0, True, scale=scale)
    if total > c:
        dq_prefix, dk_prefix, dv_prefix = _flash_backward(
            grad_out, q, k[:, :, :total - c], v[:, :, :total - c], out, lse, 0.0, False,
            scale=scale)
        dq = dq + dq_prefix
        dk = torch.cat([dk_prefix, dk], dim=2)
        dv = torch.cat([dv_prefix, dv], dim=2)
    return dq, dk, dv


class _PrefixCausalAttention(torch.autograd.Function):
    """:func:`_prefix_forward` with its backward. With ``kept`` (attention replay's re-run:
    the first pass's (O, LSE)), the forward returns the kept O without the kernels and the
    backward is the same, on the same saved tensors."""

    @staticmethod
    def forward(ctx, q, k, v, scale, kept_out=None, kept_lse=None):
        if kept_out is None:
            out, lse = _prefix_forward(q, k, v, scale)
        else:
            out, lse = kept_out, kept_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return _prefix_backward(grad_out, q, k, v, out, lse, ctx.scale) + (None, None, None)


def attention_flops(seq: int, cp_size: int, heads: int, head_dim: int, batch: int = 1) -> int:
    """Matmul FLOPs of one rank's causal core attention forward (QKᵀ and PV, scores above the
    diagonal skipped) under this module's split: each local chunk ``g`` costs its prefix
    ``g·c`` keys in full plus half the diagonal block. Equal on every CP rank."""
    if seq % (2 * cp_size):
        raise ValueError(f"sequence {seq} does not split into 2·CP = {2 * cp_size} chunks")
    c = seq // (2 * cp_size)
    keys = sum(g * c * c + c * (c + 1) // 2 for g in load_balanced_chunks(0, cp_size))
    return 4 * batch * heads * head_dim * keys


class ContextParallelCoreAttention(FlashCoreAttention):
    """``FlashCoreAttention`` over a context-parallel group (see the module doc).

    With CP 1 it is ``FlashCoreAttention``. Inputs are Megatron's: query ``[sq, b, np, hn]``,
    key and value ``[sk, b, ng, hn]`` for this rank's two chunks (``sq = sk = 2·c``); output
    ``[sq, b, np·hn]``.

    Attention sinks (``softmax_type`` ``learnable`` or ``off-by-one``: Megatron's
    ``softmax_offset``, one logit per head beside every row's scores) and a sliding window
    (this layer's ``window_size`` ``(left, 0)``: a query sees the keys at most ``left``
    positions back) run a masked path instead of the flash blocks: each query chunk's scores
    against its keys, masked as Megatron's ``get_sliding_window_causal_mask`` (filled with
    -10000, as Megatron's mask function does), softmax with the offset's column appended and
    dropped, as Megatron's ``SoftmaxOne``, in fp32, then the values. It builds a chunk's
    ``c × (g+1)·c`` scores (a rehearsal's sizes); such layers keep nothing for attention
    replay (a store's re-runs count as stock).
    """

    takes_sinks_and_windows = True

    def __init__(self, config, *args, **kwargs):
        cp_size = config.context_parallel_size
        # DotProductAttention refuses CP > 1 (its CP is transformer-engine's); this module
        # brings its own, so the parent is built as for CP 1.
        plain = copy.copy(config)
        object.__setattr__(plain, "context_parallel_size", 1)
        super().__init__(plain, *args, **kwargs)
        self.config = config
        self.cp_size = cp_size
        self._cp_group = None
        pg = kwargs.get("pg_collection")
        if pg is not None and hasattr(pg, "cp"):
            self._cp_group = pg.cp

    @property
    def cp_group(self):
        if self._cp_group is None:
            from megatron.core import parallel_state

            self._cp_group = parallel_state.get_context_parallel_group()
        return self._cp_group

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if self.cp_size == 1:
            if self._masked():  # the flash kernel has no sinks or windows
                raise ValueError("ContextParallelCoreAttention computes sinks and sliding "
                                 "windows under context parallelism only; with CP 1 use "
                                 "Megatron's DotProductAttention")
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params, **kwargs)
        self._check(attn_mask_type, attention_bias, packed_seq_params)
        group = self.cp_group
        if dist.get_world_size(group) != self.cp_size:
            raise ValueError(f"CP group has {dist.get_world_size(group)} ranks, the config says "
                             f"context_parallel_size={self.cp_size}")
        local = query.shape[0]
        if local % 2 or key.shape[0] != local:
            raise ValueError(f"CP attention needs this rank's two equal chunks of queries and "
                             f"keys; got {local} queries, {key.shape[0]} keys")
        key, value = gather_sequence(key, group), gather_sequence(value, group)
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if heads > groups:  # grouped-query heads: gathered first, repeated here (less traffic)
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        c, b = local // 2, query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        chunks = load_balanced_chunks(dist.get_rank(group), self.cp_size)
        slots = [(q[:, :, slot * c:(slot + 1) * c].contiguous(),
                  k[:, :, :(chunk + 1) * c].contiguous(), v[:, :, :(chunk + 1) * c].contiguous())
                 for slot, chunk in enumerate(chunks)]
        if self._masked():
            out = torch.cat(self._attend_masked(slots, chunks, c), dim=2)
        else:
            out = torch.cat(self._attend(slots, self.softmax_scale), dim=2)
        return out.permute(2, 0, 1, 3).reshape(local, b, self.hidden_size_per_partition)

    def _window(self):
        return getattr(self.scale_mask_softmax, "window_size", None)

    def _masked(self) -> bool:
        """Sinks or a window on this layer: the masked path (the class doc)."""
        return getattr(self, "softmax_offset", None) is not None or self._window() is not None

    def _attend_masked(self, slots, chunks, c: int) -> List[torch.Tensor]:
        """Each slot's output on the masked path (the class doc); ``chunks``: the global
        chunk index of each slot's queries, ``c`` tokens a chunk."""
        window = self._window()
        if window is not None and window[1] != 0:
            raise ValueError(f"ContextParallelCoreAttention: a window reaching {window[1]} "
                             "keys past the query (window_size right side) is not causal")
        store = self._replay_store()
        if store is not None:
            from megatron_flat.megatron.replay_wiring import warn_once

            warn_once("cpu-cp-masked", "megatron-flat: --flat-attn-replay: the CPU backend's "
                      "context-parallel attention keeps nothing on layers with attention sinks "
                      "or a sliding window (its masked path has no log-sum-exp to replay "
                      "from); those layers recompute attention as stock does")
            if torch.is_grad_enabled():
                store.kernel_forwards += 1
                store.stock_reruns += 1  # nothing kept for a masked layer: its re-run is stock
        offset = getattr(self, "softmax_offset", None)
        outs = []
        for (q, k, v), chunk in zip(slots, chunks):
            scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
            rows = torch.arange(chunk * c, (chunk + 1) * c).unsqueeze(1)
            cols = torch.arange(k.shape[2]).unsqueeze(0)
            hidden = cols > rows
            if window is not None:
                hidden = hidden | (cols < rows - window[0])
            scores = scores.masked_fill(hidden, -10000.0)
            if offset is not None:
                sink = offset.float().reshape(1, -1, 1, 1).expand(
                    scores.shape[0], -1, scores.shape[2], 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            outs.append(torch.matmul(probs.to(v.dtype), v))
        return outs

    def _attend(self, slots, scale):
        """Each slot's output; with attention replay (``attention.replay``) the first pass
        keeps every slot's (O, LSE) (what the CP backward needs beside the gathered K/V,
        which the re-run gathers again) and the re-run returns them without the kernels."""
        store = self._replay_store()
        if store is None:
            return [_PrefixCausalAttention.apply(*slot, scale) for slot in slots]
        if not torch.is_grad_enabled():  # the first pass
            pairs = [_prefix_forward(*slot, scale) for slot in slots]
            store.kernel_forwards += 1
            store.keep(self.layer_number, *[t for pair in pairs for t in pair])
            return [out for out, _ in pairs]
        kept = store.take(self.layer_number)
        if kept is None:  # not kept (no room in the host pool): the kernels run
            store.kernel_forwards += 1
            store.stock_reruns += 1
            return [_PrefixCausalAttention.apply(*slot, scale) for slot in slots]
        if len(kept) != 2 * len(slots) or any(
                kept[2 * i].shape != slot[0].shape[:-1] + slot[2].shape[-1:]
                for i, slot in enumerate(slots)):
            raise RuntimeError(f"attention replay: the kept outputs do not fit this call's "
                               f"queries (layer {self.layer_number}): the re-runs did not "
                               "come in the first passes' order")
        store.replays += 1
        return [_PrefixCausalAttention.apply(*slot, scale, kept[2 * i], kept[2 * i + 1])
                for i, slot in enumerate(slots)]

    def _check(self, attn_mask_type, attention_bias, packed_seq_params) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"ContextParallelCoreAttention computes causal attention, got "
                             f"{mask_type}")
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ContextParallelCoreAttention: no packed sequences or attention bias")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("ContextParallelCoreAttention: attention dropout is not supported "
                             "(set attention_dropout=0)")
