"""Ring-DTP over rings of 2 and 4 ranks (gloo), and over 2-rank subgroups of the 4: every
schedule against a dense float64 reference.

Every rank builds the same global problem, runs its slice and compares its slice of the
reference (loss, d hidden, d of its own weight shard). Subgroups stand for Megatron's
tensor-parallel groups, whose ring neighbours are not global rank +- 1. Each case is marked
with its world size and runs in that torchrun session. Tolerances: ``tests/vocab/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._worlds import WORLDS, per_world

MODES = ("weights", "activations", "auto")
# world size -> case name -> make_problem kwargs (tokens per rank first) and op kwargs
CASES = {
    2: {
        "even": (dict(ns=[6, 6], vocab_size=16), {}),
        "ragged-padded": (dict(ns=[5, 2], vocab_size=13, rows=8), {}),
        "one-rank-empty": (dict(ns=[0, 7], vocab_size=11), {}),
        "more-tokens-than-rows": (dict(ns=[9, 12], vocab_size=10), {}),
        "blocks": (dict(ns=[6, 4], vocab_size=15, rows=9), dict(block_size=4)),
        "masked-ignored": (dict(ns=[8, 6], vocab_size=14, mask_every=3, ignore_every=4), {}),
        "all-masked": (dict(ns=[4, 5], vocab_size=12, all_masked=True), {}),
        "bf16": (dict(ns=[6, 5], vocab_size=16, hidden=16, dtype=torch.bfloat16), {}),
        "fp16": (dict(ns=[6, 5], vocab_size=16, hidden=16, dtype=torch.float16), {}),
        "fp64": (dict(ns=[5, 6], vocab_size=13, rows=8, dtype=torch.float64),
                 dict(block_size=3)),
        "huge-logits": (dict(ns=[7, 5], vocab_size=16, hidden=16, logit_scale=1e4), {}),
    },
    4: {
        "even": (dict(ns=[5, 5, 5, 5], vocab_size=24), {}),
        "ragged-padded": (dict(ns=[5, 0, 7, 2], vocab_size=29, rows=8), {}),
        "last-shard-all-padding": (dict(ns=[3, 4, 2, 3], vocab_size=18, rows=6), {}),
        "more-tokens-than-rows": (dict(ns=[9, 7, 8, 10], vocab_size=20), {}),
        "blocks": (dict(ns=[4, 6, 3, 5], vocab_size=27, rows=7), dict(block_size=3)),
        "masked-ignored": (dict(ns=[6, 5, 7, 4], vocab_size=22, mask_every=3, ignore_every=5),
                           {}),
        "all-masked": (dict(ns=[3, 2, 4, 3], vocab_size=16, all_masked=True), {}),
        "bf16": (dict(ns=[5, 4, 6, 3], vocab_size=30, hidden=16, dtype=torch.bfloat16), {}),
        "fp64": (dict(ns=[4, 3, 0, 5], vocab_size=21, rows=6, dtype=torch.float64),
                 dict(block_size=4)),
        "huge-logits": (dict(ns=[5, 6, 4, 5], vocab_size=24, hidden=16, logit_scale=1e4), {}),
    },
}
MAIN_GRAD_CASES = {
    2: ("even", "ragged-padded", "more-tokens-than-rows", "blocks", "bf16", "fp64"),
    4: ("ragged-padded", "last-shard-all-padding", "more-tokens-than-rows", "blocks", "bf16",
        "fp64"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world, case", per_world(CASES))
def test_matches_dense(dist_world, ring_ref, world, case, mode) -> None:
    assert dist.get_world_size() == world
    problem_kwargs, op_kwargs = CASES[world][case]
    problem_kwargs = dict(problem_kwargs)
    p = ring_ref.make_problem(problem_kwargs.pop("ns"), seed=len(case), **problem_kwargs)
    ring_ref.check_rank(p, dist.get_rank(), dist.group.WORLD, mode=mode, **op_kwargs)
    if case == "all-masked":
        loss, dx, dw = ring_ref.run_rank(p, dist.get_rank(), dist.group.WORLD, mode=mode)
        assert not loss.any() and not dx.any() and not dw.any()


@pytest.mark.world(2)
@pytest.mark.parametrize("ns, expected", [([4, 8], "activations"), ([4, 9], "weights")])
def test_auto_runs_the_schedule_it_names(dist_world, ring_ref, ns, expected) -> None:
    # 8 rows per shard: N = max over ranks decides, identically on both ranks.
    p = ring_ref.make_problem(ns, vocab_size=16, seed=13)
    auto = ring_ref.run_rank(p, dist.get_rank(), dist.group.WORLD, mode="auto")
    named = ring_ref.run_rank(p, dist.get_rank(), dist.group.WORLD, mode=expected)
    for a, b in zip(auto, named):
        assert torch.equal(a, b)


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


@pytest.mark.world(4)
@pytest.mark.parametrize("mode", ["weights", "activations"])
@pytest.mark.parametrize("layout", ["adjacent", "strided"])
def test_ring_over_a_subgroup(subgroups, ring_ref, layout, mode) -> None:
    group, ranks = subgroups[layout]
    # Each subgroup solves its own problem (seeded by its first rank).
    p = ring_ref.make_problem([4, 6], vocab_size=13, rows=7, seed=20 + ranks[0],
                              mask_every=4)
    ring_ref.check_rank(p, ranks.index(dist.get_rank()), group, mode=mode)


@pytest.mark.parametrize("world", WORLDS)
def test_bad_labels_raise_on_every_rank(dist_world, ring_ref, world) -> None:
    ring_ref.check_bad_labels_raise_everywhere(dist.group.WORLD, dist.get_rank(), world,
                                               culprit={2: 1, 4: 2}[world])


@pytest.mark.parametrize("mode", ["weights", "activations"])
@pytest.mark.parametrize("world", WORLDS)
def test_peak_is_one_strip_plus_shard_sized_buffers(dist_world, ring_ref, world, mode) -> None:
    n, rows, hidden = 64, 256, 8
    peaks = ring_ref.measure_ring_peak(dist.group.WORLD, dist.get_rank(), world, mode, n, rows,
                                       hidden)
    bound = ring_ref.ring_peak_bound(mode, n, rows, hidden)
    assert peaks["forward"] <= bound and peaks["backward"] <= bound, (peaks, bound)
    # dense: P strips of logits, P of their grad
    assert peaks["total"] < 2 * n * rows * 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_steady_state_has_no_host_sync(dist_world, ring_ref, world, mode) -> None:
    ring_ref.check_steady_state_has_no_sync(dist.group.WORLD, dist.get_rank(), world, mode)


@pytest.mark.parametrize("mode", ["weights", "activations"])
@pytest.mark.parametrize("world, case", per_world(MAIN_GRAD_CASES))
@pytest.mark.parametrize("ddp, tied", [(True, False), (True, True), (False, False)])
def test_weight_gradient_accumulates_into_main_grad(dist_world, ring_ref, world, case, mode,
                                                    ddp, tied) -> None:
    ring_ref.check_main_grad_case(CASES[world][case], len(case), dist.group.WORLD,
                                  dist.get_rank(), ddp=ddp, tied=tied, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [72, 144])  # below and above V/P = 112
@pytest.mark.parametrize("main_grad", [True, False])
@pytest.mark.parametrize("world", WORLDS)
def test_backward_peak_at_the_paper_shape(dist_world, ring_ref, world, mode, n,
                                          main_grad) -> None:
    ring_ref.check_backward_peak_at_paper_shape(dist.group.WORLD, dist.get_rank(), world, mode,
                                                n, main_grad)
