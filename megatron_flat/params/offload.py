"""Param offload's execution: the layers' model state in the host tier, two device slots.

:class:`ParamOffload` takes every offloaded layer's weights (device tensors, in forward
order), copies them into one host-tier buffer (with their fp32 gradients beside them) and
from then on the host copy is the truth. The device keeps ``weight_slots`` weight ranges and
``grad_slots`` gradient ranges (plan.py); layer ℓ always uses weight slot ``ℓ % weight_slots``
and gradient slot ``ℓ % grad_slots``, so :meth:`weights` returns the same tensor objects for
a layer every time, each with its ``main_grad`` (the gradient slot's view) attached.

The moves, each with the wait that keeps it exact:

* :meth:`prefetch` — layer ℓ's weights up on the ``h2d`` stream, after the compute stream
  is done with the slot's previous layer (its release event);
* :meth:`acquire` — the compute stream waits for that copy (a layer nobody prefetched is
  fetched now, counted as a demand fetch); :meth:`release` records when compute is done;
* :meth:`acquire_grads` — the gradient slot starts as the layer's running sum: zeroed on the
  first microbatch, else its host ``main_grad`` uploaded (after that layer's last drain
  landed), so the device adds each piece in the order and precision it would add into a
  resident ``main_grad``; before either, compute waits for the slot's previous drain;
* :meth:`drain` — the slot down to the host ``main_grad`` on the ``d2h`` stream, after the
  compute stream has written it;
* :meth:`synchronize` — one host sync, after which the host gradients are complete and the
  host weights may be rewritten (:meth:`weights_updated` then makes every slot stale).

A slot still in use by another layer is never overwritten: that order is refused with
:class:`ParamOffloadError` (the schedule is wrong), never served with the wrong weights.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron_flat.params.plan import ParamOffloadPlan, layer_layout
from megatron_flat.runtime import Event, Stream, current_stream, use_stream
from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.runtime import memory
from megatron_flat.runtime.streams import copy, synchronize_on_drop

__all__ = ["ParamOffload", "ParamOffloadError", "ParamOffloadStats"]

TECHNIQUE = "param offload"


class ParamOffloadError(RuntimeError):
    """A layer's model state cannot be served as asked (slot busy, bad layer)."""


@dataclass
class ParamOffloadStats:
    """What moved: copies issued, slot hits and the demand fetches nobody prefetched."""

    acquisitions: int = 0
    fetches: int = 0  # acquisitions - fetches: served by a slot that still held the layer
    demand_fetches: int = 0
    grad_uploads: int = 0
    grad_uploads_ahead: int = 0  # of them, started by prefetch_grads before the backward
    grad_zeroings: int = 0
    drains: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


def _wait_both(h2d: Stream, d2h: Stream) -> None:
    """Every fetch, upload and drain issued so far has landed."""
    h2d.synchronize()
    d2h.synchronize()


