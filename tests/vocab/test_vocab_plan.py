"""The Ring-DTP plan: every rank turns the same gathered table into the same plan or error."""

from __future__ import annotations

import pytest
import torch

from megatron_flat.vocab import DEFAULT_BLOCK_SIZE, resolve_mode
from megatron_flat.vocab.plan import (
    describe_rank,
    error_row,
    make_plan,
    raise_for_peer_errors,
)


def _row(n=4, rows=8, hidden=3, mode="auto", labels=None, vocab_start=None, vocab_size=None,
         block_size=None, dtype=torch.float32, mask=None):
    x = torch.zeros(n, hidden, dtype=dtype)
    w = torch.zeros(rows, hidden, dtype=dtype)
    labels = torch.zeros(n, dtype=torch.long) if labels is None else torch.tensor(labels)
    active = labels != -100 if mask is None else torch.tensor(mask)
    return describe_rank(x, w, labels, active, mode=mode, vocab_start=vocab_start,
                         vocab_size=vocab_size, block_size=block_size)


def _table(*rows):
    return torch.stack(rows)


def test_auto_moves_the_smaller_operand() -> None:
    assert resolve_mode("auto", max_tokens=100, max_rows=100, world=4) == "activations"
    assert resolve_mode("auto", max_tokens=101, max_rows=100, world=4) == "weights"
    assert resolve_mode("weights", 1, 100, 4) == "weights"
    assert resolve_mode("activations", 1000, 100, 2) == "activations"
    assert resolve_mode("weights", 1, 100, 1) == "blocked"
    with pytest.raises(ValueError, match="mode"):
        resolve_mode("ring", 1, 1, 2)


def test_auto_uses_the_largest_rank_so_all_ranks_agree() -> None:
    # Rank 0 alone would pick activations (3 <= 8), rank 1 weights (9 > 8): both get weights.
    table = _table(_row(n=3), _row(n=9))
    assert {make_plan(table, r).mode for r in (0, 1)} == {"weights"}


def test_defaults_starts_vocab_size_and_blocks() -> None:
    plan = make_plan(_table(_row(rows=8), _row(rows=8), _row(rows=8)), rank=2)
    assert plan.starts == (0, 8, 16) and plan.vocab_size == 24
    assert plan.block_size == 8 and plan.blocks(1) == [(0, 8)]
    single = make_plan(_table(_row(rows=8)), rank=0)
    assert single.mode == "blocked" and single.block_size == DEFAULT_BLOCK_SIZE


def test_padding_rows_are_not_in_any_block() -> None:
    rows = [_row(rows=8, vocab_size=21, block_size=3) for _ in range(3)]
    plan = make_plan(_table(*rows), rank=0)
    assert [plan.valid_rows(q) for q in range(3)] == [8, 8, 5]
    assert plan.blocks(2) == [(0, 2), (2, 5)]
    assert plan.blocks(0) == [(0, 2), (2, 5), (5, 8)]  # equal widths, no sliver
    plan = make_plan(_table(*[_row(rows=8, vocab_size=13) for _ in range(3)]), rank=0)
    assert plan.valid_rows(2) == 0 and plan.blocks(2) == []  # a shard of padding only


def test_strips_are_balanced_and_never_wider_than_block_size() -> None:
    for valid in (1, 7, 25, 100):
        for block in (1, 3, 8, 25, 200):
            rows = [_row(rows=valid, block_size=block)]
            blocks = make_plan(_table(*rows), 0).blocks(0)
            widths = [b - a for a, b in blocks]
            assert blocks[0][0] == 0 and blocks[-1][1] == valid
            assert all(a == b for (_, a), (b, _) in zip(blocks, blocks[1:]))
            assert max(widths) <= block and max(widths) - min(widths) <= 1
            assert len(blocks) == -(-valid // block)


def test_uneven_shards_and_explicit_starts() -> None:
    plan = make_plan(_table(_row(rows=5), _row(rows=3)), rank=1)
    assert plan.starts == (0, 5) and plan.vocab_size == 8
    # Shards may be in any order on the ring.
    plan = make_plan(_table(_row(rows=4, vocab_start=4), _row(rows=4, vocab_start=0)), rank=0)
    assert plan.starts == (4, 0) and plan.vocab_size == 8


@pytest.mark.parametrize("starts, match", [((0, 3), "overlaps"), ((0, 5), "gap")])
def test_shards_must_tile_the_vocabulary(starts, match) -> None:
    table = _table(_row(rows=4, vocab_start=starts[0]), _row(rows=4, vocab_start=starts[1]))
    with pytest.raises(ValueError, match=match):
        make_plan(table, 0)
    with pytest.raises(ValueError, match="cover"):
        make_plan(_table(_row(rows=4, vocab_size=9), _row(rows=4, vocab_size=9)), 0)


@pytest.mark.parametrize("field, a, b", [
    ("hidden", dict(hidden=3), dict(hidden=4)),
    ("mode", dict(mode="weights"), dict(mode="auto")),
    ("vocab_size", dict(vocab_size=15), dict(vocab_size=16)),
    ("block_size", dict(block_size=2), dict()),
    ("dtype", dict(dtype=torch.bfloat16), dict()),
])
def test_ranks_must_agree(field, a, b) -> None:
    with pytest.raises(ValueError, match=f"disagree on {field}"):
        make_plan(_table(_row(**a), _row(**b)), 0)


def test_labels_outside_the_vocabulary_are_rejected_for_every_rank() -> None:
    good = _row(rows=8, vocab_size=14, labels=[0, 13, -100, 5])
    padded = _row(rows=8, vocab_size=14, labels=[1, 14, 2, 3])  # 14 is a padded row
    table = _table(good, padded)
    for rank in (0, 1):  # the same error on both ranks
        with pytest.raises(ValueError, match=r"rank 1: labels in \[1, 14\].*padded"):
            make_plan(table, rank)
    negative = _row(rows=8, labels=[-1, 2, 3, 4])
    with pytest.raises(ValueError, match="rank 0"):
        make_plan(_table(negative, _row(rows=8)), 1)
    masked = _row(rows=8, labels=[99, 2, 3, 4], mask=[False, True, True, True])
    assert make_plan(_table(masked, _row(rows=8)), 0).vocab_size == 16


def test_bad_arguments_are_reported_through_the_table() -> None:
    with pytest.raises(ValueError, match="mode"):
        _row(mode="ring")
    with pytest.raises(ValueError, match="block_size"):
        _row(block_size=0)
    raise_for_peer_errors(_table(_row(), _row()))
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):
        raise_for_peer_errors(_table(_row(), error_row()))


def test_needs_grad_flags_are_or_ed() -> None:
    x = torch.zeros(2, 3, requires_grad=True)
    w = torch.zeros(4, 3)
    lab = torch.zeros(2, dtype=torch.long)
    kw = dict(mode="auto", vocab_start=None, vocab_size=None, block_size=None)
    a = describe_rank(x, w, lab, lab >= 0, **kw)
    b = describe_rank(x.detach(), w, lab, lab >= 0, **kw)
    plan = make_plan(_table(a, b), 1)
    assert plan.needs_dx and not plan.needs_dw
