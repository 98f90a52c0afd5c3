"""Neighbour exchange on a ring of P ranks: send to rank + 1, receive from rank - 1.

A :class:`Ring` posts one hop (several tensors) with ``torch.distributed.batch_isend_irecv``
(works on gloo and NCCL) and returns a :class:`Hop` to wait on later, so the caller can
compute on what it already holds while the hop is in flight. Hops on different
``channel`` s use different tags, so two hops may be in flight at once (e.g. the next
weight shard and the previous partial state); every rank must post hops in the same order.

On CUDA the hop is issued from a side stream (:class:`megatron_flat.runtime.Stream`) that
first waits for the compute stream, so the buffers being sent are complete; the buffers
are recorded on that stream so the caching allocator does not hand them out again before
the transfer ends, and :meth:`Hop.wait` makes the compute stream (not the host) wait for
the transfer. The next strip's matmul, queued on the compute stream meanwhile, overlaps it.
On CPU the streams are inline and only gloo's own threads overlap. With delayed copies
(tests) a hop or relay runs at its wait (:mod:`megatron_flat.runtime.deferred`).

:meth:`Ring.relay` passes an accumulator on in place: the rank sends its buffer's rows to
the next rank and receives the previous rank's into the same buffer, a piece at a time
through one piece-sized slot, so a travelling sum costs one buffer plus one piece, not the
three (filling, arriving, leaving) of an overlapped :meth:`Ring.shift`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flat.runtime import Stream, current_stream, record_stream, use_stream
from megatron_flat.runtime.deferred import defer

__all__ = ["Ring", "Hop"]


def _exchange(ops: list) -> None:
    """Post ``ops`` and wait for them (a deferred hop, run at its wait)."""
    for work in dist.batch_isend_irecv(ops):
        work.wait()

_TAGS_PER_CHANNEL = 16
# torch >= 2.12 names it all_gather_single (all_gather_into_tensor warns as deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Hop:
    """A posted exchange; :meth:`wait` returns the received tensors."""

    def __init__(self, works: list, received: list[torch.Tensor], sent: list[torch.Tensor],
                 stream: Optional[Stream], device: torch.device) -> None:
        self._works = works
        self._received = received
        self._sent = sent  # kept alive until the transfer is over
        self._stream = stream
        self._device = device

    def wait(self) -> list[torch.Tensor]:
        if self._works is None:
            raise RuntimeError("Hop.wait() called twice")
        with use_stream(self._stream):
            for work in self._works:
                work.wait()
        if self._stream is not None:
            current_stream(self._device).wait_stream(self._stream)
        received, self._works, self._received, self._sent = self._received, None, [], []
        return received


class Ring:
    """The ring over ``group`` (``P = group size``; this rank's neighbours by group rank)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device(device)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.stream = Stream(self.device) if self.device.type == "cuda" else None

    def _post(self, ops: list, received: Sequence[torch.Tensor]) -> list:
        """``batch_isend_irecv(ops)``; with delayed copies (CPU tests) one deferred work that
        exchanges at its wait, ``received`` poison until then."""
        later = defer(lambda: _exchange(ops), received) if self.stream is None else None
        return [later] if later is not None else dist.batch_isend_irecv(ops)

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """All ranks' ``row`` (int64 ``[F]``) as ``[P, F]`` on CPU: one small all-gather."""
        local = row.to(self.device)
        table = torch.empty(self.world * local.numel(), dtype=local.dtype, device=self.device)
        _all_gather(table, local, group=self.group)
        return table.view(self.world, -1).cpu()

    def shift(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor],
              channel: int = 0) -> Hop:
        """Send ``sends[i]`` to the next rank and receive ``recvs[i]`` from the previous one."""
        if len(sends) != len(recvs) or len(sends) > _TAGS_PER_CHANNEL:
            raise ValueError("shift() takes as many (at most 16) receive buffers as sends")
        sends = [t.contiguous() for t in sends]
        if self.stream is not None:
            self.stream.wait_stream(current_stream(self.device))
        ops = []
        for i, (send, recv) in enumerate(zip(sends, recvs)):
            tag = channel * _TAGS_PER_CHANNEL + i
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        with use_stream(self.stream):
            works = self._post(ops, recvs)
        if self.stream is not None:
            for tensor in (*sends, *recvs):
                record_stream(tensor, self.stream)
        return Hop(works, list(recvs), sends, self.stream, self.device)

    def relay(self, buffer: torch.Tensor, send_rows: int, recv_rows: int, piece_rows: int,
              channel: int = 0) -> Hop:
        """Send ``buffer[:send_rows]`` to the next rank; receive the previous rank's
        ``recv_rows`` rows into ``buffer[:recv_rows]`` (in place). Returns a :class:`Hop`
        whose ``wait()`` gives ``[buffer[:recv_rows]]``.

        Rows go in pieces ``[j*piece_rows, (j+1)*piece_rows)``: piece j is sent, the previous
        rank's piece j lands in a slot, and once both are done the slot is copied over the
        rows just sent. ``piece_rows`` must be the same on every rank of the ring (derive it
        from sizes every rank knows) and ``recv_rows`` equal the previous rank's
        ``send_rows``. Extra memory: one slot of ``piece_rows`` rows. On CUDA the pieces and
        their copies run in order on the ring's side stream, which waits for the compute
        stream once, at the start; the host never waits. Data movement only: exact.
        """
        if piece_rows < 1 or max(send_rows, recv_rows) > buffer.shape[0]:
            raise ValueError(f"relay: {send_rows}/{recv_rows} rows in pieces of {piece_rows} "
                             f"do not fit a buffer of {buffer.shape[0]} rows")
        total = max(send_rows, recv_rows)
        slot = buffer.new_empty((min(piece_rows, recv_rows),) + tuple(buffer.shape[1:]))

        def pieces() -> None:
            for j, start in enumerate(range(0, total, piece_rows)):
                tag = channel * _TAGS_PER_CHANNEL + j % _TAGS_PER_CHANNEL
                sent, got = min(start + piece_rows, send_rows), min(start + piece_rows, recv_rows)
                ops = []
                if sent > start:
                    ops.append(dist.P2POp(dist.isend, buffer[start:sent], self.next,
                                          self.group, tag))
                if got > start:
                    ops.append(dist.P2POp(dist.irecv, slot[: got - start], self.prev,
                                          self.group, tag))
                for work in self._post(ops, [slot[: got - start]] if got > start else []):
                    work.wait()  # on the side stream (CUDA); the rows sent are free now
                if got > start:
                    buffer[start:got].copy_(slot[: got - start])

        # Delayed-copies mode: the whole relay runs at the wait, reading the rows it sends
        # then (a write into the buffer before the wait is sent, as on a GPU it may be).
        later = defer(pieces) if self.stream is None else None
        if later is not None:
            return Hop([later], [buffer[:recv_rows]], [slot], None, self.device)
        if self.stream is not None:
            self.stream.wait_stream(current_stream(self.device))
        with use_stream(self.stream):
            pieces()
        if self.stream is not None:
            record_stream(buffer, self.stream)
            record_stream(slot, self.stream)
        return Hop([], [buffer[:recv_rows]], [slot], self.stream, self.device)
