"""Delayed copies (runtime.streams): side-stream copies land only when a wait makes them due."""

import math

import torch

from megatron_flat.runtime import Event, Stream, current_stream, use_stream
from megatron_flat.runtime.streams import copy, delayed_copies


def test_destination_is_poison_until_a_wait_makes_the_copy_due():
    src, dst = torch.arange(4.0), torch.zeros(4)
    with delayed_copies():
        side = Stream("cpu")
        with use_stream(side):
            copy(dst, src)
            event = side.record_event()
        assert torch.isnan(dst).all() and not event.query() and not side.query()
        src += 10  # the copy reads its source when it runs, as a copy engine would
        current_stream("cpu").wait_event(event)
        assert torch.equal(dst, torch.arange(4.0) + 10) and event.query()


def test_copies_run_in_issue_order_up_to_the_event():
    a, b, out1, out2 = torch.ones(2), torch.full((2,), 2.0), torch.zeros(2), torch.zeros(2)
    with delayed_copies():
        side = Stream("cpu")
        with use_stream(side):
            copy(out1, a)
            first = side.record_event()
            copy(out2, b)
        first.synchronize()
        assert torch.equal(out1, a) and torch.isnan(out2).all()
        current_stream("cpu").wait_stream(side)
        assert torch.equal(out2, b)


def test_integer_destinations_read_as_nan_floats_until_done():
    src, dst = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    with delayed_copies():
        side = Stream("cpu")
        with use_stream(side):
            copy(dst, src)
        assert math.isnan(dst.view(torch.float32)[0].item())
        side.synchronize()
        assert torch.equal(dst, src)


def test_inline_stream_and_mode_off_copy_at_once():
    src, dst = torch.ones(3), torch.zeros(3)
    with delayed_copies():
        copy(dst, src)  # the current (inline) stream
    assert torch.equal(dst, src)
    dst.zero_()
    with use_stream(Stream("cpu")):
        copy(dst, src)
    assert torch.equal(dst, src)


def test_pending_copies_are_done_when_the_mode_ends():
    src, dst = torch.ones(3), torch.zeros(3)
    with delayed_copies():
        with use_stream(Stream("cpu")):
            copy(dst, src)
    assert torch.equal(dst, src)
    assert Event("cpu").query()


def test_a_source_freed_before_its_copy_ran_is_lost_unless_recorded():
    """The caching allocator's rule: a source whose last tensor is gone may be reused before
    a late copy reads it (the destination stays poison); ``record_stream`` on the copy's
    stream keeps it until the copies queued so far are done. A view dying alone is harmless:
    its storage is still held."""
    from megatron_flat.runtime.streams import lost_copy_count, record_stream

    side = Stream("cpu")
    with delayed_copies():
        lost = lost_copy_count()
        kept, dropped, viewed = torch.empty(4), torch.empty(4), torch.empty(2)
        base = torch.arange(4.0)
        with use_stream(side):
            src = torch.arange(4.0) + 1
            copy(kept, src)
            record_stream(src, side)
            copy(dropped, torch.arange(4.0) + 2)  # a temporary, never recorded
            copy(viewed, base[1:3])  # the view dies, ``base`` holds the storage
        del src
        side.synchronize()
        assert torch.equal(kept, torch.arange(4.0) + 1)
        assert torch.isnan(dropped).all()
        assert torch.equal(viewed, base[1:3])
        assert lost_copy_count() == lost + 1
