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


def test_param_outliers_only_few_and_within_one_adam_move():
    from megatron_flat.testing.equivalence import PARAM_ATOL
    from megatron_flat.testing.training import LR

    def with_big(delta_elems, delta):
        ref, got = _result(), _result()
        for r in (ref, got):
            r.params["big"] = torch.zeros(4096)
        got.params["big"][:delta_elems] += delta
        return mismatches(got, ref)

    assert PARAM_ATOL < 0.5 * LR
    assert with_big(1, 0.5 * LR) == []            # one rounding-level flip: accepted
    assert with_big(4, 1.5 * LR) == []            # a few, within Adam's move over 2 steps
    assert with_big(1, 3 * LR)                    # further than Adam can move: reported
    assert with_big(100, 0.5 * LR)                # many elements: a real error
    ref, got = _result(), _result()
    got.params["w"][0, 0] += 0.5 * LR             # small tensors get no outlier
    assert mismatches(got, ref)


def test_rounding_level_differences_pass():
    ref, got = _result(), _result()
    got.grads["w"] += 1e-7
    got.losses[0] *= 1 + 1e-6
    assert mismatches(got, ref) == []


def test_reference_is_made_once_and_handed_out_as_copies(megatron_cpu, monkeypatch):
    """The files of one session share each reference run; a caller's change stays its own."""
    import torch

    from megatron_flat.testing import equivalence
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE(global_batch_size=4, seed=5)
    runs = []
    made = equivalence._reference_run
    monkeypatch.setattr(equivalence, "_reference_run", lambda *a: runs.append(a) or made(*a))
    first = equivalence.run_reference(tiny, steps=1)
    first.params[next(iter(first.params))].add_(1.0)
    first.losses[0] = -1.0
    again = equivalence.run_reference(tiny, steps=1)
    other = equivalence.run_reference(tiny, steps=2)
    assert len(runs) == 2  # (tiny, 1) once, (tiny, 2) once
    fresh = made(tiny, 1, None, False)
    assert again.losses == fresh.losses and again.losses[0] != -1.0
    assert all(torch.equal(again.params[k], fresh.params[k]) for k in fresh.params)
    assert len(other.losses) == 2


def test_world_of_one_matches_reference(megatron_cpu):
    """Megatron's DDP + optimizer + schedule on one rank equal the plain reference loop."""
    from megatron_flat.testing.equivalence import Layout, assert_equivalent, run_layout, run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE(global_batch_size=4)
    ref = run_reference(tiny)
    result = run_layout(tiny, Layout(), ref)
    assert_equivalent(result, ref)
    assert set(result.grads) == set(ref.params)


def test_tiny_model_rejects_bad_shapes():
    from megatron_flat.testing.tiny_gpt import TinyMoE, dp_share, global_batch

    with pytest.raises(ValueError, match="micro_batch_size"):
        TinyMoE(global_batch_size=5, micro_batch_size=2)
    with pytest.raises(ValueError, match="topk"):
        TinyMoE(topk=5)
    with pytest.raises(ValueError, match="synthetic data"):
        TinyMoE(data="text")
    with pytest.raises(ValueError, match="data-parallel size 3"):
        dp_share(global_batch(TinyMoE()), 0, 3)


def test_global_batch_is_deterministic_and_layout_independent():
    from megatron_flat.testing.tiny_gpt import TinyMoE, dp_share, global_batch

    tiny = TinyMoE()
    a, b = global_batch(tiny, 3), global_batch(tiny, 3)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert not torch.equal(global_batch(tiny, 4)[0].tokens, a[0].tokens)
    halves = dp_share(a, 0, 2) + dp_share(a, 1, 2)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(halves, a))
    # labels are the tokens shifted by one
    assert torch.equal(a[0].labels[:, :-1], a[0].tokens[:, 1:])
    zipf = global_batch(tiny.with_(data="zipf"), 0)[0].tokens
    assert (zipf < 8).float().mean() > 0.3  # the skew the demo learns
