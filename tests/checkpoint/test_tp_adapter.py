"""The Megatron call shape ``checkpoint(function, distribute_saved_activations, *args)``.

Megatron-free: a stand-in RNG tracker with Megatron's ``get_states``/``set_states``/
``fork`` protocol drives the dropout, as model-parallel dropout does in Megatron.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from megatron_flat.checkpoint import SelectiveCheckpointOffload, tensor_parallel_checkpoint

S, B, H, DEPTH = 16, 2, 8, 4


class Tracker:
    """Named generator states, forked around model-parallel regions."""

    def __init__(self) -> None:
        self.states = {"model-parallel-rng": torch.Generator().manual_seed(123).get_state()}

    def get_states(self):
        return dict(self.states)

    def set_states(self, states) -> None:
        self.states = dict(states)

    @contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        g = torch.Generator()
        g.set_state(self.states[name])
        yield g
        self.states[name] = g.get_state()


def _layers(tracker: Tracker):
    torch.manual_seed(0)
    weights = [torch.randn(H, H, requires_grad=True) for _ in range(DEPTH)]

    def custom(i):
        # Megatron's custom_forward signature (0.16.1 order)
        def forward(
            hidden, attention_mask, context, context_mask, rotary_pos_emb, padding_mask=None
        ):
            assert context is None and context_mask is None and padding_mask is None
            with tracker.fork() as g:
                keep = (torch.rand(hidden.shape, generator=g) > 0.3).float()
            y = torch.nn.functional.dropout(hidden @ weights[i], 0.1) * keep / 0.7
            return hidden + (y * attention_mask + rotary_pos_emb).tanh(), context

        return forward

    return weights, custom


def _run(checkpoint_fn):
    tracker = Tracker()
    weights, custom = _layers(tracker)
    hidden = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
    mask = (torch.arange(H) % 4 != 0).float()
    rope = torch.linspace(-1, 1, H)
    ckpt = checkpoint_fn(tracker) if checkpoint_fn is not None else None
    torch.manual_seed(9)
    h = hidden * 1.0
    for i in range(DEPTH):
        if ckpt is None:
            h, _ = custom(i)(h, mask, None, None, rope, None)
        else:
            h, _ = ckpt(custom(i), False, h, mask, None, None, rope, None)
    h.square().sum().backward()
    return [hidden.grad] + [w.grad for w in weights]


def test_replays_rng_tracker_and_matches_no_checkpoint():
    ref = _run(None)
    scos = []

    def with_tracker(tracker):
        scos.append(SelectiveCheckpointOffload(1 << 20, device="cpu"))
        return tensor_parallel_checkpoint(scos[-1], get_rng_tracker=lambda: tracker)

    for u, v in zip(ref, _run(with_tracker)):
        assert torch.equal(u, v)
    s = scos[0].stats
    # only hidden_states is a boundary; mask and rotary embedding are shared, kept as is
    assert s.tensors_offloaded == DEPTH and s.tensors_skipped == 2 * DEPTH
    assert s.host_bytes_in_use == 0

    # without the tracker the recompute draws other masks: the comparison can fail
    def without_tracker(tracker):
        return tensor_parallel_checkpoint(SelectiveCheckpointOffload(1 << 20, device="cpu"))

    assert any(not torch.equal(u, v) for u, v in zip(ref, _run(without_tracker)))


def test_distribute_saved_activations_needs_fallback():
    sco = SelectiveCheckpointOffload(1 << 20, device="cpu")
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        tensor_parallel_checkpoint(sco)(lambda t: t * 2, True, x)
    calls = []

    def fallback(function, distribute, *args):
        calls.append(distribute)
        return function(*args)

    out = tensor_parallel_checkpoint(sco, fallback=fallback)(lambda t: t * 2, True, x)
    assert calls == [True] and torch.equal(out, x * 2)


def test_nested_calls_use_the_fallback_in_forward_and_recompute():
    """A layer that checkpoints a sub-module itself (MoE / MLP recompute in Megatron)."""
    sco = SelectiveCheckpointOffload(1 << 20, device="cpu")
    calls = []

    def fallback(function, distribute, *args):
        calls.append("nested")
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)

    ckpt = tensor_parallel_checkpoint(sco, fallback=fallback)
    torch.manual_seed(0)
    w = torch.randn(H, H, requires_grad=True)

    def run(outer, inner):
        def layer(hidden):
            return hidden + inner(lambda t: torch.tanh(t @ w), False, hidden)

        w.grad = None
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        h = x * 1.0
        for _ in range(3):
            h = outer(layer, h)
        h.square().sum().backward()
        return [x.grad, w.grad]

    ref = run(lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False), fallback)
    calls.clear()
    got = run(lambda f, h: ckpt(f, False, h), ckpt)
    for u, v in zip(ref, got):
        assert torch.equal(u, v)
    assert calls == ["nested"] * 6  # 3 layers: forward and recompute
    assert sco.stats.checkpoints == 3 and sco.stats.plain_fallbacks == 0
