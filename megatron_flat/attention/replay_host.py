"""The host tier of attention replay: kept outputs wait in a host pool, not on the device.

A first pass's (O, LSE) is copied to the host pool on the device-to-host side stream as
soon as the kernel has produced it (the copy overlaps the rest of the layer's forward) and
its device bytes are freed with the first pass's other activations. In the backward each
re-run takes its pair back from the pool; taking it starts the reload of the pair kept
just before it (the previous layer's, whose re-run comes next in a backward that walks the
layers in reverse), so that reload runs on the host-to-device side stream under this
layer's backward: one layer ahead, SCO's ``prefetch`` rule. A re-run whose pair was not
prefetched (the first of a backward, or a microbatch boundary) reloads it then.

Host bytes: the pairs of every first pass whose re-run has not come yet (L·(O + LSE) per
microbatch in flight). Device bytes on top of stock: one reloaded pair ahead. When the pool
has no room for a pair, that pair is not kept (one warning): its re-run runs the kernel,
as stock does. Nothing is ever kept on the device for lack of room.

The copies and their ordering are :class:`~megatron_flat.checkpoint.transfer.SpanMover`'s
(the one SCO's boundaries use, so both share one pool, one budget and one pair of side
streams).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_flat.checkpoint.spans import plan_spans, rebuild, span_bytes
from megatron_flat.checkpoint.transfer import HostSpan, SpanMover

__all__ = ["HostKept", "ReplayHost", "ReplayHostStats"]


@dataclass(frozen=True)
class ReplayHostStats:
    """Counters since creation."""

    kept: int = 0  # pairs copied to the host pool
    not_kept: int = 0  # pairs the pool had no room for (their re-run runs the kernel)
    bytes_offloaded: int = 0  # d2h bytes
    bytes_reloaded: int = 0  # h2d bytes
    prefetched: int = 0  # reloads started one layer ahead
    prefetch_hits: int = 0  # takes that found their pair already reloading
    reloads_on_demand: int = 0  # takes that had to start the reload themselves


class HostKept:
    """One kept call's tensors ((O, LSE), or one pair per context-parallel slot): their spans
    in the pool, how to rebuild them, the call kept before it."""

    __slots__ = ("spans", "metas", "pred", "restored", "taken", "__weakref__")

    def __init__(self, spans: List[HostSpan], metas, pred: Optional["HostKept"]) -> None:
        self.spans = spans
        self.metas = metas  # per tensor: (span index, ViewMeta)
        self.pred = weakref.ref(pred) if pred is not None else None
        self.restored: Optional[list] = None  # per span: (device buffer, ready event)
        self.taken = False

    @property
    def nbytes(self) -> int:
        return sum(span.nbytes for span in self.spans)

    def predecessor(self) -> Optional["HostKept"]:
        return self.pred() if self.pred is not None else None


class ReplayHost:
    """Offload kept pairs into ``mover``'s pool and bring them back one layer ahead."""

    def __init__(self, mover: SpanMover) -> None:
        self.mover = mover
        self._last: Optional[weakref.ref] = None
        self._lock = threading.RLock()
        self._counts = {f.name: 0 for f in fields(ReplayHostStats)}
        self._warned = False

    @property
    def stats(self) -> ReplayHostStats:
        with self._lock:
            return ReplayHostStats(**self._counts)

    def _add(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self._counts[name] += delta

    def offload(self, tensors: Sequence[torch.Tensor]) -> Optional[HostKept]:
        """Copy ``tensors`` (one call's (O, LSE) pairs) to the pool; None when it has no room
        (nothing is then held)."""
        spans, metas = plan_spans(list(tensors))
        host: List[HostSpan] = []
        with torch.no_grad():
            for span in spans:
                copied = self.mover.offload(span_bytes(span))
                if copied is None:
                    for done in host:
                        self.mover.release(done)
                    return self._not_kept(sum(s.nbytes for s in spans))
                host.append(copied)
        with self._lock:
            last = self._last() if self._last is not None else None
            kept = HostKept(host, metas, last if last is not None and not last.taken else None)
            self._last = weakref.ref(kept)
            self._add(kept=1, bytes_offloaded=kept.nbytes)
        # A pair dropped unused (a backward that never came) gives its bytes back.
        weakref.finalize(kept, _release, self.mover, host).atexit = False
        return kept

    def _not_kept(self, nbytes: int) -> None:
        with self._lock:
            self._add(not_kept=1)
            warn = not self._warned
            self._warned = True
        if warn:
            warnings.warn(
                f"attention replay: the host pool has no room for a kept output ({nbytes} "
                f"bytes; {self.mover.pool.capacity_bytes} in the pool); layers that do not fit "
                "recompute their attention as stock does (raise --flat-sco-host-budget-gib)",
                stacklevel=4)
        return None

    def _reload(self, kept: HostKept) -> None:
        kept.restored = [self.mover.reload(span) for span in kept.spans]
        self._add(bytes_reloaded=kept.nbytes)

    def take(self, kept: HostKept) -> Tuple[torch.Tensor, ...]:
        """``kept``'s tensors on the device, ready to use; starts the previous call's reload
        and gives ``kept``'s host bytes back once its reload has read them."""
        with self._lock:
            if kept.taken:
                raise RuntimeError("attention replay: a kept output taken twice")
            kept.taken = True
            if kept.restored is None:
                self._reload(kept)
                self._add(reloads_on_demand=1)
            else:
                self._add(prefetch_hits=1)
            pred = kept.predecessor()
            if pred is not None and not pred.taken and pred.restored is None:
                self._reload(pred)
                self._add(prefetched=1)
            restored, kept.restored = kept.restored, None
        _release(self.mover, kept.spans)
        tensors = []
        for index, meta in kept.metas:
            buffer, event = restored[index]
            event.wait()
            with torch.no_grad():
                tensors.append(rebuild(buffer, meta))
        return tuple(tensors)


def _release(mover: SpanMover, spans: List[HostSpan]) -> None:
    for span in spans:
        mover.release(span)  # idempotent; waits (pending) for the span's last copy