class ParamOffload:
    """The model state of ``layers`` (each a sequence of one layer's weights, forward order)
    in the host tier; see the module docstring. ``tier``: the host tier to draw from (default
    the process's); ``device``: where the slots live (default the weights' device)."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], *, device=None,
                 weight_slots: int = 2, grad_slots: int = 2,
                 tier: Optional[host_tiers.HostTier] = None) -> None:
        layers = [list(ws) for ws in layers]
        self.plan = ParamOffloadPlan(
            tuple(layer_layout([(w.shape, w.dtype) for w in ws]) for ws in layers),
            weight_slots, grad_slots)
        self.device = torch.device(device) if device is not None else layers[0][0].device
        tier = tier or host_tiers.tier()
        tier.declare(TECHNIQUE, self.plan.host_bytes)  # the node check, before allocating
        self._host = tier.buffer(TECHNIQUE, self.plan.host_bytes)
        # host memory to the meter (not device bytes) and to the ledger (copies are h2d/d2h)
        memory.register_host_storage(self._host.untyped_storage())
        # all of it in use from now until it is freed: the meter's host figure counts it
        # (as a pool's taken bytes are counted)
        memory.note_host_bytes(self.plan.host_bytes)
        weakref.finalize(self._host.untyped_storage(), memory.note_host_bytes,
                         -self.plan.host_bytes)
        self._host_weights: List[torch.Tensor] = []
        self._host_grads: List[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for ws, layout in zip(layers, self.plan.layers):
                flat_w = self._host[offset:offset + layout.weight_bytes]
                flat_g = self._host[offset + layout.weight_bytes:
                                    offset + layout.weight_bytes + layout.grad_bytes]
                offset += layout.weight_bytes + layout.grad_bytes
                for place, w in zip(layout.weights, ws):
                    place.view(flat_w).copy_(w)  # once, at set-up (a blocking copy on a GPU)
                self._host_weights.append(flat_w)
                self._host_grads.append(flat_g)
            self._slots = [torch.empty(self.plan.slot_weight_bytes, dtype=torch.uint8,
                                       device=self.device) for _ in range(weight_slots)]
            self._grad_slots = [torch.empty(self.plan.slot_grad_bytes, dtype=torch.uint8,
                                            device=self.device) for _ in range(grad_slots)]
        self._weights: List[List[torch.Tensor]] = []
        self._grads: List[List[torch.Tensor]] = []
        for index, layout in enumerate(self.plan.layers):
            ws, gs = self.plan.slot_of(index)
            weights = [p.view(self._slots[ws]) for p in layout.weights]
            grads = [p.view(self._grad_slots[gs]) for p in layout.grads]
            for w, g in zip(weights, grads):
                w.main_grad = g  # where a Megatron-style layer adds its weight gradient
            self._weights.append(weights)
            self._grads.append(grads)
        self._version = 0
        self._tag: List[Optional[tuple]] = [None] * weight_slots  # (layer, version) held
        self._fetched: List[Optional[Event]] = [None] * weight_slots
        self._free: List[Optional[Event]] = [None] * weight_slots
        self._user: List[Optional[int]] = [None] * weight_slots
        self._grad_owner: List[Optional[int]] = [None] * grad_slots
        self._grad_free: List[Optional[Event]] = [None] * grad_slots  # its last drain
        # a running main_grad uploaded ahead into a free gradient slot: (layer, its event)
        self._grad_staged: List[Optional[tuple]] = [None] * grad_slots
        self._accumulated = [False] * len(layers)
        self._unsynced = False  # a drain issued since the last synchronize
        self._h2d = Stream(self.device)
        self._d2h = Stream(self.device)
        # The slots are fresh blocks of the current stream's pool: work queued there before
        # may still use that memory, so the first fetches into them wait for it.
        self._h2d.wait_stream(current_stream(self.device))
        # Dropped without close() (a model freed mid-run): the copies in flight land before
        # the slots and the host buffer they use can go.
        self._on_drop = synchronize_on_drop(self, functools.partial(_wait_both, self._h2d,
                                                                    self._d2h),
                                            (self._slots, self._grad_slots, self._host))
        self.stats = ParamOffloadStats()
        self.prefetch(0)  # the first forward's weights start up at once

    def close(self) -> None:
        """Give back the host tier's buffer and the device slots once the copies in flight
        have ended (``megatron_flat.release``). The offload is unusable afterwards;
        idempotent."""
        if getattr(self, "_closed", False):
            return
        self._h2d.synchronize()
        self._d2h.synchronize()
        self._on_drop.detach()  # waited for above; nothing left for the finalizer
        self._closed = True
        self._weights, self._grads = [], []
        self._slots, self._grad_slots = [], []
        self._host_weights, self._host_grads = [], []
        self._host = None
        self._fetched = [None] * len(self._fetched)
        self._free = [None] * len(self._free)
        self._grad_free = [None] * len(self._grad_free)

    # -- introspection -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.plan.layers)

    def in_use(self, layer: int) -> bool:
        """Whether ``layer`` holds its weight slot (between :meth:`acquire` and
        :meth:`release`)."""
        return self._user[self.plan.slot_of(self._check(layer))[0]] == layer

    def weights(self, layer: int) -> List[torch.Tensor]:
        """Layer ``layer``'s device weights (views of its slot; valid between :meth:`acquire`
        and :meth:`release`), each with ``main_grad`` attached."""
        return self._weights[self._check(layer)]

    def host_weights(self, layer: int) -> List[torch.Tensor]:
        """Layer ``layer``'s weights in the host tier (the truth; an optimizer updates these,
        then calls :meth:`weights_updated`)."""
        layout = self.plan.layers[self._check(layer)]
        return [p.view(self._host_weights[layer]) for p in layout.weights]

    def host_grads(self, layer: int) -> List[torch.Tensor]:
        """Layer ``layer``'s fp32 ``main_grad`` in the host tier, complete: waits for the
        drains first (one host sync) and reads zeros for a layer with no backward since
        :meth:`zero_grad`."""
        layout = self.plan.layers[self._check(layer)]
        self.synchronize()
        if not self._accumulated[layer]:
            self._host_grads[layer].zero_()
        return [p.view(self._host_grads[layer]) for p in layout.grads]

    def host_grad_range(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s whole host gradient range as one fp32 tensor (its gradients and
        the zero padding between them), complete as :meth:`host_grads`'s: for scaling and
        reducing the layer in one call."""
        self.host_grads(layer)
        return self._host_grads[layer].view(torch.float32)

    def _check(self, layer: int) -> int:
        if getattr(self, "_closed", False):
            raise ParamOffloadError("param offload: this offload was closed (its model was "
                                    "released)")
        if not 0 <= layer < self.num_layers:
            raise ParamOffloadError(f"param offload: no layer {layer} (it holds "
                                    f"{self.num_layers})")
        return layer

    # -- weights -------------------------------------------------------------------------
    def prefetch(self, layer: int) -> None:
        """Start copying ``layer``'s weights into its slot (no-op out of range, when the slot
        already holds them, or when the slot is still in use: then :meth:`acquire` fetches)."""
        if not 0 <= layer < self.num_layers:
            return
        slot, _ = self.plan.slot_of(layer)
        if self._tag[slot] == (layer, self._version) or self._user[slot] is not None:
            return
        if self._free[slot] is not None:
            self._h2d.wait_event(self._free[slot])  # compute is done with the old layer
        nbytes = self.plan.layers[layer].weight_bytes
        with use_stream(self._h2d), torch.no_grad():
            # Through .data: the slot's views keep their version, so a forward graph that
            # saved them (no recompute) unpacks in its backward, after acquire refilled them.
            copy(self._slots[slot].data[:nbytes], self._host_weights[layer], non_blocking=True)
        self._fetched[slot] = self._h2d.record_event()
        self._tag[slot] = (layer, self._version)
        self.stats.fetches += 1
        self.stats.h2d_bytes += nbytes

    def acquire(self, layer: int) -> List[torch.Tensor]:
        """``layer``'s weights on the device for the current stream's next work."""
        slot, _ = self.plan.slot_of(self._check(layer))
        user = self._user[slot]
        if user is not None and user != layer:
            raise ParamOffloadError(
                f"param offload: layer {layer} needs weight slot {slot}, still in use by layer "
                f"{user}; layers sharing a slot must not run at once (run each layer's "
                "forward, and its recompute and backward, one layer at a time)")
        if self._tag[slot] != (layer, self._version):
            self.stats.demand_fetches += 1
            self.prefetch(layer)
        self.stats.acquisitions += user is None
        current_stream(self.device).wait_event(self._fetched[slot])
        self._user[slot] = layer
        return self._weights[layer]

    def release(self, layer: int) -> None:
        """The current stream's work on ``layer``'s weights is queued; the slot may be
        refilled after it (the weights stay there for a later hit until then)."""
        slot, _ = self.plan.slot_of(self._check(layer))
        if self._user[slot] == layer:
            self._user[slot] = None
            self._free[slot] = current_stream(self.device).record_event()

    # -- gradients -----------------------------------------------------------------------
    def acquire_grads(self, layer: int) -> List[torch.Tensor]:
        """``layer``'s gradient slot, holding its running ``main_grad`` (module doc): the host
        sum uploaded ahead by :meth:`prefetch_grads` (waited for here) or now."""
        _, gslot = self.plan.slot_of(self._check(layer))
        owner = self._grad_owner[gslot]
        if owner == layer:
            return self._grads[layer]
        if owner is not None:
            raise ParamOffloadError(
                f"param offload: layer {layer} needs gradient slot {gslot}, still holding "
                f"layer {owner}'s undrained gradient (its backward has not ended)")
        compute = current_stream(self.device)
        if self._grad_free[gslot] is not None:
            compute.wait_event(self._grad_free[gslot])  # its last drain has read it
        if self._accumulated[layer]:
            staged = self._grad_staged[gslot]
            if staged is None or staged[0] != layer:
                # Not uploaded ahead: now, after the slot's last drain (compute waited for it
                # above; a layer always uses the same slot and d2h runs in order, so that
                # drain is this layer's own last one or later: the host sum is complete).
                self._h2d.wait_stream(compute)
                staged = self._upload_grads(layer, gslot)
            compute.wait_event(staged[1])
        else:
            with torch.no_grad():
                self._grad_slots[gslot][:self.plan.layers[layer].grad_bytes].zero_()
            self.stats.grad_zeroings += 1
        self._grad_staged[gslot] = None
        self._grad_owner[gslot] = layer
        return self._grads[layer]

    def prefetch_grads(self, layer: int) -> None:
        """Start uploading ``layer``'s running ``main_grad`` into its gradient slot ahead of
        its backward (no-op out of range, before its first drain since :meth:`zero_grad`,
        or while the slot holds an undrained gradient): the upload then runs beside the
        backward before it instead of stalling the layer's own."""
        if not 0 <= layer < self.num_layers or not self._accumulated[layer]:
            return
        _, gslot = self.plan.slot_of(layer)
        staged = self._grad_staged[gslot]
        if self._grad_owner[gslot] is not None or (staged is not None and staged[0] == layer):
            return
        if self._grad_free[gslot] is not None:
            # The slot's last drain has read it, and (d2h runs in order) this layer's own
            # last drain, which the host sum needs, has landed.
            self._h2d.wait_event(self._grad_free[gslot])
        self._upload_grads(layer, gslot)
        self.stats.grad_uploads_ahead += 1

    def _upload_grads(self, layer: int, gslot: int) -> tuple:
        nbytes = self.plan.layers[layer].grad_bytes
        with use_stream(self._h2d), torch.no_grad():
            copy(self._grad_slots[gslot][:nbytes], self._host_grads[layer], non_blocking=True)
        staged = self._grad_staged[gslot] = (layer, self._h2d.record_event())
        self.stats.grad_uploads += 1
        self.stats.h2d_bytes += nbytes
        return staged

    def drain(self, layer: int) -> None:
        """Copy ``layer``'s gradient slot down to its host ``main_grad`` (no-op when it holds
        none): the layer's backward has ended on the current stream."""
        _, gslot = self.plan.slot_of(self._check(layer))
        if self._grad_owner[gslot] != layer:
            return
        nbytes = self.plan.layers[layer].grad_bytes
        self._d2h.wait_stream(current_stream(self.device))  # the gradient is written
        with use_stream(self._d2h), torch.no_grad():
            copy(self._host_grads[layer], self._grad_slots[gslot][:nbytes], non_blocking=True)
        event = self._d2h.record_event()
        self._grad_free[gslot] = event
        self._accumulated[layer] = True
        self._grad_owner[gslot] = None
        self._unsynced = True
        self.stats.drains += 1
        self.stats.d2h_bytes += nbytes

    # -- the step ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Drain what is left, then one host sync on the drains: the host gradients are
        complete. (Uploads need none: every fetch a layer uses is waited for by compute, and
        one still in flight when the host weights change fills a slot that
        :meth:`weights_updated` has already made stale, to be fetched again behind it.)"""
        for owner in [o for o in self._grad_owner if o is not None]:
            self.drain(owner)
        if not self._unsynced:
            return
        self._d2h.synchronize()
        self._unsynced = False

    def zero_grad(self) -> None:
        """Start a new accumulation: every layer's ``main_grad`` reads zero again."""
        self.synchronize()
        self._accumulated = [False] * self.num_layers
        self._grad_staged = [None] * len(self._grad_staged)  # sums of the last accumulation

    def weights_updated(self) -> None:
        """The host weights were rewritten (an optimizer step, a checkpoint load): every slot
        is stale. Call after :meth:`synchronize`, with no layer in use, once the writes are
        done on the host or queued before the current stream's next work (a stream writer
        makes the current stream wait for it). The first layer's new weights start up at
        once, for the next forward."""
        if any(user is not None for user in self._user):
            raise ParamOffloadError("param offload: weights updated while a layer is in use")
        self.synchronize()
        self._version += 1
        # A writer on a stream (OffloadStreamAdamW's write-back) has made the current stream
        # wait for it; the next fetches wait for the current stream, so they read the new
        # weights whether or not the writer also blocked the host.
        self._h2d.wait_stream(current_stream(self.device))
        self.prefetch(0)
