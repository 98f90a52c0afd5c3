"""Under delayed copies SCO stays bitwise exact (the exactness tests run so with
FLAT_DELAYED_COPIES=1), and the reload's wait on its offload is needed."""

import pytest

from megatron_flat.checkpoint import SelectiveCheckpointOffload
from megatron_flat.checkpoint import transfer
from megatron_flat.runtime import streams
from megatron_flat.runtime.streams import delayed_copies

DEPTH = 4


def _run(stack):
    blocks, x = stack.make_stack(DEPTH), stack.make_input()
    ref = stack.step(blocks, x, stack.plain)
    got = stack.step(blocks, x, SelectiveCheckpointOffload(1 << 24, device="cpu").checkpoint)
    return ref, got


def test_bitwise_under_delayed_copies(stack):
    with delayed_copies():
        ref, got = _run(stack)
    stack.assert_bitwise(ref, got)


def test_reload_must_wait_for_its_offload(stack, monkeypatch):
    offloads = set()
    offload = transfer.SpanMover.offload

    def recording(self, src):
        span = offload(self, src)
        if span is not None:
            offloads.add(id(span.offloaded))
        return span

    monkeypatch.setattr(transfer.SpanMover, "offload", recording)
    wait = streams.Stream.wait_event

    def wait_event(self, event):
        if id(event) not in offloads:  # the reload's wait on the offload, removed
            wait(self, event)

    monkeypatch.setattr(streams.Stream, "wait_event", wait_event)
    with delayed_copies():
        ref, got = _run(stack)
    assert stack.differs(ref, got)
    with pytest.raises(AssertionError):
        stack.assert_bitwise(ref, got)


def test_a_dropped_sco_lets_its_copies_land_first(stack):
    """An SCO dropped with offloads in flight (replaced, its model freed) waits for them
    before its pool's pages and pending host bytes can go (on a GPU a late copy would write
    freed pinned memory); under delayed copies the last forward's offloads are still queued
    when the graph and the SCO are dropped."""
    import gc

    blocks, x = stack.make_stack(DEPTH), stack.make_input()
    with delayed_copies():
        sco = SelectiveCheckpointOffload(1 << 24, device="cpu")
        loss = stack.forward(blocks, x.clone().requires_grad_(), sco.checkpoint)
        assert streams.pending_copy_count() > 0
        del loss, sco
        gc.collect()
        assert streams.pending_copy_count() == 0
