"""Ring-DTP cross-entropy on one device (no group): the blocked version, P = 1.

Compared with a dense float64 reference; tolerances in ``tests/vocab/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_flat.runtime import MemoryMeter
from megatron_flat.vocab import ring_dtp_cross_entropy

V = 37  # prime: no block size divides it


@pytest.mark.parametrize("block_size", [1, 3, 8, V, 1000, None])
def test_matches_dense_for_any_block_size(block_size, ring_ref) -> None:
    p = ring_ref.make_problem([24], V, hidden=16, seed=1)
    ring_ref.check_rank(p, 0, block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(dtype, ring_ref) -> None:
    p = ring_ref.make_problem([20], V, hidden=16, dtype=dtype, seed=2)
    ring_ref.check_rank(p, 0, block_size=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("ddp, tied", [(True, False), (True, True), (False, False)])
def test_weight_gradient_accumulates_into_main_grad(dtype, ddp, tied, ring_ref) -> None:
    p = ring_ref.make_problem([20], V, hidden=16, rows=48, dtype=dtype, seed=4)
    ring_ref.check_main_grad(p, 0, ddp=ddp, tied=tied, block_size=5)


def test_main_grad_of_another_dtype_is_left_to_ddp(ring_ref) -> None:
    # A bf16 main_grad cannot take fp32 strips in place: the gradient comes back as .grad.
    p = ring_ref.make_problem([12], V, hidden=8, dtype=torch.bfloat16, seed=5)
    x = p.x.to(p.dtype).requires_grad_()
    w = torch.nn.Parameter(p.w.to(p.dtype))
    w.main_grad = torch.zeros_like(w)
    w.grad_added_to_main_grad = False
    loss = ring_dtp_cross_entropy(x, w, p.labels, vocab_size=V)
    loss.backward(p.grad.to(loss.dtype))
    assert not w.main_grad.any() and w.grad_added_to_main_grad is False
    _, _, dw = ring_ref.run_rank(p, 0)
    assert torch.equal(w.grad, dw)


def test_padded_rows_never_contribute_and_get_zero_grad(ring_ref) -> None:
    # 37 real ids in a 48-row (padded) weight; the padded rows hold random values.
    ring_ref.check_rank(ring_ref.make_problem([16], V, rows=48, seed=3), 0, block_size=7)


def test_masked_and_ignored_tokens(ring_ref) -> None:
    p = ring_ref.make_problem([30], V, rows=40, seed=4, mask_every=3, ignore_every=4)
    ring_ref.check_rank(p, 0, block_size=6)
    loss, dx, _ = ring_ref.run_rank(p, 0, block_size=6)
    dead = (p.labels == -100) | (p.loss_mask == 0)
    assert torch.count_nonzero(loss[dead]) == 0 and torch.count_nonzero(dx[dead]) == 0


def test_all_tokens_masked_gives_exact_zeros(ring_ref) -> None:
    p = ring_ref.make_problem([12], V, seed=5, all_masked=True)
    loss, dx, dw = ring_ref.run_rank(p, 0, block_size=4)
    assert not loss.any() and not dx.any() and not dw.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_logits(dtype, ring_ref) -> None:
    # fp32: random logits, near-ties included. bf16 rounds 1e4 to a multiple of 64, which
    # can flip a near-tie's softmax (in a dense bf16 model too): separated logits there.
    p = ring_ref.make_problem([16], V, hidden=16, dtype=dtype, seed=6, logit_scale=1e4,
                              separated=dtype != torch.float32)
    assert (p.x @ p.w.T).abs().max() > 5e3
    loss, dx, dw = ring_ref.run_rank(p, 0, block_size=5)
    assert torch.isfinite(loss).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    ring_ref.check_rank(p, 0, block_size=5)


def test_gradcheck_float64() -> None:
    torch.manual_seed(7)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, -100, 3, 3])  # ids 7, 8 are padded rows
    mask = torch.tensor([1, 1, 1, 0, 1])
    assert torch.autograd.gradcheck(
        lambda a, b: ring_dtp_cross_entropy(a, b, labels, loss_mask=mask, vocab_size=7,
                                            block_size=2),
        (x, w),
    )


def test_leading_dims_and_frozen_weight() -> None:
    torch.manual_seed(8)
    x = torch.randn(3, 4, 6, requires_grad=True)  # [s, b, H]
    w = torch.randn(10, 6)  # frozen
    labels = torch.randint(0, 10, (3, 4))
    loss = ring_dtp_cross_entropy(x, w, labels, block_size=4)
    assert loss.shape == (3, 4)
    # fp32 against torch's one-pass softmax: the blocks reorder its sums
    ref = torch.nn.functional.cross_entropy((x @ w.T).flatten(0, 1), labels.flatten(),
                                            reduction="none").view(3, 4)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert x.grad is not None and w.grad is None
    x_ref = x.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy((x_ref @ w.T).flatten(0, 1), labels.flatten(),
                                      reduction="sum").backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)


def test_non_contiguous_weight_and_empty_batch() -> None:
    torch.manual_seed(9)
    w = torch.randn(6, 11).t().requires_grad_()  # [11, 6], not contiguous
    x = torch.randn(4, 6, requires_grad=True)
    labels = torch.tensor([0, 10, 5, 5])
    loss = ring_dtp_cross_entropy(x, w, labels, block_size=3)
    ref = torch.nn.functional.cross_entropy(x @ w.T, labels, reduction="none")
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert w.grad.shape == (11, 6)
    empty = ring_dtp_cross_entropy(torch.empty(0, 6, requires_grad=True), w,
                                   torch.empty(0, dtype=torch.long))
    assert empty.shape == (0,)


@pytest.mark.parametrize("labels, match", [
    ([0, 37, 1], r"labels in \[0, 37\].*padded"),  # 37 is a padded row (vocab_size 37 of 40)
    ([0, 40, 1], r"\[0, 40\]"),
    ([-5, 1, 2], r"\[-5, 2\]"),
])
def test_labels_outside_the_vocabulary_raise(labels, match) -> None:
    x = torch.randn(3, 4)
    w = torch.randn(40, 4)
    with pytest.raises(ValueError, match=match):
        ring_dtp_cross_entropy(x, w, torch.tensor(labels), vocab_size=V, debug_checks=True)
    # Without the debug checks (no host sync) the bad token's loss is NaN, the others exact.
    fast = ring_dtp_cross_entropy(x, w, torch.tensor(labels), vocab_size=V)
    good = torch.tensor([l in range(V) for l in labels])
    assert torch.isnan(fast[~good]).all() and not torch.isnan(fast[good]).any()
    # The same label, masked out, is fine.
    for debug in (True, False):
        masked = ring_dtp_cross_entropy(x, w, torch.tensor(labels), vocab_size=V,
                                        loss_mask=good, debug_checks=debug)
        assert not torch.isnan(masked).any()
    assert torch.equal(masked[good], fast[good])


def test_plan_is_kept_under_plan_key_and_steady_state_has_no_sync() -> None:
    import importlib

    from megatron_flat.runtime.ledger import CostLedger

    ce = importlib.import_module("megatron_flat.vocab.cross_entropy")
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(40, 4, requires_grad=True)
    labels = torch.tensor([0, 3, 39, 7, 1])

    def call(**kw):
        ring_dtp_cross_entropy(x, w, labels, block_size=16, **kw).sum().backward()

    call(plan_key="k")  # warm-up, no ledger open (as a first training step): plans under the key
    kept = len(ce._PLANS)
    with CostLedger() as steady:
        call(plan_key="k")
    assert steady.syncs == 0 and len(ce._PLANS) == kept
    with CostLedger() as unkeyed:
        call()  # no key: planned anew (P = 1: nothing gathered, nothing read)
    assert unkeyed.syncs == 0
    with CostLedger() as checked:
        call(plan_key="k", debug_checks=True)
    assert checked.syncs > 0  # the label range is read on the host
    with pytest.raises(ValueError, match="plan_key 'k' was planned for other shapes"):
        ring_dtp_cross_entropy(x[:3], w, labels[:3], block_size=16, plan_key="k")


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=torch.randn(3, 5)), "hidden size"),
    (dict(labels=torch.zeros(4, dtype=torch.long)), "labels"),
    (dict(labels=torch.zeros(3)), "integer"),
    (dict(mode="ring"), "mode"),
    (dict(block_size=0), "block_size"),
    (dict(weight_shard=torch.randn(8, 4, dtype=torch.float64)), "dtype"),
    (dict(loss_mask=torch.ones(2)), "loss_mask"),
    (dict(vocab_start=-3), "vocab_start"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(vocab_size=9), "cover"),  # more ids than the shard has rows
])
def test_malformed_inputs_raise_value_error(kwargs, match) -> None:
    args = dict(hidden=torch.randn(3, 4), weight_shard=torch.randn(8, 4),
                labels=torch.zeros(3, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ring_dtp_cross_entropy(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_is_a_few_strips_never_the_logits(dtype) -> None:
    n, h, v, block = 64, 8, 2048, 256
    torch.manual_seed(10)
    x = torch.randn(n, h).to(dtype).requires_grad_()
    w = torch.randn(v, h).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,))
    with MemoryMeter("cpu") as meter:
        with meter.section("forward"):
            loss = ring_dtp_cross_entropy(x, w, labels, block_size=block)
        with meter.section("backward"):
            loss.sum().backward()
    strip = n * block * 4
    grads = (n * h + v * h) * dtype.itemsize  # the returned gradients (outputs, not scratch)
    small = 16 * n * 4 + n * h * 4 + 8192  # per-token vectors, fp32 dX, slack
    # One fp32 strip (+ a quarter of it in the input dtype, for half inputs).
    assert meter.sections["forward"].peak_device_bytes <= 1.25 * strip + small
    assert meter.sections["backward"].peak_device_bytes <= 1.25 * strip + grads + small
    # The fp32 logits alone (n x v) would be 8 strips here.
    assert meter.peak_device_bytes - grads < 2 * strip


def test_a_plan_is_kept_for_its_own_group_only():
    """A plan cached under one group's id is not found for another group at the same id (a
    group freed and another allocated at its address on one rank only would otherwise skip
    the gather its peers wait in: a hang); the entry holds its group, so while it is cached
    no other group can take that id."""
    import importlib

    ce = importlib.import_module("megatron_flat.vocab.cross_entropy")
    old, new = object(), object()
    key = (id(new), -100, "k")
    row = torch.zeros(3, dtype=torch.int64)
    ce._remember(key, old, row, "plan")  # a stale entry at the new group's id
    try:
        assert ce._cached(key, new) is None
        assert ce._cached(key, old)[1] == "plan"
        ce._remember(key, new, row, "fresh")
        assert ce._cached(key, new)[1] == "fresh" and ce._PLANS[key][0] is new
    finally:
        ce._PLANS.pop(key, None)
