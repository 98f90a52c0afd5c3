"""Byte spans of device storage that cover a checkpoint's boundary tensors (pure).

SCO moves bytes, not tensors: the boundary tensors of one checkpoint call that
share a storage (the same tensor passed twice, views of one another) are covered
by ONE span of that storage, copied once, and rebuilt as views of the one
restored buffer, so aliasing between them survives the round trip and no byte is
stored twice. ``plan_spans`` groups; ``span_bytes`` views a span as flat uint8;
``rebuild`` makes a tensor with the saved metadata on a restored buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Span", "ViewMeta", "plan_spans", "rebuild", "span_bytes", "tensor_extent"]


@dataclass(frozen=True)
class ViewMeta:
    """How to rebuild a tensor on a restored span buffer (offset in elements)."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of ``dtype``, from the span start


@dataclass
class Span:
    """Bytes ``[lo, hi)`` of ``storage``; ``lo`` is aligned to the members' largest item size."""

    storage: torch.UntypedStorage
    device: torch.device
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def tensor_extent(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[start, end)`` of ``t``'s storage that ``t`` can address (non-empty ``t``)."""
    itemsize = t.element_size()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * itemsize, (last + 1) * itemsize


def plan_spans(tensors: Sequence[torch.Tensor]) -> tuple[list[Span], list[tuple[int, ViewMeta]]]:
    """Group non-empty strided tensors by storage into spans.

    Returns the spans and, per input tensor, ``(span index, ViewMeta)``. Each
    span is the smallest byte range covering its members, its start rounded
    down to the largest member item size so that every member's offset is a
    whole number of its elements.
    """
    spans: list[Span] = []
    index: dict[int, int] = {}  # id(storage) -> span index; storages are alive (members hold them)
    extents = []
    for t in tensors:
        storage = t.untyped_storage()
        start, end = tensor_extent(t)
        i = index.get(id(storage))
        if i is None:
            i = index[id(storage)] = len(spans)
            spans.append(Span(storage, t.device, start, end))
        else:
            span = spans[i]
            span.lo, span.hi = min(span.lo, start), max(span.hi, end)
        extents.append((i, t, start))
    align = [1] * len(spans)
    for i, t, _ in extents:
        align[i] = max(align[i], t.element_size())
    for i, span in enumerate(spans):
        span.lo -= span.lo % align[i]
    metas = []
    for i, t, start in extents:
        rel = start - spans[i].lo
        offset = rel // t.element_size()
        metas.append((i, ViewMeta(t.dtype, tuple(t.shape), tuple(t.stride()), offset)))
    return spans, metas


def span_bytes(span: Span) -> torch.Tensor:
    """The span's bytes as a flat uint8 tensor sharing the storage."""
    return torch.empty(0, dtype=torch.uint8, device=span.device).set_(
        span.storage, span.lo, (span.nbytes,), (1,)
    )


def rebuild(buffer: torch.Tensor, meta: ViewMeta) -> torch.Tensor:
    """A tensor with ``meta``'s dtype, size and stride on ``buffer``'s storage."""
    return torch.empty(0, dtype=meta.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), meta.offset, meta.size, meta.stride
    )
