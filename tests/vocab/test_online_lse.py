"""The pure online log-sum-exp fold: equals logsumexp, in any order, safely at the edges."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_flat.vocab import LSEState, cross_entropy, fold, init_state, logsumexp, merge

# Fold order changes only fp32 rounding: a few ulp per rescale of z, for <= 8 strips here.
FP32 = dict(atol=1e-5, rtol=1e-6)


def _strips(logits: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    edges = [0, *cuts, logits.shape[1]]
    return [(a, logits[:, a:b]) for a, b in zip(edges, edges[1:])]


def _fold_all(logits, labels, cuts, order=None, dtype=torch.float32):
    strips = _strips(logits, cuts)
    state = init_state(logits.shape[0], dtype=dtype)
    for i in order if order is not None else range(len(strips)):
        start, strip = strips[i]
        state = fold(state, strip, labels, start)
    return state


def test_one_strip_equals_logsumexp_and_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, 31) * 3
    labels = torch.randint(0, 31, (9,))
    state = fold(init_state(9), logits, labels)
    ref64 = torch.logsumexp(logits.double(), dim=1)
    torch.testing.assert_close(logsumexp(state).double(), ref64, **FP32)
    ce = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="none")
    torch.testing.assert_close(cross_entropy(state).double(), ce, **FP32)


@pytest.mark.parametrize("cuts", [[1], [5, 6, 20], list(range(1, 31, 4)), [0, 0, 31]])
def test_any_split_and_any_order_gives_the_same_state(cuts) -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 31) * 5
    labels = torch.randint(0, 31, (6,))
    ref = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="none")
    n_strips = len(cuts) + 1
    orders = list(itertools.permutations(range(n_strips)))[:24]
    results = [cross_entropy(_fold_all(logits, labels, cuts, order)) for order in orders]
    for loss in results:
        torch.testing.assert_close(loss.double(), ref, **FP32)
        torch.testing.assert_close(loss, results[0], **FP32)


def test_float64_state_is_exact_to_fp64() -> None:
    torch.manual_seed(2)
    logits = torch.randn(5, 40, dtype=torch.float64) * 10
    labels = torch.randint(0, 40, (5,))
    state = _fold_all(logits, labels, [3, 17, 18, 39], order=[4, 0, 2, 1, 3],
                      dtype=torch.float64)
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(cross_entropy(state), ref, atol=1e-13, rtol=1e-13)


def test_half_strips_are_upcast_into_fp32_state() -> None:
    logits = (torch.randn(4, 12) * 4).to(torch.bfloat16)
    labels = torch.tensor([0, 5, 11, 3])
    state = _fold_all(logits, labels, [4, 8])
    assert state.m.dtype == state.z.dtype == state.t.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="none")
    torch.testing.assert_close(cross_entropy(state).double(), ref, **FP32)


def test_target_is_picked_only_inside_its_strip() -> None:
    logits = torch.arange(12.0).view(2, 6)
    labels = torch.tensor([4, -100])
    state = fold(init_state(2), logits[:, :3], labels, start=0)
    assert state.t.tolist() == [0.0, 0.0]  # label 4 is not in [0, 3); -100 never is
    state = fold(state, logits[:, 3:], labels, start=3)
    assert state.t.tolist() == [4.0, 0.0]


def test_huge_logits_do_not_overflow() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 50, dtype=torch.float64) * 1e4
    logits[0] = 1e4  # a row of equal huge logits: lse = 1e4 + log 50
    logits[1] = -1e4
    labels = torch.randint(0, 50, (8,))
    state = _fold_all(logits.float(), labels, [10, 25, 26])
    lse = logsumexp(state)
    assert torch.isfinite(lse).all() and torch.isfinite(state.z).all()
    ref = torch.logsumexp(logits, dim=1)
    # fp32 represents 1e4 to ~1e-3: the tolerance is relative to the logits' size.
    torch.testing.assert_close(lse.double(), ref, atol=1e4 * 2**-22, rtol=0)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(cross_entropy(state).double(), ce, atol=1e4 * 2**-21, rtol=0)


def test_minus_inf_strips_and_rows_stay_nan_free() -> None:
    ninf = float("-inf")
    logits = torch.tensor([[ninf, ninf, ninf, ninf], [ninf, 1.0, ninf, 2.0],
                           [0.5, ninf, ninf, ninf]])
    labels = torch.tensor([-100, 3, 0])
    state = init_state(3)
    state = fold(state, logits[:, :2], labels, 0)  # row 0 sees only -inf so far
    assert state.m[0] == ninf and state.z[0] == 0 and not torch.isnan(state.z).any()
    state = fold(state, logits[:, 2:], labels, 2)
    assert not torch.isnan(state.m).any() and not torch.isnan(state.z).any()
    lse = logsumexp(state)
    assert lse[0] == ninf  # a row of -inf only: log-sum-exp is -inf, like torch's
    ref = torch.logsumexp(logits.double(), dim=1)
    torch.testing.assert_close(lse[1:].double(), ref[1:], **FP32)
    assert torch.isfinite(cross_entropy(state)[1:]).all()


def test_empty_strip_and_empty_batch() -> None:
    state = fold(init_state(3), torch.randn(3, 4), torch.tensor([1, 2, 3]))
    same = fold(state, torch.empty(3, 0), torch.tensor([1, 2, 3]), start=4)
    assert same is state
    empty = fold(init_state(0), torch.randn(0, 5), torch.empty(0, dtype=torch.long))
    assert empty.m.shape == (0,) and cross_entropy(empty).shape == (0,)
    with pytest.raises(ValueError):
        fold(init_state(3), torch.randn(2, 4))


def test_fold_leaves_its_inputs_alone_unless_told() -> None:
    logits = torch.randn(3, 5)
    keep = logits.clone()
    state = init_state(3)
    fold(state, logits, None)
    assert torch.equal(logits, keep) and torch.isneginf(state.m).all()
    fold(state, logits, None, overwrite=True)
    assert not torch.equal(logits, keep)  # used as scratch


def test_merge_of_disjoint_ranges_equals_one_fold() -> None:
    torch.manual_seed(4)
    logits = torch.randn(7, 20) * 6
    labels = torch.randint(0, 20, (7,))
    a = fold(init_state(7), logits[:, :8], labels, 0)
    b = fold(init_state(7), logits[:, 8:], labels, 8)
    ref = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="none")
    for merged in (merge(a, b), merge(b, a), merge(init_state(7), merge(a, b))):
        torch.testing.assert_close(cross_entropy(merged).double(), ref, **FP32)


def test_pack_round_trip() -> None:
    state = fold(init_state(4), torch.randn(4, 3), torch.tensor([0, 1, 2, 9]))
    again = LSEState.unpack(state.pack())
    for u, v in zip(state, again):
        assert torch.equal(u, v)
