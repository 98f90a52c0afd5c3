"""Streams and events: real on CUDA, inline on CPU.

On CPU every op has completed when it returns, so a CPU stream is the single
inline stream: waits are no-ops, events are complete as soon as they exist,
and synchronisation returns at once. Code written against this module runs
unchanged on both.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch

from megatron_flat.runtime import ledger

__all__ = ["Event", "Stream", "current_stream", "record_stream", "use_stream"]

DeviceLike = Union[str, int, torch.device, None]


def _resolve_device(device: DeviceLike) -> torch.device:
    """None means CUDA when available, else CPU; an int is a CUDA index."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {resolved} requested but CUDA is not available")
        index = resolved.index if resolved.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise ValueError(f"streams support cpu and cuda devices, got {resolved}")
    return resolved


class Event:
    """A point in a stream's work; wraps ``torch.cuda.Event`` on CUDA."""

    def __init__(self, device: DeviceLike = None, enable_timing: bool = False) -> None:
        self.device = _resolve_device(device)
        self._event: Optional[torch.cuda.Event] = (
            torch.cuda.Event(enable_timing=enable_timing)
            if self.device.type == "cuda"
            else None
        )

    @property
    def cuda_event(self) -> Optional[torch.cuda.Event]:
        """The wrapped CUDA event, or None on CPU."""
        return self._event

    def record(self, stream: Optional["Stream"] = None) -> None:
        """Mark the point reached by ``stream`` (default: current stream of the device)."""
        if self._event is None:
            return
        target = stream if stream is not None else current_stream(self.device)
        _check_same_device(self.device, target.device)
        self._event.record(target.cuda_stream)

    def wait(self, stream: Optional["Stream"] = None) -> None:
        """Make ``stream``'s later work wait for this event; the host does not block."""
        if self._event is None:
            return
        target = stream if stream is not None else current_stream(self.device)
        # A stream may wait on an event recorded on another CUDA device.
        _check_same_type(self.device, target.device)
        self._event.wait(target.cuda_stream)

    def synchronize(self) -> None:
        """Block the host until the recorded work has completed (a host sync: counted
        by open cost ledgers, on CPU too, where it returns at once)."""
        ledger.record_sync("event_synchronize")
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        """True when the recorded work has completed (always on CPU)."""
        return True if self._event is None else bool(self._event.query())

    def __repr__(self) -> str:
        return f"Event(device={self.device})"


class Stream:
    """An ordered queue of device work; wraps ``torch.cuda.Stream`` on CUDA.

    ``Stream(device)`` creates a new CUDA stream; on CPU every stream is the
    inline one, so all CPU streams compare equal.
    """

    def __init__(
        self,
        device: DeviceLike = None,
        priority: int = 0,
        *,
        cuda_stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        self.device = _resolve_device(device)
        self._stream: Optional[torch.cuda.Stream] = None
        if self.device.type == "cuda":
            self._stream = (
                cuda_stream
                if cuda_stream is not None
                else torch.cuda.Stream(device=self.device, priority=priority)
            )
        elif cuda_stream is not None:
            raise ValueError("cuda_stream given for a CPU stream")

    @property
    def cuda_stream(self) -> Optional[torch.cuda.Stream]:
        """The wrapped CUDA stream, or None on CPU."""
        return self._stream

    def wait_stream(self, other: "Stream") -> None:
        """Make later work on this stream wait for work already queued on ``other``."""
        _check_same_type(self.device, other.device)
        if self._stream is not None:
            self._stream.wait_stream(other._stream)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""
        _check_same_type(self.device, event.device)
        if self._stream is not None:
            self._stream.wait_event(event.cuda_event)

    def record_event(self, event: Optional[Event] = None) -> Event:
        """Record ``event`` (a new one by default) on this stream and return it."""
        if event is None:
            event = Event(self.device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has completed (a host sync:
        counted by open cost ledgers, on CPU too)."""
        ledger.record_sync("stream_synchronize")
        if self._stream is not None:
            self._stream.synchronize()

    def query(self) -> bool:
        """True when all queued work has completed (always on CPU)."""
        return True if self._stream is None else bool(self._stream.query())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return self.device == other.device and self._stream == other._stream

    def __hash__(self) -> int:
        return hash((self.device, self._stream))

    def __repr__(self) -> str:
        return f"Stream(device={self.device}, cuda_stream={self._stream})"


def _check_same_type(a: torch.device, b: torch.device) -> None:
    # Cross-device CUDA waits are legal; mixing CPU and CUDA is a bug.
    if a.type != b.type:
        raise ValueError(f"cannot synchronise a {a.type} stream with {b.type} work")


def _check_same_device(a: torch.device, b: torch.device) -> None:
    if a != b:
        raise ValueError(f"event on {a} cannot be used with a stream on {b}")


def current_stream(device: DeviceLike = None) -> Stream:
    """The stream that work on ``device`` is queued to right now."""
    resolved = _resolve_device(device)
    if resolved.type == "cpu":
        return Stream(resolved)
    return Stream(resolved, cuda_stream=torch.cuda.current_stream(resolved))


@contextmanager
def use_stream(stream: Optional[Stream]) -> Iterator[Optional[Stream]]:
    """Queue work issued in the block to ``stream`` (no-op on CPU or for None)."""
    if stream is None or stream.cuda_stream is None:
        yield stream
        return
    with torch.cuda.stream(stream.cuda_stream):
        yield stream


def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
    """Tell the CUDA caching allocator that ``tensor`` is used on ``stream``.

    Its memory then is not reused before the work queued so far on ``stream``
    completes. No-op for non-CUDA tensors (pinned host memory used by
    ``non_blocking`` copies is tracked by the host allocator itself).
    """
    if tensor.device.type != "cuda":
        return
    if stream.cuda_stream is None:
        raise ValueError("a CUDA tensor can only be recorded on a CUDA stream")
    tensor.record_stream(stream.cuda_stream)
