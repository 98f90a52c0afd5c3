"""Synthetic routing profiles used by the dispatch benchmark (issue 3)."""

import pytest
import torch

from megatron_flat.dispatch.profiles import routing_profile

BENCHMARK_PROFILES = ["balanced", "0.95/16", "0.8/16", "0.5/4", "0.3/16"]


def distinct_rows(routes):
    k = routes.shape[1]
    return all(len(set(row)) == k for row in routes.tolist())


def test_balanced_formula():
    routes = routing_profile("balanced", 7, 5, 3)
    assert routes.dtype == torch.long and routes.shape == (7, 3)
    for i in range(7):
        for j in range(3):
            assert routes[i, j] == (i + j) % 5
    assert distinct_rows(routes)
    counts = torch.bincount(routing_profile("balanced", 40, 8, 2).reshape(-1), minlength=8)
    assert counts.tolist() == [10] * 8


def test_hot_cold_formula_when_h_at_least_k():
    n, e, k, h = 10, 32, 8, 16
    routes = routing_profile("0.8/16", n, e, k)
    n_hot = 8  # floor(0.8 * 10)
    for i in range(n):
        for j in range(k):
            want = j % h if i < n_hot else h + (i + j) % (e - h)
            assert routes[i, j] == want
    assert distinct_rows(routes)


def test_h_below_k_spills_hot_slots_to_cold_experts():
    # "0.5/4" with top-8: hot slots 0-3 -> experts 0-3, slots 4-7 -> h + (i + j) % (E - h).
    n, e, k, h = 6, 32, 8, 4
    routes = routing_profile("0.5/4", n, e, k)
    for i in range(n):
        for j in range(k):
            if i < 3:
                want = j if j < h else h + (i + j) % (e - h)
            else:
                want = h + (i + j) % (e - h)
            assert routes[i, j] == want
    assert distinct_rows(routes)
    hot = routes[:3]
    assert torch.equal(hot[:, :h], torch.arange(h).expand(3, h))
    assert bool((hot[:, h:] >= h).all())


def test_few_cold_experts_spill_cold_slots_to_hot_experts():
    # E - h = 2 < k = 4: cold slots 0-1 -> cold experts, slots 2-3 -> (i + j) % h.
    routes = routing_profile("0.25/6", 4, 8, 4)
    assert routes[0].tolist() == [0, 1, 2, 3]
    for i in range(1, 4):
        for j in range(4):
            want = 6 + (i + j) % 2 if j < 2 else (i + j) % 6
            assert routes[i, j] == want
    assert distinct_rows(routes)


def test_hot_fraction_is_an_exact_floor():
    routes = routing_profile("0.29/4", 100, 16, 2)  # 0.29 * 100 is 28.999... in floating point
    hot = (routes < 4).all(1)
    assert int(hot.sum()) == 29 and bool(hot[:29].all())
    assert int((routing_profile("0.95/16", 65, 32, 8) < 16).all(1).sum()) == 61  # floor(61.75)


def test_extreme_fractions():
    e, k = 8, 3
    cold = routing_profile("0/2", 5, e, k)
    assert bool((cold >= 2).all())
    hot = routing_profile("1/2", 5, e, k)
    assert bool((hot[:, 2] >= 2).all())  # k=3 > h=2: the third slot falls to a cold expert
    assert hot[:, :2].tolist() == [[0, 1]] * 5
    everything_hot = routing_profile("1/8", 5, e, k)  # h = E allowed when no token is cold
    assert everything_hot.tolist() == [[0, 1, 2]] * 5


def test_distinct_experts_whenever_k_le_e():
    for e in (1, 2, 3, 5, 8):
        for k in range(1, e + 1):
            for n in (0, 1, 7):
                assert distinct_rows(routing_profile("balanced", n, e, k))
                for h in range(1, e):
                    for r in ("0", "0.3", "0.5", "1"):
                        routes = routing_profile(f"{r}/{h}", n, e, k)
                        assert routes.shape == (n, k)
                        assert distinct_rows(routes), (r, h, n, e, k)
                        assert bool(((routes >= 0) & (routes < e)).all())


def test_benchmark_profiles_are_legal_and_deterministic():
    for profile in BENCHMARK_PROFILES:
        routes = routing_profile(profile, 1000, 32, 8)
        assert distinct_rows(routes)
        assert torch.equal(routes, routing_profile(profile, 1000, 32, 8))
    hot = int((routing_profile("0.95/16", 1000, 32, 8) < 16).sum())
    assert hot == 7600  # a count: exactly 95% of the 1000 x 8 routes


@pytest.mark.parametrize("args, match", [
    (("uniform", 4, 8, 2), "balanced' or 'r/h'"),
    (("0.8", 4, 8, 2), "balanced' or 'r/h'"),
    (("0.8/16/2", 4, 32, 2), "balanced' or 'r/h'"),
    (("x/4", 4, 8, 2), "balanced' or 'r/h'"),
    (("0.5/2.5", 4, 8, 2), "balanced' or 'r/h'"),
    (("nan/4", 4, 8, 2), "balanced' or 'r/h'"),
    (("1.5/4", 4, 8, 2), r"\[0, 1\]"),
    (("-0.1/4", 4, 8, 2), r"\[0, 1\]"),
    (("0.5/0", 4, 8, 2), "1..E-1"),
    (("0.5/9", 4, 8, 2), "1..E-1"),
    (("0.5/8", 4, 8, 2), "no cold"),
    (("0/8", 4, 8, 2), "no cold"),
    (("balanced", 4, 2, 3), "distinct"),
    (("0.5/1", 4, 2, 3), "distinct"),
    (("balanced", 4, 8, 0), "topk"),
    (("balanced", -1, 8, 2), "n_tokens"),
    (("balanced", 4, 0, 1), "num_experts"),
    ((None, 4, 8, 2), "string"),
])
def test_validation(args, match):
    with pytest.raises(ValueError, match=match):
        routing_profile(*args)
