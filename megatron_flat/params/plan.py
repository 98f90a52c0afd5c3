"""Where each MoE layer's model state sits, and what moving it costs: pure planning.

One layer's routed-expert weights are packed, in the order given, into one flat byte range
(each tensor aligned), and so are their fp32 gradients (Megatron's ``main_grad`` dtype,
whatever the weights' dtype). The host tier holds every layer's two ranges; the device holds
``weight_slots`` weight ranges and ``grad_slots`` gradient ranges of the largest layer, so
the device's expert model state is bounded by two layers' worth, whatever the depth.

Bytes over PCIe per microbatch (an upper bound: a slot that still holds the layer it is asked
for is not copied again, as at the forward/backward turnaround):

* forward: every layer's weights up once;
* recompute + backward: every layer's weights up once (one fetch serves both);
* gradients: every layer's fp32 gradient down once; from the second microbatch on, up once
  too, so the device adds into the running sum in the stock order (bitwise equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

__all__ = ["LayerLayout", "ParamOffloadPlan", "TensorPlace", "layer_layout"]

ALIGNMENT = 512  # bytes: every tensor of a layer starts on this boundary (host and device)


def _align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorPlace:
    """One tensor inside a layer's flat byte range."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the range's start
    nbytes: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``flat`` (uint8, the layer's range or a slot)."""
        return flat[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class LayerLayout:
    """One layer's weights and their gradients, packed (see the module docstring)."""

    weights: Tuple[TensorPlace, ...]
    grads: Tuple[TensorPlace, ...]

    @property
    def weight_bytes(self) -> int:
        return _align(self.weights[-1].offset + self.weights[-1].nbytes) if self.weights else 0

    @property
    def grad_bytes(self) -> int:
        return _align(self.grads[-1].offset + self.grads[-1].nbytes) if self.grads else 0

    @property
    def numel(self) -> int:
        return sum(_numel(p.shape) for p in self.weights)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _pack(specs: Sequence[Tuple[Tuple[int, ...], torch.dtype]]) -> Tuple[TensorPlace, ...]:
    places, offset = [], 0
    for shape, dtype in specs:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        places.append(TensorPlace(tuple(int(d) for d in shape), dtype, offset, nbytes))
        offset = _align(offset + nbytes)
    return tuple(places)


def layer_layout(specs: Sequence[Tuple[Sequence[int], torch.dtype]],
                 grad_dtype: torch.dtype = torch.float32) -> LayerLayout:
    """The layout of one layer whose weights have these ``(shape, dtype)``."""
    specs = [(tuple(shape), dtype) for shape, dtype in specs]
    if not specs:
        raise ValueError("param offload: a layer needs at least one weight")
    for shape, dtype in specs:
        if not dtype.is_floating_point:
            raise ValueError(f"param offload: weights must be floating point, got {dtype}")
    return LayerLayout(_pack(specs), _pack([(shape, grad_dtype) for shape, _ in specs]))


@dataclass(frozen=True)
class ParamOffloadPlan:
    """Every layer's layout and the slots: sizes for the host tier's node check, the memory
    meter's expectation and the planner's PCIe time."""

    layers: Tuple[LayerLayout, ...]
    weight_slots: int = 2
    grad_slots: int = 2

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("param offload: no layers to offload")
        for name in ("weight_slots", "grad_slots"):
            if int(getattr(self, name)) < 2:
                raise ValueError(f"param offload: {name} must be at least 2 (one slot in use, "
                                 f"the next layer's in flight), got {getattr(self, name)}")

    @property
    def host_bytes(self) -> int:
        """Host-tier bytes: every layer's weights and fp32 gradients."""
        return sum(layer.weight_bytes + layer.grad_bytes for layer in self.layers)

    @property
    def slot_weight_bytes(self) -> int:
        return max(layer.weight_bytes for layer in self.layers)

    @property
    def slot_grad_bytes(self) -> int:
        return max(layer.grad_bytes for layer in self.layers)

    @property
    def device_bytes(self) -> int:
        """Device bytes of the slots: the offloaded layers' whole model state on the device."""
        return (self.weight_slots * self.slot_weight_bytes
                + self.grad_slots * self.slot_grad_bytes)

    @property
    def resident_bytes(self) -> int:
        """What the same layers would hold on the device without the offload."""
        return self.host_bytes

    def slot_of(self, layer: int) -> Tuple[int, int]:
        """(weight slot, gradient slot) of ``layer``: fixed, so a layer's device tensors are
        the same objects every time (``main_grad`` stays attached)."""
        return layer % self.weight_slots, layer % self.grad_slots

    def microbatch_bytes(self, first: bool = True) -> Tuple[int, int]:
        """Upper bound of (host→device, device→host) bytes of one microbatch (module doc)."""
        weights = sum(layer.weight_bytes for layer in self.layers)
        grads = sum(layer.grad_bytes for layer in self.layers)
        return 2 * weights + (0 if first else grads), grads
