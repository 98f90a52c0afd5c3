"""The harness itself: it reports every kind of difference, and a world of one matches."""

import dataclasses

import pytest
import torch

from megatron_flat.testing.equivalence import RunResult, mismatches


def _result():
    t = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    return RunResult(losses=[2.0, 1.5], grads={k: v.clone() for k, v in t.items()},
                     params={k: v.clone() for k, v in t.items()}, initial_params=t)


def test_identical_results_have_no_mismatch():
    assert mismatches(_result(), _result()) == []


@pytest.mark.parametrize("what", ["loss", "grad", "param", "missing", "shape"])
def test_each_difference_is_reported(what):
    ref, got = _result(), _result()
    if what == "loss":
        got.losses[1] += 1e-3
    elif what == "grad":
        got.grads["w"][1, 1] += 1e-3
    elif what == "param":
        got.params["b"][0] += 1e-3
    elif what == "missing":
        del got.params["b"]
    else:
        got.grads["w"] = torch.ones(2, 3)
    problems = mismatches(got, ref)
    assert problems, what


def test_rounding_level_differences_pass():
    ref, got = _result(), _result()
    got.grads["w"] += 1e-7
    got.losses[0] *= 1 + 1e-6
    assert mismatches(got, ref) == []


def test_world_of_one_matches_reference(megatron_cpu):
    """Megatron's DDP + optimizer + schedule on one rank equal the plain reference loop."""
    from megatron_flat.testing.equivalence import Layout, assert_equivalent, run_layout, run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE(global_batch_size=4)
    ref = run_reference(tiny)
    result = run_layout(tiny, Layout(), ref)
    assert_equivalent(result, ref)
    assert set(result.grads) == set(ref.params)
