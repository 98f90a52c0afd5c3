"""Under delayed copies OffloadStreamAdamW stays bitwise exact, and each of the staging
pipeline's waits is needed: removing one makes the step wrong."""

import pytest
import torch

from megatron_flat.optim import OffloadStreamAdamW, pipeline
from megatron_flat.runtime import streams
from megatron_flat.runtime.streams import delayed_copies

SHAPES = [(40, 30), (500,), (7,), (64, 64)]


def _train(steps=3, bucket_numel=700, num_slots=2):
    """Three steps on fixed gradients; several buckets per step, so slots are reused."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]
    opt = OffloadStreamAdamW(params, lr=1e-2, weight_decay=0.1, bucket_numel=bucket_numel,
                             num_slots=num_slots)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    state = [opt.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq")]
    return [p.detach().clone() for p in params] + state


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def reference():
    return _train()


def test_bitwise_under_delayed_copies(reference):
    with delayed_copies():
        assert _same(_train(), reference)


@pytest.fixture
def slot_events(monkeypatch):
    """Every staging slot's events, by kind, as the slots are made."""
    found = {"uploaded": set(), "free": set()}
    made = pipeline.Slot.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        for kind, events in found.items():
            events.add(id(getattr(self, kind)))

    monkeypatch.setattr(pipeline.Slot, "__init__", init)
    return found


def _skip_waits_on(monkeypatch, ids):
    wait = streams.Stream.wait_event

    def wait_event(self, event):
        if id(event) in ids:
            return  # the wait under test, removed
        wait(self, event)

    monkeypatch.setattr(streams.Stream, "wait_event", wait_event)


@pytest.mark.parametrize("wait", ["uploaded", "free"])
def test_each_pipeline_wait_is_needed(reference, slot_events, monkeypatch, wait):
    """The update waits for its upload; a slot's next upload waits until the write-back of
    its previous tenant has read it (reuse). (The write-back's wait for the update orders a
    copy after compute, which the CPU model runs at issue: the GPU check covers that one.)"""
    _skip_waits_on(monkeypatch, slot_events[wait])
    with delayed_copies():
        got = _train()
    assert not _same(got, reference)
