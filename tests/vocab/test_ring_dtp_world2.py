"""Ring-DTP over a ring of 2 ranks (gloo): every schedule against a dense float64 reference.

Every rank builds the same global problem, runs its slice and compares its slice of the
reference (loss, d hidden, d of its own weight shard). Tolerances: ``tests/vocab/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.world(2)

MODES = ("weights", "activations", "auto")
# name -> make_problem kwargs (tokens per rank first) and op kwargs
CASES = {
    "even": (dict(ns=[6, 6], vocab_size=16), {}),
    "ragged-padded": (dict(ns=[5, 2], vocab_size=13, rows=8), {}),
    "one-rank-empty": (dict(ns=[0, 7], vocab_size=11), {}),
    "more-tokens-than-rows": (dict(ns=[9, 12], vocab_size=10), {}),
    "blocks": (dict(ns=[6, 4], vocab_size=15, rows=9), dict(block_size=4)),
    "masked-ignored": (dict(ns=[8, 6], vocab_size=14, mask_every=3, ignore_every=4), {}),
    "all-masked": (dict(ns=[4, 5], vocab_size=12, all_masked=True), {}),
    "bf16": (dict(ns=[6, 5], vocab_size=16, hidden=16, dtype=torch.bfloat16), {}),
    "fp16": (dict(ns=[6, 5], vocab_size=16, hidden=16, dtype=torch.float16), {}),
    "fp64": (dict(ns=[5, 6], vocab_size=13, rows=8, dtype=torch.float64), dict(block_size=3)),
    "huge-logits": (dict(ns=[7, 5], vocab_size=16, hidden=16, logit_scale=1e4), {}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense(dist_world, ring_ref, case, mode) -> None:
    problem_kwargs, op_kwargs = CASES[case]
    problem_kwargs = dict(problem_kwargs)
    p = ring_ref.make_problem(problem_kwargs.pop("ns"), seed=len(case), **problem_kwargs)
    ring_ref.check_rank(p, dist.get_rank(), dist.group.WORLD, mode=mode, **op_kwargs)
    if case == "all-masked":
        loss, dx, dw = ring_ref.run_rank(p, dist.get_rank(), dist.group.WORLD, mode=mode)
        assert not loss.any() and not dx.any() and not dw.any()


@pytest.mark.parametrize("ns, expected", [([4, 8], "activations"), ([4, 9], "weights")])
def test_auto_runs_the_schedule_it_names(dist_world, ring_ref, ns, expected) -> None:
    # 8 rows per shard: N = max over ranks decides, identically on both ranks.
    p = ring_ref.make_problem(ns, vocab_size=16, seed=13)
    auto = ring_ref.run_rank(p, dist.get_rank(), dist.group.WORLD, mode="auto")
    named = ring_ref.run_rank(p, dist.get_rank(), dist.group.WORLD, mode=expected)
    for a, b in zip(auto, named):
        assert torch.equal(a, b)


def test_bad_labels_raise_on_every_rank(dist_world, ring_ref) -> None:
    ring_ref.check_bad_labels_raise_everywhere(dist.group.WORLD, dist.get_rank(), 2, culprit=1)


@pytest.mark.parametrize("mode", ["weights", "activations"])
def test_peak_is_one_strip_plus_shard_sized_buffers(dist_world, ring_ref, mode) -> None:
    n, rows, hidden = 64, 256, 8
    peaks = ring_ref.measure_ring_peak(dist.group.WORLD, dist.get_rank(), 2, mode, n, rows,
                                       hidden)
    bound = ring_ref.ring_peak_bound(mode, n, rows, hidden)
    assert peaks["forward"] <= bound and peaks["backward"] <= bound, (peaks, bound)
    assert peaks["total"] < 2 * n * rows * 4  # dense: 2 strips of logits, 2 of their grad


@pytest.mark.parametrize("mode", MODES)
def test_steady_state_has_no_host_sync(dist_world, ring_ref, mode) -> None:
    ring_ref.check_steady_state_has_no_sync(dist.group.WORLD, dist.get_rank(), 2, mode)


MAIN_GRAD_CASES = ("even", "ragged-padded", "more-tokens-than-rows", "blocks", "bf16", "fp64")


@pytest.mark.parametrize("mode", ["weights", "activations"])
@pytest.mark.parametrize("case", MAIN_GRAD_CASES)
@pytest.mark.parametrize("ddp, tied", [(True, False), (True, True), (False, False)])
def test_weight_gradient_accumulates_into_main_grad(dist_world, ring_ref, case, mode, ddp,
                                                    tied) -> None:
    ring_ref.check_main_grad_case(CASES[case], len(case), dist.group.WORLD, dist.get_rank(),
                                  ddp=ddp, tied=tied, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [72, 144])  # below and above V/P = 112
@pytest.mark.parametrize("main_grad", [True, False])
def test_backward_peak_at_the_paper_shape(dist_world, ring_ref, mode, n, main_grad) -> None:
    ring_ref.check_backward_peak_at_paper_shape(dist.group.WORLD, dist.get_rank(), 2, mode, n,
                                                main_grad)
