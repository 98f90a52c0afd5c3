"""megatron.distopt_layout's arithmetic on hand-checked cases (Megatron's own buffers:
test_distopt_layout_worlds.py)."""

import pytest

from megatron_flat.megatron.distopt_layout import Piece, buffer_layout, group_order


def test_one_bucket_reverses_aligns_and_pads():
    # params 0..2 of 100, 10, 300 elements: laid out 2, 1, 0; starts at multiples of 64
    got = buffer_layout([100, 10, 300], world=2)
    assert got.index == ((384, 484, 0), (320, 330, 0), (0, 300, 0))
    assert got.buckets == ((0, 512),)  # 484 padded to lcm(2, 128)
    assert got.pieces(0) == [Piece(2, 0, 256)]
    assert got.pieces(1) == [Piece(2, 256, 300), Piece(1, 0, 10), Piece(0, 0, 100)]


def test_buckets_close_at_the_size_and_each_is_split():
    got = buffer_layout([100, 10, 300], world=3, bucket_size=300)
    # param 2 fills bucket 0 (300 >= 300); 1 and 0 share bucket 1, 0 starting at 448
    assert got.index == ((448, 548, 1), (384, 394, 1), (0, 300, 0))
    assert got.buckets == ((0, 384), (384, 768))  # ends padded to lcm(3, 128) = 384
    assert got.rank_range(1, 0) == (384, 512)
    assert got.pieces(0) == [Piece(2, 0, 128), Piece(1, 0, 10), Piece(0, 0, 64)]
    assert got.pieces(1) == [Piece(2, 128, 256), Piece(0, 64, 100)]
    assert got.pieces(2) == [Piece(2, 256, 300)]
    # every element of every parameter is owned exactly once
    for i, n in enumerate([100, 10, 300]):
        owned = sorted((x.start, x.stop) for r in range(3) for x in got.pieces(r)
                       if x.param == i)
        assert owned[0][0] == 0 and owned[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(owned, owned[1:]))


def test_shared_embedding_gets_its_own_bucket_and_busbw_padding():
    got = buffer_layout([50, 60, 70], world=2, shared_embedding=[False, True, False])
    assert got.index == ((256, 306, 2), (128, 188, 1), (0, 70, 0))
    assert got.buckets == ((0, 128), (128, 256), (256, 384))
    wide = buffer_layout([50], world=2, pad_for_high_nccl_busbw=True)
    assert wide.buckets == ((0, 2 ** 16),)
    assert buffer_layout([], world=4).buckets == ()


def test_group_order_puts_fp32_first_per_group():
    pieces = [Piece(3, 0, 5), Piece(2, 0, 5), Piece(1, 0, 5), Piece(0, 0, 5)]
    order = group_order(pieces, group_of=[0, 1, 0, 1], is_fp32=[False, True, True, False],
                        num_groups=3)
    assert order == [[Piece(2, 0, 5), Piece(0, 0, 5)], [Piece(1, 0, 5), Piece(3, 0, 5)], []]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="data-parallel size 0"):
        buffer_layout([1], world=0)
    with pytest.raises(ValueError, match="one flag per parameter"):
        buffer_layout([1, 2], world=1, shared_embedding=[True])
    with pytest.raises(ValueError, match="rank 2 outside"):
        buffer_layout([1], world=2).pieces(2)
