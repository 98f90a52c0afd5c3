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
