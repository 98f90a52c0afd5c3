"""Streams and events: inline on CPU, real on CUDA."""

from __future__ import annotations

import pytest
import torch

from megatron_flat.runtime import (
    Event,
    Stream,
    current_stream,
    record_stream,
    use_stream,
)


def test_cpu_stream_is_inline() -> None:
    stream = Stream("cpu")
    other = Stream("cpu")
    assert stream.device == torch.device("cpu")
    assert stream.cuda_stream is None
    assert stream == other == current_stream("cpu")
    assert len({stream, other}) == 1
    stream.wait_stream(other)
    event = other.record_event()
    assert isinstance(event, Event) and event.device.type == "cpu"
    stream.wait_event(event)
    assert event.query() and stream.query()
    event.synchronize()
    stream.synchronize()


def test_cpu_event_is_always_complete() -> None:
    event = Event("cpu")
    assert event.cuda_event is None
    assert event.query()  # even before recording
    event.record()
    event.wait()
    assert event.query()
    again = Event("cpu")
    assert Stream("cpu").record_event(again) is again


def test_use_stream_runs_work_inline_on_cpu() -> None:
    stream = Stream("cpu")
    x = torch.ones(4)
    with use_stream(stream) as entered:
        assert entered is stream
        y = x * 2
    assert torch.equal(y, torch.full((4,), 2.0))
    with use_stream(None) as entered:
        assert entered is None


def test_record_stream_is_a_no_op_for_cpu_tensors() -> None:
    t = torch.ones(3)
    record_stream(t, Stream("cpu"))
    assert torch.equal(t, torch.ones(3))


def test_device_validation() -> None:
    with pytest.raises(ValueError):
        Stream("meta")
    with pytest.raises(ValueError):
        Event("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            Stream("cuda")
        with pytest.raises(ValueError):
            current_stream(0)
    else:
        with pytest.raises(ValueError):
            Stream("cpu").wait_stream(Stream("cuda"))


def test_default_device_follows_cuda_availability() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert Stream().device.type == expected
    assert current_stream().device.type == expected
    assert Event().device.type == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_ordering_with_events() -> None:
    side = Stream("cuda")
    main = current_stream("cuda")
    assert main.cuda_stream == torch.cuda.current_stream()
    x = torch.ones(1 << 20, device="cuda")
    side.wait_stream(main)
    with use_stream(side):
        assert torch.cuda.current_stream() == side.cuda_stream
        y = x * 3
        record_stream(x, side)
    done = side.record_event()
    main.wait_event(done)
    done.synchronize()
    assert done.query()
    assert float(y.sum()) == 3.0 * (1 << 20)
    main.synchronize()
    assert main.query()
