"""Ring-DTP over a ring of 4 ranks (gloo), and over 2-rank subgroups of the 4.

As in ``test_ring_dtp_world2.py``: each rank checks its slice of a dense float64
reference. Subgroups stand for Megatron's tensor-parallel groups, whose ring neighbours
are not global rank +- 1. Tolerances: ``tests/vocab/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.world(4)

MODES = ("weights", "activations", "auto")
CASES = {
    "even": (dict(ns=[5, 5, 5, 5], vocab_size=24), {}),
    "ragged-padded": (dict(ns=[5, 0, 7, 2], vocab_size=29, rows=8), {}),
    "last-shard-all-padding": (dict(ns=[3, 4, 2, 3], vocab_size=18, rows=6), {}),
    "more-tokens-than-rows": (dict(ns=[9, 7, 8, 10], vocab_size=20), {}),
    "blocks": (dict(ns=[4, 6, 3, 5], vocab_size=27, rows=7), dict(block_size=3)),
    "masked-ignored": (dict(ns=[6, 5, 7, 4], vocab_size=22, mask_every=3, ignore_every=5), {}),
    "all-masked": (dict(ns=[3, 2, 4, 3], vocab_size=16, all_masked=True), {}),
    "bf16": (dict(ns=[5, 4, 6, 3], vocab_size=30, hidden=16, dtype=torch.bfloat16), {}),
    "fp64": (dict(ns=[4, 3, 0, 5], vocab_size=21, rows=6, dtype=torch.float64),
             dict(block_size=4)),
    "huge-logits": (dict(ns=[5, 6, 4, 5], vocab_size=24, hidden=16, logit_scale=1e4), {}),
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


@pytest.fixture(scope="module")
def subgroups(dist_world):
    """Two partitions of the 4 ranks into rings of 2: {0,1},{2,3} and {0,2},{1,3}."""
    rank = dist.get_rank()
    mine = {}
    for name, parts in (("adjacent", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])):
        for ranks in parts:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = (group, ranks)
    yield mine
    for group, _ in mine.values():  # local: the files after this one start without them
        dist.destroy_process_group(group)


@pytest.mark.parametrize("mode", ["weights", "activations"])
@pytest.mark.parametrize("layout", ["adjacent", "strided"])
def test_ring_over_a_subgroup(subgroups, ring_ref, layout, mode) -> None:
    group, ranks = subgroups[layout]
    # Each subgroup solves its own problem (seeded by its first rank).
    p = ring_ref.make_problem([4, 6], vocab_size=13, rows=7, seed=20 + ranks[0],
                              mask_every=4)
    ring_ref.check_rank(p, ranks.index(dist.get_rank()), group, mode=mode)


def test_bad_labels_raise_on_every_rank(dist_world, ring_ref) -> None:
    ring_ref.check_bad_labels_raise_everywhere(dist.group.WORLD, dist.get_rank(), 4, culprit=2)


@pytest.mark.parametrize("mode", ["weights", "activations"])
def test_peak_is_one_strip_plus_shard_sized_buffers(dist_world, ring_ref, mode) -> None:
    n, rows, hidden = 64, 256, 8
    peaks = ring_ref.measure_ring_peak(dist.group.WORLD, dist.get_rank(), 4, mode, n, rows,
                                       hidden)
    bound = ring_ref.ring_peak_bound(mode, n, rows, hidden)
    assert peaks["forward"] <= bound and peaks["backward"] <= bound, (peaks, bound)
    assert peaks["total"] < 2 * n * rows * 4  # dense: 4 strips of logits, 4 of their grad


@pytest.mark.parametrize("mode", MODES)
def test_steady_state_has_no_host_sync(dist_world, ring_ref, mode) -> None:
    ring_ref.check_steady_state_has_no_sync(dist.group.WORLD, dist.get_rank(), 4, mode)


MAIN_GRAD_CASES = ("ragged-padded", "last-shard-all-padding", "more-tokens-than-rows",
                   "blocks", "bf16", "fp64")


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
    ring_ref.check_backward_peak_at_paper_shape(dist.group.WORLD, dist.get_rank(), 4, mode, n,
                                                main_grad)
