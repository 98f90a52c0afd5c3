"""Megatron's distributed-optimizer layout of a parameter list, computed without a buffer.

Param offload keeps the routed experts out of DDP's buffers, yet wherever Megatron's
distributed optimizer would have sharded them, anything that must equal it bit for bit
(the gradient norm's partial sums, the host optimizer state each expert-DP replica owns)
has to cut them at the same places. This module states Megatron's rule as pure arithmetic
over parameter sizes, the same in megatron-core 0.16 (``_ParamAndGradBuffer.__init__``)
and 0.19 (``DistributedOptimizer._compute_per_buffer_param_layout``):

* Buffer: parameters in reverse order (backward order); each starts at a multiple of 64
  elements; a bucket closes once it holds ``bucket_size`` elements or more (never when
  ``bucket_size`` is None), and a shared-embedding parameter gets a bucket of its own; each
  bucket's end is padded to a multiple of lcm(world, 128) (lcm(world, 128, 2¹⁶) with
  ``pad_buckets_for_high_nccl_busbw``).
* Shards (``DistributedOptimizer._build_model_gbuf_range``): each bucket splits into
  ``world`` equal ranges, rank r owning the r-th; a parameter's piece on r is its overlap
  with that range (possibly empty, possibly the whole parameter).
* Order (``_build_optimizer_group_ranges`` and ``_build_model_and_main_param_groups``):
  the optimizer lists each param group's pieces in buffer order, fp32 parameters' pieces
  before 16-bit ones', and reads them in that order for the norm.

``tests/megatron/test_distopt_layout_world2.py`` checks every figure against the buffers
and ranges Megatron itself builds, on both versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["BufferLayout", "Piece", "buffer_layout", "group_order"]

PARAM_ALIGN = 64  # elements: a parameter starts 128-byte aligned at 16 bits
BUCKET_ALIGN = 128  # elements: a bucket ends 256-byte aligned
HIGH_BUSBW_ALIGN = 2 ** 16


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (an index into the laid-out list),
    flattened, that one rank owns."""

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BufferLayout:
    """Where each parameter sits in the buffer Megatron would build, and its buckets."""

    index: Tuple[Tuple[int, int, int], ...]  # per parameter: (start, end, bucket)
    buckets: Tuple[Tuple[int, int], ...]  # per bucket: (start, end), end padded
    world: int  # the data-parallel size the buckets are padded and split for

    @property
    def numel(self) -> int:
        """The buffer's size, padding included."""
        return self.buckets[-1][1] if self.buckets else 0

    def rank_range(self, bucket: int, rank: int) -> Tuple[int, int]:
        """The buffer range rank ``rank`` owns in bucket ``bucket``."""
        start, end = self.buckets[bucket]
        size = (end - start) // self.world
        return start + rank * size, min(end, start + (rank + 1) * size)

    def pieces(self, rank: int) -> List[Piece]:
        """Rank ``rank``'s pieces in buffer order (bucket by bucket; within one, the
        parameters in reverse list order), empty overlaps left out."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a data-parallel group of {self.world}")
        order = sorted(range(len(self.index)), key=lambda i: self.index[i][0])
        out = []
        for bucket in range(len(self.buckets)):
            lo, hi = self.rank_range(bucket, rank)
            for i in order:
                start, end, owner = self.index[i]
                if owner != bucket:
                    continue
                a, b = max(start, lo), min(end, hi)
                if b > a:
                    out.append(Piece(i, a - start, b - start))
        return out


def buffer_layout(numels: Sequence[int], world: int, bucket_size: Optional[int] = None,
                  pad_for_high_nccl_busbw: bool = False,
                  shared_embedding: Optional[Sequence[bool]] = None) -> BufferLayout:
    """The layout of parameters of sizes ``numels`` (in the order DDP collects them: the
    module's ``named_parameters()``) in a distributed-optimizer buffer over ``world``
    data-parallel ranks (module doc)."""
    if world < 1:
        raise ValueError(f"data-parallel size {world}: expected >= 1")
    if any(n < 0 for n in numels):
        raise ValueError("parameter sizes must be >= 0")
    shared = list(shared_embedding) if shared_embedding is not None else [False] * len(numels)
    if len(shared) != len(numels):
        raise ValueError("shared_embedding: one flag per parameter")
    divisor = math.lcm(world, BUCKET_ALIGN, HIGH_BUSBW_ALIGN) if pad_for_high_nccl_busbw \
        else math.lcm(world, BUCKET_ALIGN)
    index: List[Optional[Tuple[int, int, int]]] = [None] * len(numels)
    buckets: List[Tuple[int, int]] = []
    bucket_start = param_start = 0
    held = 0  # parameters in the open bucket

    def close(end: int) -> int:
        nonlocal bucket_start, held
        padded = _pad(end, divisor)
        buckets.append((bucket_start, padded))
        bucket_start, held = padded, 0
        return padded

    end = 0
    for i in reversed(range(len(numels))):
        param_start = _pad(param_start, PARAM_ALIGN)
        if shared[i] and held:
            param_start = close(param_start)
        end = param_start + numels[i]
        index[i] = (param_start, end, len(buckets))
        held += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared[i]:
            param_start = close(end)
        else:
            param_start = end
    if held:
        close(end)
    return BufferLayout(tuple(index), tuple(buckets), world)


def group_order(pieces: Sequence[Piece], group_of: Sequence[int], is_fp32: Sequence[bool],
                num_groups: Optional[int] = None) -> List[List[Piece]]:
    """``pieces`` (one rank's, in buffer order) as the distributed optimizer lists them:
    one list per param group (``group_of[param]``, groups numbered from 0; ``num_groups``
    lists, or as many as the highest number needs), fp32 parameters' pieces first, each
    kind in buffer order."""
    groups = max(max(group_of, default=-1) + 1, num_groups or 0)
    out: List[List[Piece]] = [[] for _ in range(groups)]
    for fp32 in (True, False):
        for piece in pieces:
            if bool(is_fp32[piece.param]) == fp32:
                out[group_of[piece.param]].append(piece)
    return out


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor
