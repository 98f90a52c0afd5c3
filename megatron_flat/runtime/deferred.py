"""Deferred exchanges: the delayed-copies model extended to collectives in flight.

On a GPU an asynchronous collective or point-to-point exchange (NCCL) runs on its own
stream: until its work is waited, what it receives is undefined, and what it sends may still
be read, so writing a send buffer early changes what arrives. On CPU gloo's threads usually
finish first, so a read or a write before the wait passes by luck.

In delayed-copies mode (:func:`megatron_flat.runtime.streams.delayed_copies`, CPU, tests
only) an exchange posted in flight is deferred (:func:`defer`): its receive buffers read as
poison at once, and the exchange itself runs, synchronously, when its work is first waited,
reading its send buffers then. So code that reads a receive buffer before the wait computes
with NaN, code that writes a send buffer before the wait sends the new bytes, and code that
never waits never exchanges — deterministically, where a GPU would fail sometimes. Every rank
waits in one program order (as every rank posts in one order), so the exchanges still match.

What it cannot show: anything about the streams the exchange runs on (on CPU there are none;
the ring's side-stream waits and ``record_stream`` calls are GPU-only mutants).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from megatron_flat.runtime import streams

__all__ = ["Deferred", "defer", "deferred_count"]

_COUNT = [0]


class Deferred:
    """The work of an exchange posted in delayed-copies mode: ``wait()`` runs it (once)."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run: Optional[Callable[[], None]] = run

    def wait(self) -> bool:
        run, self._run = self._run, None
        if run is not None:
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


def defer(run: Callable[[], None], received: Iterable[torch.Tensor] = ()) -> Optional[Deferred]:
    """In delayed-copies mode: poison ``received`` and return the :class:`Deferred` that runs
    ``run`` when waited. Otherwise None (the caller posts the exchange as usual)."""
    if not streams.delaying():
        return None
    for tensor in received:
        if tensor.device.type != "cpu":
            return None  # a real device has its own timing
    for tensor in received:
        streams.poison(tensor)
    _COUNT[0] += 1
    return Deferred(run)


def deferred_count() -> int:
    """Exchanges deferred since the process started (a test can show they really were)."""
    return _COUNT[0]
