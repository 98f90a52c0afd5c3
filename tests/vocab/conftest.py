"""Dense float64 reference for Ring-DTP tests, and the problems they run.

Tests reach these helpers through the ``ring_ref`` fixture (test modules are imported by
path, so this file is not importable by name).

A problem is global: every rank builds the same one from a seed (all tokens, the padded
weight, labels, mask, grad of the loss), runs the op on its slice and compares its slice of
the reference. No collective is needed to check.

Tolerances. The op and a dense computation differ from the float64 truth by rounding only,
in a different order. With L the largest |logit| and G the largest reference gradient:
each fp32 logit is an H-term dot product (H <= 16 here), so off by delta <= ~4u * L
(u = 2**-24, the fp32 unit roundoff); the loss moves by at most 2 * delta, and every
softmax probability by at most 2 * delta, so a gradient by at most ~2 * delta * G — reached
only where the top logits nearly tie, which at L = 1e4 (delta ~ 2e-3) happens. The fold's
rescaling of z (a few ulp per strip) and the sums over strips, shards and ranks add
O(u * number of terms) on top. Measured here (L from 14 to 8600): loss <= 1.6e-7 * L, gradients
<= 3e-7 * G, or 1.7e-4 * G at a near-tie with L = 8600. So:

* float32: loss 16u * max(1, L), gradients 16u * max(1, L) * G, rtol 1e-5 (>= 6x margin;
  at L ~ 14 that is ~6e-5 * G, while a wrong term — a missing strip, a doubled target, a
  leaking padded row — is O(1e-2) or more);
* float64 inputs (float64 state): 1e-12 * L and 1e-12 * L * G — exact up to fp64 rounding;
* half inputs, against the float64 reference of the *rounded* inputs: every logit is rounded
  once to the input dtype (unit roundoff u = 2**-8 bf16, 2**-11 fp16; loss measured
  <= 0.7u * L) and so is the logit gradient (measured <= 1.4u * G): loss 2u * max(1, L),
  gradients 8u * G, rtol 8u. That is the precision of a dense half-precision model, not a
  loss of the op.
"""

from __future__ import annotations

from dataclasses import dataclass
import sys
from typing import Optional, Sequence

import pytest
import torch

from megatron_flat.vocab import IGNORE_INDEX, ring_dtp_cross_entropy

# Unit roundoff (half an ulp at 1) of each dtype.
EPS = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8,
       torch.float16: 2.0**-11}


@dataclass
class Problem:
    ns: tuple[int, ...]  # tokens per rank
    rows: int  # shard rows (padding included)
    vocab_size: int  # true V
    x: torch.Tensor  # [sum ns, H] float64 (already rounded to dtype)
    w: torch.Tensor  # [P * rows, H] float64 (padded rows random, must not matter)
    labels: torch.Tensor
    loss_mask: Optional[torch.Tensor]
    grad: torch.Tensor  # d loss, float64 [sum ns]
    dtype: torch.dtype

    @property
    def world(self) -> int:
        return len(self.ns)

    def token_slice(self, rank: int) -> slice:
        start = sum(self.ns[:rank])
        return slice(start, start + self.ns[rank])

    def row_slice(self, rank: int) -> slice:
        return slice(rank * self.rows, (rank + 1) * self.rows)


