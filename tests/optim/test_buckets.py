"""Bucket planning (pure): layout, coverage, alignment, sizes, runs."""

from __future__ import annotations

import random

import pytest

from megatron_flat.optim import (
    SPLIT_ALIGN,
    STAGING_BYTES_PER_ELEMENT,
    Segment,
    coalesce,
    plan_buckets,
)


def check_plan(numels: list[int], bucket_numel: int, align: int = SPLIT_ALIGN) -> None:
    plan = plan_buckets(numels, bucket_numel, align=align)
    eff = align if bucket_numel >= align else 1
    assert plan.align == eff
    # Layout: params in order, each start aligned, no overlap.
    for i, (off, n) in enumerate(zip(plan.param_offsets, numels)):
        assert off % eff == 0
        if i:
            assert off >= plan.param_offsets[i - 1] + numels[i - 1]
            assert off - (plan.param_offsets[i - 1] + numels[i - 1]) < eff
    # Coverage: every element of every param exactly once, at the right flat position.
    covered = {i: [] for i in range(len(numels))}
    for b, bucket in enumerate(plan.buckets):
        assert bucket.index == b
        assert 0 < bucket.numel <= bucket_numel
        assert bucket.segments and bucket.segments[0].flat_offset == bucket.flat_start
        assert bucket.segments[-1].flat_end == bucket.flat_start + bucket.numel
        for prev, seg in zip(bucket.segments, bucket.segments[1:]):
            assert seg.flat_offset >= prev.flat_end and seg.param_index > prev.param_index
        for seg in bucket.segments:
            assert seg.numel > 0
            assert seg.flat_offset == plan.param_offsets[seg.param_index] + seg.param_offset
            assert seg.param_offset % eff == 0  # split points aligned within the param
            assert 0 <= bucket.staging_offset(seg) < bucket.numel
            covered[seg.param_index].append((seg.param_offset, seg.numel))
    for i, n in enumerate(numels):
        pieces = sorted(covered[i])
        pos = 0
        for start, length in pieces:
            assert start == pos
            pos += length
        assert pos == n
    # Buckets are consecutive windows of the flat layout.
    starts = [b.flat_start for b in plan.buckets]
    assert starts == sorted(starts)
    assert plan.largest_numel == max((b.numel for b in plan.buckets), default=0)
    assert plan.staging_bytes(3) == 3 * plan.largest_numel * STAGING_BYTES_PER_ELEMENT
    if numels:
        assert plan.flat_numel == plan.param_offsets[-1] + numels[-1]


@pytest.mark.parametrize("seed", range(30))
def test_random_plans_cover_every_element_once(seed) -> None:
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 5, 63, 64, 65, 100, 1000, rng.randrange(5000)])
              for _ in range(rng.randrange(1, 12))]
    bucket_numel = rng.choice([1, 7, 63, 64, 65, 128, 500, 1000, 4096, 10**9])
    check_plan(numels, bucket_numel)
    check_plan(numels, bucket_numel, align=1)


def test_worked_example() -> None:
    plan = plan_buckets([100, 30, 200], bucket_numel=150)
    # Flat layout: [0,100) pad to 128, [128,158) pad to 192, [192,392). Window 128.
    assert plan.param_offsets == (0, 128, 192)
    assert plan.window == 128
    assert plan.flat_numel == 392
    got = [[(s.param_index, s.param_offset, s.numel) for s in b.segments] for b in plan.buckets]
    assert got == [
        [(0, 0, 100)],
        [(1, 0, 30), (2, 0, 64)],
        [(2, 64, 128)],
        [(2, 192, 8)],
    ]
    assert [b.numel for b in plan.buckets] == [100, 128, 128, 8]
    assert plan.largest_numel == 128
    assert [len(plan.segments_of(i)) for i in range(3)] == [1, 1, 3]


def test_bucket_bigger_than_model_is_one_bucket_of_whole_params() -> None:
    numels = [10, 0, 1000, 3]
    plan = plan_buckets(numels, bucket_numel=10**9)
    assert len(plan.buckets) == 1
    (bucket,) = plan.buckets
    assert [(s.param_index, s.param_offset, s.numel) for s in bucket.segments] == [
        (0, 0, 10), (2, 0, 1000), (3, 0, 3)
    ]
    assert bucket.numel == plan.flat_numel == plan.largest_numel


def test_small_bucket_drops_alignment() -> None:
    plan = plan_buckets([10, 10], bucket_numel=7)
    assert plan.align == 1 and plan.param_offsets == (0, 10)
    assert [b.numel for b in plan.buckets] == [7, 7, 6]
    assert [[(s.param_index, s.param_offset, s.numel) for s in b.segments]
            for b in plan.buckets] == [[(0, 0, 7)], [(0, 7, 3), (1, 0, 4)], [(1, 4, 6)]]


def test_empty_and_zero_size_params() -> None:
    assert plan_buckets([], 100).buckets == ()
    plan = plan_buckets([0, 0], 100)
    assert plan.buckets == () and plan.largest_numel == 0 and plan.flat_numel == 0


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_bucket_numel(bad) -> None:
    with pytest.raises((ValueError, TypeError)):
        plan_buckets([10], bad)


def test_bad_numels() -> None:
    with pytest.raises(ValueError):
        plan_buckets([10, -1], 10)
    with pytest.raises(TypeError):
        plan_buckets([10.0], 10)


def test_coalesce_runs_span_padding_but_not_skipped_params() -> None:
    segs = [Segment(0, 0, 10, 0), Segment(1, 0, 5, 64), Segment(2, 0, 64, 128),
            Segment(3, 0, 1, 192)]
    assert coalesce(segs, [True] * 4) == [(0, 193)]
    assert coalesce(segs, [True, False, True, True]) == [(0, 10), (128, 193)]
    assert coalesce(segs, [False, True, True, False]) == [(64, 192)]
    assert coalesce(segs, [False] * 4) == []
    with pytest.raises(ValueError):
        coalesce(segs, [True])
