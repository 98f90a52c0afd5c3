"""Megatron's reentrant checkpoint opens recompute regions (megatron_flat.megatron.regions):
its re-run of a flat MoE layer is graph-only after a first verified re-run; ``disable()``
puts Megatron's function back."""

from __future__ import annotations

import torch

from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.testing.moe_reference import RankCase


def _step(eng, bank, b):
    from megatron.core import tensor_parallel

    for w in bank.parameters():
        w.grad = None
    x = b["tokens"].detach().requires_grad_()
    probs = b["route_probs"].detach()

    def region(h):
        return h + eng(h, b["route_token"], b["route_expert"], probs)

    tensor_parallel.checkpoint(region, False, x).backward(b["grad"])
    return [x.grad] + [w.grad.clone() for w in bank.parameters()]


def test_megatron_checkpoint_rerun_is_graph_only(megatron_cpu):
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from megatron_flat.megatron import regions

    from megatron_flat.megatron import checkpoint_phase

    was = regions.enabled(), checkpoint_phase.enabled()
    regions.disable()
    checkpoint_phase.disable()
    try:
        # With no hook on Megatron's checkpoint its backward is Megatron's own again.
        plain = CheckpointFunction.backward
        assert getattr(plain, "__wrapped__", None) is None
        bank = GLUExperts(4, 8, 8, generator=torch.Generator().manual_seed(2))
        eng = PipelinedLLEP(bank, num_experts=4, topk=2, options=DispatchOptions(chunk_tokens=3))
        b = RankCase(10, 8, 4, 2, "0.6/1", seed=4).build()
        want = _step(eng, bank, b)  # Megatron's own checkpoint: no region, values
        assert eng.verdict.watched_calls == 0
        regions.enable()
        regions.enable()  # idempotent
        assert regions.enabled() and CheckpointFunction.backward is not plain
        first, second = _step(eng, bank, b), _step(eng, bank, b)
        assert eng.verdict.graph_only and eng.verdict.graph_only_calls == 1
        assert eng.last.graph_only
        for got in (first, second):
            assert all(torch.equal(a, w) for a, w in zip(got, want))
        regions.disable()
        assert CheckpointFunction.backward is plain and not regions.enabled()
    finally:
        regions.disable()
        if was[0]:
            regions.enable()
        if was[1]:
            checkpoint_phase.enable()