def make_problem(
    ns: Sequence[int],
    vocab_size: int,
    hidden: int = 8,
    rows: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    logit_scale: float = 1.0,
    mask_every: int = 0,
    ignore_every: int = 0,
    all_masked: bool = False,
    separated: bool = False,
) -> Problem:
    """Tokens ``ns`` per rank, vocabulary ``vocab_size`` padded to ``P * rows`` rows.

    ``logit_scale`` scales X and W so logits reach about ``logit_scale`` in size;
    ``mask_every``/``ignore_every`` mask / ignore every k-th token. ``separated`` points
    each token along one vocab row (its top logit then leads the next by ~L/2), so rounding
    the logits cannot reorder them: for half-precision inputs at huge L, where a near-tie
    would let one rounding flip the softmax.
    """
    world = len(ns)
    rows = rows if rows is not None else -(-vocab_size // world)
    gen = torch.Generator().manual_seed(seed)
    n = sum(ns)
    s = (logit_scale / hidden) ** 0.5 if logit_scale > 1 else 1.0
    x = torch.randn(n, hidden, generator=gen, dtype=torch.float64) * s
    w = torch.randn(world * rows, hidden, generator=gen, dtype=torch.float64) * s
    if separated:
        top = torch.randint(0, vocab_size, (n,), generator=gen)
        x = w[top] + 0.1 * x
    x, w = x.to(dtype).double(), w.to(dtype).double()
    labels = torch.randint(0, vocab_size, (n,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = IGNORE_INDEX
    mask = None
    if mask_every or all_masked:
        mask = torch.ones(n, dtype=torch.float32)
        if all_masked:
            mask.zero_()
        else:
            mask[1::mask_every] = 0
    grad = torch.randn(n, generator=gen, dtype=torch.float64)
    return Problem(tuple(ns), rows, vocab_size, x, w, labels, mask, grad, dtype)


def reference(p: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d x, d w) in float64, dense; padded rows of d w are 0 by construction."""
    x = p.x.clone().requires_grad_()
    w = p.w.clone().requires_grad_()
    logits = x @ w[: p.vocab_size].T
    active = p.labels != IGNORE_INDEX
    if p.loss_mask is not None:
        active &= p.loss_mask != 0
    safe = torch.where(active, p.labels, 0)
    loss = torch.logsumexp(logits, dim=1) - logits.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(active, loss, torch.zeros((), dtype=loss.dtype))
    dx, dw = torch.autograd.grad(loss, (x, w), p.grad)
    return loss.detach(), dx, dw


def run_rank(p: Problem, rank: int, group=None, **kwargs):
    """The op on ``rank``'s slice: (loss, d x, d w) as returned (dtypes untouched)."""
    tok, row = p.token_slice(rank), p.row_slice(rank)
    x = p.x[tok].to(p.dtype).requires_grad_()
    w = p.w[row].to(p.dtype).requires_grad_()
    mask = None if p.loss_mask is None else p.loss_mask[tok]
    loss = ring_dtp_cross_entropy(x, w, p.labels[tok], group=group, loss_mask=mask,
                                  vocab_size=p.vocab_size, **kwargs)
    dx, dw = torch.autograd.grad(loss, (x, w), p.grad[tok].to(loss.dtype))
    return loss, dx, dw


def tolerances(p: Problem, ref_dx: torch.Tensor, ref_dw: torch.Tensor):
    """(loss atol, gradient atol, rtol) for this problem; see the module docstring."""
    logits = p.x @ p.w[: p.vocab_size].T
    big_l = max(1.0, float(logits.abs().max()) if logits.numel() else 1.0)
    big_g = max(1.0, float(ref_dx.abs().max()) if ref_dx.numel() else 0.0,
                float(ref_dw.abs().max()))
    if p.dtype == torch.float64:
        return 1e-12 * big_l, 1e-12 * big_l * big_g, 1e-10
    u = EPS[p.dtype]
    if p.dtype == torch.float32:
        return 16 * u * big_l, 16 * u * big_l * big_g, 1e-5
    return 2 * u * big_l, 8 * u * big_g, 8 * u


def check_rank(p: Problem, rank: int, group=None, **kwargs) -> None:
    """Run ``rank``'s part and compare loss, d x, d w with the dense float64 reference."""
    loss, dx, dw = run_rank(p, rank, group, **kwargs)
    ref_loss, ref_dx, ref_dw = reference(p)
    tok, row = p.token_slice(rank), p.row_slice(rank)
    acc = torch.float64 if p.dtype == torch.float64 else torch.float32
    assert loss.dtype == acc
    assert dx.dtype == p.dtype and dw.dtype == p.dtype
    loss_tol, grad_tol, rtol = tolerances(p, ref_dx, ref_dw)
    torch.testing.assert_close(loss.double(), ref_loss[tok], atol=loss_tol, rtol=rtol)
    torch.testing.assert_close(dx.double(), ref_dx[tok], atol=grad_tol, rtol=rtol)
    torch.testing.assert_close(dw.double(), ref_dw[row], atol=grad_tol, rtol=rtol)
    # Padded rows (ids >= vocab_size) never contribute: exactly zero gradient.
    pad_from = max(0, min(p.rows, p.vocab_size - rank * p.rows))
    assert torch.count_nonzero(dw[pad_from:]) == 0


def run_rank_main_grad(p: Problem, rank: int, group=None, ddp: bool = True,
                       tied: bool = False, **kwargs):
    """The op on ``rank``'s slice with the shard as Megatron DDP holds it: a Parameter whose
    ``main_grad`` (accumulation dtype) already holds earlier gradients and, with ``ddp``, a
    ``grad_added_to_main_grad`` flag. ``tied``: the weight also gets a second, plain
    gradient (a tied embedding's lookup), ``extra``. Returns
    ``(loss, dx, weight, main_grad before, extra)``."""
    tok, row = p.token_slice(rank), p.row_slice(rank)
    acc = torch.float64 if p.dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(100 + rank)
    x = p.x[tok].to(p.dtype).requires_grad_()
    w = torch.nn.Parameter(p.w[row].to(p.dtype))
    before = torch.randn(w.shape, generator=gen, dtype=acc)
    w.main_grad = before.clone()
    if ddp:
        w.grad_added_to_main_grad = False
    extra = torch.randn(w.shape, generator=gen).to(p.dtype) if tied else None
    mask = None if p.loss_mask is None else p.loss_mask[tok]
    loss = ring_dtp_cross_entropy(x, w, p.labels[tok], group=group, loss_mask=mask,
                                  vocab_size=p.vocab_size, **kwargs)
    total = (loss * p.grad[tok].to(loss.dtype)).sum()
    if tied:
        total = total + (w * extra).sum()
    total.backward()
    return loss, x.grad, w, before, extra


def check_main_grad(p: Problem, rank: int, group=None, ddp: bool = True, tied: bool = False,
                    **kwargs) -> None:
    """The shard gradient lands in ``main_grad`` (added to what it held), none in ``.grad``
    beyond DDP's zero placeholder (plus a tied lookup's own gradient, untouched)."""
    loss, dx, w, before, extra = run_rank_main_grad(p, rank, group, ddp, tied, **kwargs)
    ref_loss, ref_dx, ref_dw = reference(p)
    tok, row = p.token_slice(rank), p.row_slice(rank)
    loss_tol, grad_tol, rtol = tolerances(p, ref_dx, ref_dw)
    torch.testing.assert_close(loss.double(), ref_loss[tok], atol=loss_tol, rtol=rtol)
    torch.testing.assert_close(dx.double(), ref_dx[tok], atol=grad_tol, rtol=rtol)
    assert w.main_grad.dtype == before.dtype
    # Adding to |before| ~ 1 costs one rounding of main_grad's dtype per element.
    atol = grad_tol + 4 * EPS[before.dtype] * float(before.abs().max())
    torch.testing.assert_close((w.main_grad - before).double(), ref_dw[row], atol=atol,
                               rtol=rtol)
    pad_from = max(0, min(p.rows, p.vocab_size - rank * p.rows))
    assert torch.equal(w.main_grad[pad_from:], before[pad_from:])
    if ddp:
        assert w.grad_added_to_main_grad is True
        expected = extra if tied else torch.zeros_like(w)
        assert w.grad is not None and torch.equal(w.grad, expected)
    else:
        assert (w.grad is None) if not tied else torch.equal(w.grad, extra)


def check_main_grad_case(case, seed: int, group, rank: int, **kwargs) -> None:
    """:func:`check_main_grad` on a test module's ``CASES`` entry ``(problem kwargs with
    "ns", op kwargs)``."""
    problem_kwargs, op_kwargs = case
    problem_kwargs = dict(problem_kwargs)
    p = make_problem(problem_kwargs.pop("ns"), seed=seed, **problem_kwargs)
    check_main_grad(p, rank, group, **kwargs, **op_kwargs)


def check_backward_peak_at_paper_shape(group, rank: int, world: int, mode: str, n: int,
                                       main_grad: bool) -> None:
    """The paper's per-rank shape scaled down (V/P = 3.5 H = 112): the backward peak is at
    most 3 strips + one fp32 shard gradient with ``main_grad`` (without it the shard's own
    gradient comes on top), and within the docstring's bound."""
    hidden, rows = 32, 112
    peaks = measure_ring_peak(group, rank, world, mode, n, rows, hidden, main_grad=main_grad)
    strip, shard_grad = n * rows * 4, rows * hidden * 4
    target = 3 * strip + (1 if main_grad else 2) * shard_grad
    assert peaks["backward"] <= target, (peaks["backward"] / strip, "strips")
    run = mode if mode != "auto" else ("activations" if n <= rows else "weights")
    bound = ring_peak_bound(run, n, rows, hidden, main_grad=main_grad)
    assert peaks["forward"] <= bound and peaks["backward"] <= bound, (peaks, bound)


@pytest.fixture(scope="session")
def ring_ref():
    """This module: ``make_problem``, ``reference``, ``run_rank``, ``check_rank``..."""
    return sys.modules[__name__]


# -- multi-rank checks shared by the *_world{2,4}.py files -----------------------------


def check_bad_labels_raise_everywhere(group, rank: int, world: int, culprit: int) -> None:
    """A padded-row label on ``culprit`` only: every rank raises, then the ring still works."""
    import torch.distributed as dist

    p = make_problem([3] * world, vocab_size=4 * world - 2, rows=4, seed=11)
    p.labels[p.token_slice(culprit)][1] = p.vocab_size  # the first padded row
    with pytest.raises(ValueError, match=r"padded vocab rows"):
        run_rank(p, rank, group, debug_checks=True)
    # Without the debug checks nothing waits for the device: the culprit's token gets a
    # NaN loss on its own rank, every other token its exact loss.
    loss, _, _ = run_rank(p, rank, group)
    bad = p.labels[p.token_slice(rank)] >= p.vocab_size
    assert torch.isnan(loss[bad]).all() and not torch.isnan(loss[~bad]).any()
    bad_shape = rank == culprit
    with pytest.raises(ValueError, match="labels" if bad_shape else r"rank\(s\)"):
        tok = p.token_slice(rank)
        labels = p.labels[tok][:-1] if bad_shape else p.labels[tok]
        ring_dtp_cross_entropy(p.x[tok].float(), p.w[p.row_slice(rank)].float(), labels,
                               group=group, vocab_size=p.vocab_size)
    # Nobody was left inside a hop: a good call and a barrier go through.
    p.labels[p.labels >= p.vocab_size] = 0
    check_rank(p, rank, group)
    dist.barrier(group=group)


def measure_ring_peak(group, rank: int, world: int, mode: str, n: int, rows: int,
                      hidden: int, main_grad: bool = False) -> dict:
    """Peaks (bytes) of forward and backward of one rank, fp32, one strip per shard.

    ``main_grad``: the shard is a Megatron-DDP-style parameter whose ``main_grad`` exists
    before the meter opens (as DDP's gradient buffer does), so it is not counted."""
    from megatron_flat.runtime import MemoryMeter

    p = make_problem([n] * world, vocab_size=rows * world, hidden=hidden, rows=rows, seed=12)
    tok, row = p.token_slice(rank), p.row_slice(rank)
    x = p.x[tok].float().requires_grad_()
    w = torch.nn.Parameter(p.w[row].float())
    if main_grad:
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    labels = p.labels[tok]
    with MemoryMeter("cpu") as meter:
        with meter.section("forward"):
            loss = ring_dtp_cross_entropy(x, w, labels, group=group, mode=mode)
        with meter.section("backward"):
            loss.sum().backward()
    return {"forward": meter.sections["forward"].peak_device_bytes,
            "backward": meter.sections["backward"].peak_device_bytes,
            "total": meter.peak_device_bytes}


def ring_peak_bound(mode: str, n: int, rows: int, hidden: int, main_grad: bool = False) -> int:
    """The fp32 per-rank bound of :class:`RingDTPCrossEntropy`'s docstring, in bytes.

    One strip (``n x rows``); weights: 2 shards in flight, the shard gradient (unless in
    ``main_grad``), one travelling shard-gradient sum + its relay slot (1/8) and dX;
    activations: 2 token batches, dX, one travelling dX sum + slot and the shard gradient
    (unless in ``main_grad``); plus per-token vectors (labels, state, lse, grad: < 16 words
    per token) and 8 KiB of slack.
    """
    strip = n * rows * 4
    shard, batch = rows * hidden * 4, n * hidden * 4
    home = 0 if main_grad else 1
    if mode == "weights":
        buffers = (2 + home + 1.125) * shard + batch
    else:
        buffers = (2 + 1 + 1.125) * batch + home * shard
    return int(strip + buffers + 16 * n * 4 + 8192)


def check_steady_state_has_no_sync(group, rank: int, world: int, mode: str) -> None:
    """With a plan_key, a repeated call of Ring-DTP (forward + backward) makes no host sync
    (the cost ledger's count): the plan is kept, the label range judged on the device."""
    from megatron_flat.runtime.ledger import CostLedger

    p = make_problem([5] * world, vocab_size=4 * world, rows=4, seed=3)
    run_rank(p, rank, group, mode=mode, plan_key=("steady", mode))  # planned, no ledger open
    with CostLedger() as ledger:
        run_rank(p, rank, group, mode=mode, plan_key=("steady", mode))
    assert ledger.syncs == 0, ledger.sync_kinds
    assert ledger.collective_calls.get("all_gather_into_tensor", 0) == 0
