"""Graph-only recompute (megatron_flat.dispatch.recompute) on one rank: a reentrant
checkpoint's re-run skips the dispatch exactly when nothing later in the region keeps the
output, verified on the first re-run; gradients bitwise those of the plain layer."""

from __future__ import annotations

import pytest
import torch

from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.dispatch.recompute import current_region
from megatron_flat.testing.moe_reference import RankCase
from megatron_flat.testing.reentrant import Reentrant


def _setup(mode="pipelined", graph_only=True, seed=4):
    bank = GLUExperts(4, 8, 8, generator=torch.Generator().manual_seed(2))
    eng = PipelinedLLEP(bank, num_experts=4, topk=2,
                        options=DispatchOptions(mode=mode, chunk_tokens=3,
                                                graph_only_recompute=graph_only))
    b = RankCase(10, 8, 4, 2, "0.6/1", seed=seed).build()
    return bank, eng, b


def _moe(eng, b):
    def fn(x, probs):
        return eng(x, b["route_token"], b["route_expert"], probs)
    return fn


REGIONS = {
    # The MoE output reaches the region's end through value-free ops only.
    "residual": lambda moe: lambda x, p: x + moe(x, p),
    "residual-dropout": lambda moe: lambda x, p: x + torch.nn.functional.dropout(
        moe(x, p) * 2.0, 0.0, training=True),
    # A later op keeps a tensor computed from the output (the next layer's norm, a GEMM).
    "norm-after": lambda moe: lambda x, p: torch.nn.functional.layer_norm(
        x + moe(x, p), (x.shape[-1],)),
    "square-after": lambda moe: lambda x, p: (x + moe(x, p)) ** 2,
}


def _grads(bank, eng, b, region, checkpoint: bool):
    for w in bank.parameters():
        w.grad = None
    x = b["tokens"].detach().requires_grad_()
    p = b["route_probs"].detach().requires_grad_()
    fn = REGIONS[region](_moe(eng, b))
    torch.manual_seed(0)
    out = Reentrant.apply(fn, x, p) if checkpoint else fn(x, p)
    out.backward(b["grad"])
    return [x.grad, p.grad] + [w.grad.clone() for w in bank.parameters()]


@pytest.mark.parametrize("mode", ["pipelined", "llep"])
@pytest.mark.parametrize("region", ["residual", "residual-dropout"])
def test_verified_then_graph_only_bitwise(mode, region):
    bank, eng, b = _setup(mode)
    want = _grads(bank, eng, b, region, checkpoint=False)
    assert eng.verdict.graph_only is None
    first = _grads(bank, eng, b, region, checkpoint=True)  # verification: values computed
    assert eng.verdict.graph_only is True and not eng.last.graph_only
    second = _grads(bank, eng, b, region, checkpoint=True)
    assert eng.last.graph_only and eng.verdict.graph_only_calls == 1
    for got in (first, second):
        for a, w in zip(got, want):
            assert torch.equal(a, w)


@pytest.mark.parametrize("region", ["norm-after", "square-after"])
def test_needed_output_falls_back_to_values(region):
    bank, eng, b = _setup()
    want = _grads(bank, eng, b, region, checkpoint=False)
    for _ in range(2):
        got = _grads(bank, eng, b, region, checkpoint=True)
        assert eng.verdict.graph_only is False and not eng.last.graph_only
        assert "computed from the MoE output" in eng.verdict.reason
        for a, w in zip(got, want):
            assert torch.equal(a, w)
    assert eng.verdict.graph_only_calls == 0


def test_region_that_changes_after_the_verdict_raises():
    """Graph-only was verified on one region shape; a later region keeps the zeros: an
    error, never a wrong gradient."""
    bank, eng, b = _setup()
    _grads(bank, eng, b, "residual", checkpoint=True)
    assert eng.verdict.graph_only is True
    with pytest.raises(RuntimeError, match="graph-only recompute .* returned zeros"):
        _grads(bank, eng, b, "norm-after", checkpoint=True)


def test_graph_only_forward_does_no_expert_work():
    """The graph-only re-run runs no expert: of the forward-time expert calls (autograd off
    inside the engine's forward), the verification step makes two sets (forward, re-run), a
    graph-only step one."""
    bank, eng, b = _setup()
    calls = []
    run = bank.run
    bank.run = lambda *a, **k: (calls.append(torch.is_grad_enabled()), run(*a, **k))[1]
    forward_calls = []
    for _ in range(2):  # verification, then graph-only
        calls.clear()
        _grads(bank, eng, b, "residual", checkpoint=True)
        forward_calls.append(sum(1 for grad in calls if not grad))
    assert eng.last.graph_only
    assert forward_calls[0] > 0 and forward_calls[0] == 2 * forward_calls[1]


def test_off_switch_and_plain_backward():
    bank, eng, b = _setup(graph_only=False)
    for _ in range(2):
        _grads(bank, eng, b, "residual", checkpoint=True)
    assert eng.verdict.graph_only is None and eng.verdict.watched_calls == 0
    # Outside any region (no checkpoint) nothing is watched either.
    bank, eng, b = _setup()
    _grads(bank, eng, b, "residual", checkpoint=False)
    assert eng.verdict.watched_calls == 0 and current_region() is None


def test_hooks_active_at_region_entry_still_run():
    """Saved-tensor hooks active when the region opens (activation offloading, SCO) still
    pack and unpack every tensor saved in the re-run."""
    bank, eng, b = _setup()
    want = _grads(bank, eng, b, "norm-after", checkpoint=False)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return ("mine", t)

    def unpack(x):
        unpacked.append(x[0])
        return x[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        x = b["tokens"].detach().requires_grad_()
        p = b["route_probs"].detach().requires_grad_()
        for w in bank.parameters():
            w.grad = None
        out = Reentrant.apply(REGIONS["norm-after"](_moe(eng, b)), x, p)
        n_forward = len(packed)
        out.backward(b["grad"])
    assert len(packed) > n_forward and unpacked
    assert eng.verdict.graph_only is False  # the check ran under the composed hooks
    for a, w in zip([x.grad, p.grad] + [w.grad for w in bank.parameters()], want):
        assert torch.equal(a, w)


def test_other_hooks_pushed_inside_the_region_disable_graph_only():
    """A call made while hooks pushed inside the region are on top could not be checked:
    it is neither watched nor graph-only."""
    bank, eng, b = _setup()

    def fn(x, p):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return x + _moe(eng, b)(x, p)

    x = b["tokens"].detach().requires_grad_()
    p = b["route_probs"].detach().requires_grad_()
    for _ in range(2):
        Reentrant.apply(fn, x, p).backward(b["grad"])
    assert eng.verdict.watched_calls == 0 and not eng.last.graph_only


def test_weights_bypass_saved_tensor_hooks():
    """The engine holds its weights, not saved copies: under saved-tensor hooks (a recompute
    region, activation offloading) the weight gradients still go straight into Megatron
    DDP's main_grad (an unpacked saved tensor would have lost that attribute)."""
    bank, eng, b = _setup()
    packed = []
    for w in bank.parameters():
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
    out.backward(b["grad"])
    assert not any(t is w for t in packed for w in bank.parameters())
    for w in bank.parameters():
        assert w.grad_added_to_main_grad and w.main_grad.abs().sum() > 0
