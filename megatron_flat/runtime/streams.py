"""Streams and events: real on CUDA, inline on CPU.

On CPU every op has completed when it returns, so a CPU stream is the single
inline stream: waits are no-ops, events are complete as soon as they exist,
and synchronisation returns at once. Code written against this module runs
unchanged on both.

**Delayed copies** (:func:`delayed_copies`, CPU only, for tests): a copy issued with
:func:`copy` on a side stream (inside ``use_stream(s)``) does not happen when issued. Its
destination reads as poison (NaN; 0xFF bytes for integers) and the copy is done as late as
the ordering allows: when a wait makes it due (``Event.wait``/``synchronize`` on an event
recorded after it, ``wait_stream``/``synchronize`` of its stream), in issue order per stream,
reading its source then. Compute runs when issued. So code that reads a copy's destination
without waiting for it, or overwrites a copy's source before it is done, computes with poison
or wrong data and fails a bitwise test, deterministically — what a late copy engine would do
on a GPU, only every time. A copy's source is held as the CUDA caching allocator holds it: if
every tensor on its storage is gone before the copy runs, the copy reads nothing and its
destination stays poison, unless :func:`record_stream` put the source on the copy's stream.
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Tuple, Union

import torch

from megatron_flat.runtime import ledger

__all__ = ["Event", "Stream", "copy", "current_stream", "delayed_copies", "delayed_copy_count",
           "delaying", "lost_copy_count", "pending_copy_count", "poison", "record_stream",
           "synchronize_on_drop", "use_stream"]

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


# ---------------------------------------------------------------------------- delayed copies
class _Source:
    """A delayed copy's source, held as the CUDA caching allocator holds a block: not at all.
    Once every tensor on its storage is gone the block may serve the next allocation, so a copy
    that runs later reads garbage (here: nothing; its destination stays poison), unless
    :func:`record_stream` put the source on the copy's stream (the queue then keeps it)."""

    def __init__(self, src: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.storage = StorageWeakRef(src.untyped_storage())
        self.geometry = (src.dtype, src.storage_offset(), tuple(src.shape), src.stride())

    def get(self) -> Optional[torch.Tensor]:
        if self.storage.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        dtype, offset, shape, stride = self.geometry
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


class _CopyQueue:
    """One CPU side stream's copies not yet done (delayed-copies mode)."""

    def __init__(self) -> None:
        self.pending: List[Tuple[int, torch.Tensor, _Source, bool]] = []
        self.recorded: List[Tuple[int, torch.Tensor]] = []  # record_stream: kept until done
        self.issued = 0
        self.done = 0

    def add(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        _MODE["delayed"] += 1
        self.issued += 1
        # the flag goes with the copy: the cost ledger counts a blocking one as a sync
        self.pending.append((self.issued, dst, _Source(src), non_blocking))
        _BUSY.add(self)  # queued work outlives its Stream object, as on a GPU
        poison(dst)

    def record(self, tensor: torch.Tensor) -> None:
        """``record_stream``: ``tensor`` stays alive until the copies queued so far are done."""
        if self.pending:
            self.recorded.append((self.issued, tensor))

    def complete(self, upto: Optional[int] = None) -> None:
        upto = self.issued if upto is None else upto
        while self.pending and self.pending[0][0] <= upto:
            seq, dst, source, non_blocking = self.pending.pop(0)
            src = source.get()
            if src is None:
                _MODE["lost"] += 1  # freed before its copy ran: the destination stays poison
            else:
                with torch.no_grad():
                    dst.copy_(src, non_blocking=non_blocking)
            del src
            self.done = seq
        self.recorded = [(seq, t) for seq, t in self.recorded if seq > self.done]
        if not self.pending:
            _BUSY.discard(self)


def poison(dst: torch.Tensor) -> None:
    """Fill ``dst`` with what an unfinished transfer leaves there: NaN (floats), -1 (integers),
    0xFF (bytes; uint8 spans of any dtype's bytes read as NaN in every float)."""
    with torch.no_grad():
        if dst.is_floating_point() or dst.is_complex():
            dst.fill_(float("nan"))
        else:
            dst.fill_(255 if dst.dtype == torch.uint8 else -1)


def delaying() -> bool:
    """True inside :func:`delayed_copies` (so exchanges can defer themselves too:
    :mod:`megatron_flat.runtime.deferred`)."""
    return bool(_MODE["on"])


class _Delayed(threading.local):
    current: Optional[_CopyQueue] = None


_DELAYED = _Delayed()
# nesting depth; copies delayed since the process started; of them, sources freed too early
_MODE = {"on": 0, "delayed": 0, "lost": 0}
_BUSY: set = set()  # queues with copies pending


@contextmanager
def delayed_copies() -> Iterator[None]:
    """Turn on delayed copies (see the module doc) for the block; CPU only. Copies still
    pending at the end are done then."""
    _MODE["on"] += 1
    try:
        yield
    finally:
        _MODE["on"] -= 1
        if not _MODE["on"]:
            for queue in list(_BUSY):
                queue.complete()


def lost_copy_count() -> int:
    """Delayed copies whose source was freed before they ran (no ``record_stream``): their
    destinations stayed poison, as a GPU copy would have read a reused block."""
    return _MODE["lost"]


def pending_copy_count() -> int:
    """Delayed copies queued and not yet done, on every CPU side stream."""
    return sum(len(queue.pending) for queue in list(_BUSY))


def delayed_copy_count() -> int:
    """Copies delayed since the process started (so a test can show its copies really were
    queued late, not done at issue)."""
    return _MODE["delayed"]


# On CUDA, FLAT_CUDA_COPY_SLEEP_CYCLES=N queues a sleep kernel of N cycles before every copy
# on a side stream, so each copy lands late and a missing wait shows (benchmarks/gpu_check.sh).
_CUDA_SLEEP_CYCLES = int(os.environ.get("FLAT_CUDA_COPY_SLEEP_CYCLES", "0") or 0)
# FLAT_CUDA_PRODUCER_SLEEP_CYCLES=N queues it on the compute stream instead, each time work
# returns there from a side stream: the producers (and consumers) the next side-stream copy
# must wait for land late, which a late copy would hide (scripts/mutants.py --gpu runs the
# mutants of a missing producer wait so).
_CUDA_PRODUCER_SLEEP_CYCLES = int(os.environ.get("FLAT_CUDA_PRODUCER_SLEEP_CYCLES", "0") or 0)


def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src, non_blocking=...)`` on the current stream; in delayed-copies mode a
    copy on a CPU side stream is queued there (see the module doc). Returns ``dst``."""
    if _CUDA_SLEEP_CYCLES and (dst.is_cuda or src.is_cuda):
        device = dst.device if dst.is_cuda else src.device
        if torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
            torch.cuda._sleep(_CUDA_SLEEP_CYCLES)
    queue = _DELAYED.current if _MODE["on"] else None
    if queue is None or dst.device.type != "cpu" or src.device.type != "cpu":
        return dst.copy_(src, non_blocking=non_blocking)
    queue.add(dst, src, non_blocking)
    return dst


class Event:
    """A point in a stream's work; wraps ``torch.cuda.Event`` on CUDA."""

    def __init__(self, device: DeviceLike = None, enable_timing: bool = False) -> None:
        self.device = _resolve_device(device)
        self._event: Optional[torch.cuda.Event] = (
            torch.cuda.Event(enable_timing=enable_timing)
            if self.device.type == "cuda"
            else None
        )
        # Delayed copies: (queue, copies issued there when recorded).
        self._mark: Optional[Tuple[_CopyQueue, int]] = None

    def _complete(self) -> None:
        if self._mark is not None:
            queue, upto = self._mark
            queue.complete(upto)

    @property
    def cuda_event(self) -> Optional[torch.cuda.Event]:
        """The wrapped CUDA event, or None on CPU."""
        return self._event

    def record(self, stream: Optional["Stream"] = None) -> None:
        """Mark the point reached by ``stream`` (default: current stream of the device)."""
        ledger.record_stream_call("event_record")
        if self._event is None:
            queue = stream._copies() if stream is not None else None
            self._mark = (queue, queue.issued) if queue is not None else None
            return
        target = stream if stream is not None else current_stream(self.device)
        _check_same_device(self.device, target.device)
        self._event.record(target.cuda_stream)

    def wait(self, stream: Optional["Stream"] = None) -> None:
        """Make ``stream``'s later work wait for this event; the host does not block."""
        ledger.record_stream_call("event_wait")
        if self._event is None:
            self._complete()  # delayed copies: due before the waiting stream's later work
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
        else:
            self._complete()

    def query(self) -> bool:
        """True when the recorded work has completed (on CPU: unless delayed copies before
        it are pending)."""
        ledger.record_stream_call("event_query")
        if self._event is None:
            return self._mark is None or self._mark[0].done >= self._mark[1]
        return bool(self._event.query())

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
        self._queue: Optional[_CopyQueue] = None  # delayed copies (CPU side streams)
        self._side = True  # current_stream() marks the default stream
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

    def _copies(self) -> Optional[_CopyQueue]:
        """This CPU side stream's delayed-copy queue (made on first use in that mode)."""
        if self._queue is None and self._side and self._stream is None and _MODE["on"]:
            self._queue = _CopyQueue()
        return self._queue

    def wait_stream(self, other: "Stream") -> None:
        """Make later work on this stream wait for work already queued on ``other``."""
        _check_same_type(self.device, other.device)
        # torch records an event on ``other`` and makes this stream wait for it
        ledger.record_stream_call("event_record")
        ledger.record_stream_call("event_wait")
        if self._stream is not None:
            self._stream.wait_stream(other._stream)
        elif other._queue is not None:
            other._queue.complete()

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""
        _check_same_type(self.device, event.device)
        ledger.record_stream_call("event_wait")
        if self._stream is not None:
            self._stream.wait_event(event.cuda_event)
        else:
            event._complete()

    def record_event(self, event: Optional[Event] = None) -> Event:
        """Record ``event`` (a new one by default) on this stream and return it."""
        if event is None:
            event = Event(self.device)
        event.record(self)  # counted by Event.record
        return event

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has completed (a host sync:
        counted by open cost ledgers, on CPU too)."""
        ledger.record_sync("stream_synchronize")
        if self._stream is not None:
            self._stream.synchronize()
        elif self._queue is not None:
            self._queue.complete()

    def query(self) -> bool:
        """True when all queued work has completed (on CPU: no delayed copy pending)."""
        if self._stream is None:
            return self._queue is None or not self._queue.pending
        return bool(self._stream.query())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        if self._queue is not None or other._queue is not None:
            return self._queue is other._queue
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
        stream = Stream(resolved)
        stream._side = False  # the inline stream: its copies are never delayed
        return stream
    return Stream(resolved, cuda_stream=torch.cuda.current_stream(resolved))


@contextmanager
def use_stream(stream: Optional[Stream]) -> Iterator[Optional[Stream]]:
    """Queue work issued in the block to ``stream`` (no-op on CPU or for None; with delayed
    copies on, :func:`copy` calls in the block are queued on the CPU side stream)."""
    if stream is not None and stream._side:
        ledger.record_stream_call("set_stream", 2)  # switched to, and back at the end
    if stream is None or stream.cuda_stream is None:
        queue = stream._copies() if stream is not None and _MODE["on"] else None
        previous, _DELAYED.current = _DELAYED.current, queue
        try:
            yield stream
        finally:
            _DELAYED.current = previous
        return
    with torch.cuda.stream(stream.cuda_stream):
        yield stream
    if _CUDA_PRODUCER_SLEEP_CYCLES and stream._side:
        # Late producers: the work the compute stream queues next (the tensor the next copy
        # reads, the consumer of a slot the next copy writes) lands late, so a side-stream
        # copy that forgot to wait for it reads or overwrites it too early.
        torch.cuda._sleep(_CUDA_PRODUCER_SLEEP_CYCLES)


def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
    """Tell the CUDA caching allocator that ``tensor`` is used on ``stream``.

    Its memory then is not reused before the work queued so far on ``stream``
    completes. No-op for non-CUDA tensors (pinned host memory used by
    ``non_blocking`` copies is tracked by the host allocator itself).
    """
    if tensor.device.type == "cuda" or ledger.is_device_data(tensor):
        ledger.record_stream_call("record_stream")
    if tensor.device.type != "cuda":
        queue = stream._queue if stream.cuda_stream is None else None
        if queue is not None:  # delayed copies: the source outlives its copy, as on a GPU
            queue.record(tensor)
        return
    if stream.cuda_stream is None:
        raise ValueError("a CUDA tensor can only be recorded on a CUDA stream")
    tensor.record_stream(stream.cuda_stream)


def _synchronize_quietly(wait: Callable[[], None], keep: tuple) -> None:
    # Teardown, not step work: the wait is not counted by an open cost ledger (a finalizer
    # runs whenever the collector drops its owner, inside any block). ``keep`` is only held:
    # the finalizer lets go of its arguments once this returns.
    with ledger.quietly():
        wait()


def synchronize_on_drop(owner: object, wait: Callable[[], None],
                        keep: tuple = ()) -> "weakref.finalize":
    """When ``owner`` is collected, call ``wait`` (a synchronize of the side streams it
    issued copies on) and only then let go of ``keep`` (the device slots and host pages those
    copies read or write): memory a copy in flight still uses is never handed back. The
    returned finalizer runs it earlier (an explicit close); it does not run at interpreter
    exit. Until then ``keep`` lives as long as ``owner``."""
    finalizer = weakref.finalize(owner, _synchronize_quietly, wait, keep)
    finalizer.atexit = False
    return finalizer
