"""Device <-> host-pool copies of byte spans on side streams, with their events.

``SpanMover`` owns two side streams per device: ``d2h`` for offloads and
``h2d`` for reloads (on CPU both are the inline stream and every wait is a
no-op, see :mod:`megatron_flat.runtime.streams`). The ordering rules it
enforces, each with the hazard it prevents:

* offload: ``d2h`` waits for the producing (current) stream before reading the
  device bytes; the device block is recorded on ``d2h`` so the caching
  allocator does not hand it out again before the copy has read it.
* reload: ``h2d`` waits for the OFFLOAD's event before reading the host bytes
  (reading them earlier races with the offload and silently corrupts
  gradients); it also waits for the current stream, which may still be using
  the freshly allocated destination block's previous contents. The
  destination is recorded on ``h2d`` in case it is dropped unused.
* use: the consumer waits for the reload's event (:meth:`HostSpan.wait`).
* release: host bytes go back to the pool only after the last copy touching
  them has completed; until then they sit in a pending list that is drained
  on every acquire (and synchronised when the pool would otherwise be full).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from megatron_flat.runtime import Event, HostPool, Stream, current_stream, record_stream, use_stream
from megatron_flat.runtime.streams import copy

__all__ = ["HostSpan", "SpanMover"]


class HostSpan:
    """One span's bytes in the host pool plus the events of copies touching them."""

    __slots__ = ("host", "device", "nbytes", "offloaded", "last_copy", "released")

    def __init__(self, host: torch.Tensor, device: torch.device, offloaded: Event) -> None:
        self.host = host
        self.device = device
        self.nbytes = host.numel()
        self.offloaded = offloaded  # the offload copy is complete when this fires
        self.last_copy = offloaded  # the latest copy reading or writing ``host``
        self.released = False


class SpanMover:
    """Offload flat uint8 device spans into ``pool`` and reload them; thread-safe."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._streams: dict[torch.device, tuple[Stream, Stream]] = {}
        self._pending: list[tuple[torch.Tensor, Event]] = []
        self._lock = threading.Lock()

    def _side_streams(self, device: torch.device) -> tuple[Stream, Stream]:
        pair = self._streams.get(device)
        if pair is None:
            pair = self._streams[device] = (Stream(device), Stream(device))
        return pair

    # -- host bytes -----------------------------------------------------------

    def drain(self, wait: bool = False) -> None:
        """Return host bytes whose last copy has completed (all of them with ``wait``)."""
        with self._lock:
            pending, self._pending = self._pending, []
        keep = []
        for host, event in pending:
            if wait:
                event.synchronize()
            if wait or event.query():
                self.pool.release(host)
            else:
                keep.append((host, event))
        if keep:
            with self._lock:
                self._pending.extend(keep)

    def _acquire(self, nbytes: int) -> Optional[torch.Tensor]:
        self.drain()
        host = self.pool.acquire((nbytes,), torch.uint8)
        if host is None and self._pending:
            self.drain(wait=True)
            host = self.pool.acquire((nbytes,), torch.uint8)
        return host

    def release(self, span: HostSpan) -> None:
        """Give ``span``'s host bytes back once its last copy is done; idempotent."""
        with self._lock:
            if span.released:
                return
            span.released = True
            self._pending.append((span.host, span.last_copy))
        self.drain()

    # -- copies ---------------------------------------------------------------

    def offload(self, src: torch.Tensor) -> Optional[HostSpan]:
        """Copy flat uint8 ``src`` into the pool on ``d2h``; None when the pool has no room."""
        host = self._acquire(src.numel())
        if host is None:
            return None
        d2h, _ = self._side_streams(src.device)
        d2h.wait_stream(current_stream(src.device))
        with use_stream(d2h), torch.no_grad():
            copy(host, src, non_blocking=True)
        event = d2h.record_event()
        record_stream(src, d2h)
        return HostSpan(host, src.device, event)

    def reload(self, span: HostSpan) -> tuple[torch.Tensor, Event]:
        """A new device buffer receiving ``span``'s bytes on ``h2d``, and its ready event."""
        if span.released:
            raise RuntimeError("SCO: boundary reloaded after its host copy was released")
        _, h2d = self._side_streams(span.device)
        with torch.no_grad():
            buffer = torch.empty(span.nbytes, dtype=torch.uint8, device=span.device)
        h2d.wait_stream(current_stream(span.device))
        h2d.wait_event(span.offloaded)
        with use_stream(h2d), torch.no_grad():
            copy(buffer, span.host, non_blocking=True)
        event = h2d.record_event()
        record_stream(buffer, h2d)
        with self._lock:
            span.last_copy = event
        return buffer, event

    def synchronize(self) -> None:
        """Wait for every side-stream copy and return all pending host bytes."""
        for d2h, h2d in list(self._streams.values()):
            d2h.synchronize()
            h2d.synchronize()
        self.drain(wait=True)
