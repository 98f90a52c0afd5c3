"""The staging pipeline: upload → update → write-back over ``num_slots`` device buffers.

Contract
    Each slot is one fp32 device tensor of shape ``(3, slot_numel)`` viewed as
    ``master``, ``exp_avg`` and ``exp_avg_sq``: fp32 gradients already on the device are
    read where they are. A slot gets a ``grad`` buffer too only once gradients that cannot
    be (another dtype or device) must be staged (:meth:`StagingPipeline.stage_grads`). The
    slots are all the device memory the pipeline owns: ``num_slots x slot_numel x 12``
    bytes (16 with staged gradients). Item ``g`` runs in slot ``g % num_slots``.

CUDA
    Three streams: uploads on ``upload``, updates on ``compute``, write-backs on
    ``writeback``. Per slot, three events order the stages:

    * ``upload(g)`` waits ``free[s]``: the write-back of item ``g - num_slots`` (the
      slot's previous tenant) has finished reading the slot — a slot is never refilled
      while it is being drained;
    * ``update(g)`` waits ``uploaded[s]``; ``writeback(g)`` waits ``updated[s]``.

    So the upload of item g+1 can start once the write-back of item g+1-num_slots has
    finished: with two slots it runs beside the update and write-back of item g (host
    to device and device to host use separate copy engines); three slots also let it
    overlap the end of the write-back of g-1; with one slot the stages serialise.

    All three streams first wait for the caller's current stream (the gradients were
    produced there), the current stream waits for the write-back stream at the end, and
    :meth:`run` returns only when the write-backs have completed, so the host may read
    the host-side state as soon as it returns. With pinned host memory the bucket loop
    never blocks the host, so it queues work ahead of the device.

CPU
    Every stream is the inline one: items run upload, update, write-back in order.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch

from megatron_flat.runtime import Event, Stream, current_stream, use_stream
from megatron_flat.optim.buckets import GRAD_STAGING_BYTES_PER_ELEMENT, STAGING_BYTES_PER_ELEMENT

__all__ = ["Slot", "StagingPipeline"]

T = TypeVar("T")


class Slot:
    """One staging buffer and the events that guard it."""

    FIELDS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, index: int, numel: int, device: torch.device) -> None:
        self.index = index
        self.buffer = torch.empty((len(self.FIELDS), numel), dtype=torch.float32, device=device)
        self.master, self.exp_avg, self.exp_avg_sq = self.buffer.unbind(0)
        self.grad: Optional[torch.Tensor] = None  # staged gradients (stage_grads)
        self.free = Event(device)
        self.uploaded = Event(device)
        self.updated = Event(device)


class StagingPipeline:
    """``num_slots`` staging slots of ``slot_numel`` elements on ``device``, and the streams."""

    def __init__(self, device: torch.device, num_slots: int, slot_numel: int) -> None:
        self.device = torch.device(device)
        self.slots = [Slot(i, slot_numel, self.device) for i in range(num_slots)]
        self.slot_numel = slot_numel
        self.upload = Stream(self.device)
        self.compute = Stream(self.device)
        self.writeback = Stream(self.device)

    @property
    def staged_grads(self) -> bool:
        return self.slots[0].grad is not None if self.slots else False

    def stage_grads(self) -> None:
        """Give every slot an fp32 ``grad`` buffer (once; call between runs)."""
        for slot in self.slots:
            if slot.grad is None:
                slot.grad = torch.empty(self.slot_numel, dtype=torch.float32, device=self.device)

    @property
    def nbytes(self) -> int:
        """Device bytes of all slots: ``num_slots x slot_numel x 12`` (16 with staged
        gradients)."""
        per = STAGING_BYTES_PER_ELEMENT + (GRAD_STAGING_BYTES_PER_ELEMENT
                                           if self.staged_grads else 0)
        return len(self.slots) * self.slot_numel * per

    def run(
        self,
        items: Sequence[T],
        upload: Callable[[T, Slot], None],
        update: Callable[[T, Slot], None],
        writeback: Callable[[T, Slot], None],
    ) -> None:
        """Stream ``items`` through the slots; returns when every write-back is done."""
        if not items:
            return
        caller = current_stream(self.device)
        for stream in (self.upload, self.compute, self.writeback):
            stream.wait_stream(caller)
        for g, item in enumerate(items):
            slot = self.slots[g % len(self.slots)]
            with use_stream(self.upload):
                self.upload.wait_event(slot.free)
                upload(item, slot)
                slot.uploaded.record(self.upload)
            with use_stream(self.compute):
                self.compute.wait_event(slot.uploaded)
                update(item, slot)
                slot.updated.record(self.compute)
            with use_stream(self.writeback):
                self.writeback.wait_event(slot.updated)
                writeback(item, slot)
                slot.free.record(self.writeback)
        caller.wait_stream(self.writeback)
        self.writeback.synchronize()

    def synchronize(self) -> None:
        """Block until all queued pipeline work has finished (no-op on CPU)."""
        for stream in (self.upload, self.compute, self.writeback):
            stream.synchronize()
