"""Bucket planning for OffloadStreamAdamW: pure (ints in, plan out), no tensors, no devices.

Every parameter gets a range in one *flat layout*: parameters are laid end to end in
param-group order, each starting at a multiple of ``align`` elements (the gaps are
padding that no parameter owns). A bucket is a fixed window of ``window`` flat elements
(``window`` = ``bucket_numel`` rounded down to a multiple of ``align``), trimmed to the
parameter data it holds; windows that hold none are dropped. A parameter larger than a
window, or straddling a window edge, is split across buckets.

Why the alignment: every split point then sits at a multiple of ``align`` elements from
its parameter's start, so an element keeps its offset modulo the vector width inside
each piece. torch's fused CPU AdamW kernel treats a piece's vectorised body and scalar
tail with slightly different arithmetic, so an unaligned split would change the last bits
of a few elements; aligned splits keep the per-element math (and the bits) of the
unsplit parameter. Starts at multiples of 64 fp32 elements are also 256-byte aligned,
which the vectorised CUDA kernels like. With ``bucket_numel < align`` the plan falls back
to ``align = 1`` (no padding, splits anywhere: bitwise for the foreach and single-tensor
kernels, not guaranteed for the fused CPU one).

The same plan serves three layouts: host buffers are indexed by flat offset, a bucket's
staging slot by ``flat offset - bucket.flat_start``, and a parameter by
``Segment.param_offset`` in its flattened view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = [
    "SPLIT_ALIGN",
    "GRAD_STAGING_BYTES_PER_ELEMENT",
    "STAGING_BYTES_PER_ELEMENT",
    "Bucket",
    "BucketPlan",
    "Segment",
    "coalesce",
    "plan_buckets",
]

SPLIT_ALIGN = 64
"""Elements: parameter starts and split points are multiples of this (when it fits)."""

STAGING_BYTES_PER_ELEMENT = 12
"""fp32 master, exp_avg and exp_avg_sq: 3 x 4 bytes per staged element (an fp32 gradient on
the update's device is read where it is)."""

GRAD_STAGING_BYTES_PER_ELEMENT = 4
"""A gradient that cannot be read in place (another dtype or device) is staged as fp32."""


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls in one bucket (never empty)."""

    param_index: int  # position in the flattened param-group order
    param_offset: int  # first element, in the parameter's flattened view
    numel: int
    flat_offset: int  # first element in the flat layout

    @property
    def flat_end(self) -> int:
        return self.flat_offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """One pipeline unit: flat range ``[flat_start, flat_start + numel)``.

    ``numel`` runs from the first segment's start to the last segment's end, so it
    includes padding between segments (staged, never updated) but no trailing padding.
    """

    index: int
    flat_start: int
    numel: int
    segments: tuple[Segment, ...]

    def staging_offset(self, segment: Segment) -> int:
        """Where ``segment`` starts in a staging slot holding this bucket."""
        return segment.flat_offset - self.flat_start


@dataclass(frozen=True)
class BucketPlan:
    """Flat layout and buckets for a list of parameter sizes."""

    numels: tuple[int, ...]
    param_offsets: tuple[int, ...]  # flat offset of each parameter
    flat_numel: int  # end of the last parameter in the flat layout (host buffer size)
    align: int
    window: int  # flat elements per bucket window
    buckets: tuple[Bucket, ...]

    @property
    def largest_numel(self) -> int:
        """Elements of the largest bucket: what one staging slot must hold."""
        return max((b.numel for b in self.buckets), default=0)

    def staging_bytes(self, num_slots: int, staged_grads: bool = False) -> int:
        """Device staging bytes: ``num_slots x largest bucket x 12`` (x 16 with
        ``staged_grads``: gradients that cannot be read in place)."""
        per = STAGING_BYTES_PER_ELEMENT + (GRAD_STAGING_BYTES_PER_ELEMENT if staged_grads else 0)
        return num_slots * self.largest_numel * per

    def segments_of(self, param_index: int) -> list[tuple[Bucket, Segment]]:
        """Every (bucket, segment) holding part of parameter ``param_index``, in order."""
        return [
            (bucket, seg)
            for bucket in self.buckets
            for seg in bucket.segments
            if seg.param_index == param_index
        ]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan_buckets(
    numels: Iterable[int], bucket_numel: int, *, align: int = SPLIT_ALIGN
) -> BucketPlan:
    """Plan the flat layout and the buckets for parameters of sizes ``numels``.

    Every element of every parameter lands in exactly one segment of one bucket; no
    bucket exceeds ``bucket_numel`` elements; zero-size parameters get an (empty) flat
    range and no segment. ``align`` is used as given when ``bucket_numel >= align``,
    else 1.
    """
    sizes = tuple(_check_int("numel", n, 0) for n in numels)
    _check_int("bucket_numel", bucket_numel, 1)
    _check_int("align", align, 1)
    if bucket_numel < align:
        align = 1
    window = bucket_numel // align * align

    offsets = []
    cursor = 0
    for n in sizes:
        offsets.append(cursor)
        cursor = _round_up(cursor + n, align)
    flat_numel = offsets[-1] + sizes[-1] if sizes else 0

    # Split each parameter at window edges, in flat order; group pieces by window.
    by_window: dict[int, list[Segment]] = {}
    for index, (start, n) in enumerate(zip(offsets, sizes)):
        pos = start
        while pos < start + n:
            w = pos // window
            end = min(start + n, (w + 1) * window)
            by_window.setdefault(w, []).append(Segment(index, pos - start, end - pos, pos))
            pos = end

    buckets = []
    for w in sorted(by_window):
        segs = tuple(by_window[w])
        first = segs[0].flat_offset
        buckets.append(Bucket(len(buckets), first, segs[-1].flat_end - first, segs))
    return BucketPlan(sizes, tuple(offsets), flat_numel, align, window, tuple(buckets))


def coalesce(segments: Sequence[Segment], keep: Sequence[bool]) -> list[tuple[int, int]]:
    """Flat ranges covering each maximal run of consecutive kept segments.

    ``segments`` are one bucket's segments in order and ``keep`` flags which to copy.
    A range spans the padding between the segments of its run (no other parameter's
    data lies there), so one copy per range moves a whole run.
    """
    if len(segments) != len(keep):
        raise ValueError("segments and keep differ in length")
    ranges: list[tuple[int, int]] = []
    open_run = False
    for seg, wanted in zip(segments, keep):
        if not wanted:
            open_run = False
        elif open_run:
            ranges[-1] = (ranges[-1][0], seg.flat_end)
        else:
            ranges.append((seg.flat_offset, seg.flat_end))
            open_run = True
    return ranges
