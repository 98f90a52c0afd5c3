"""The expert-parallel group's collectives, as PipelinedLLEP uses them.

:func:`all_to_all` runs ``all_to_all_single`` of several tensors (or one packed buffer) with
the same split sizes, synchronously or in flight (:class:`Pending`); :func:`columns` reads a
packed buffer back; :func:`group_geometry` is (size, rank) of a group, or (1, 0) without
``torch.distributed``; :func:`drain` yields and frees a list's items in order. Pure data
movement: nothing here computes or changes a value.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flat.runtime.deferred import defer

__all__ = ["Pending", "all_to_all", "columns", "drain", "group_geometry"]


def group_geometry(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class Pending:
    """Outputs of all-to-alls in flight; ``wait()`` returns them once complete.

    Holds the inputs until then (an asynchronous collective reads them on its own stream).
    ``unpack`` turns the received buffers into the caller's tensors (see ``all_to_all``)."""

    def __init__(self, outputs: list[torch.Tensor], works: list[Any],
                 inputs: Optional[list[torch.Tensor]] = None,
                 unpack: Optional[Callable[[list[torch.Tensor]], list[torch.Tensor]]] = None):
        self.outputs, self.works, self.inputs, self.unpack = outputs, works, inputs, unpack

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            if work is not None:
                work.wait()
        outputs, self.outputs, self.works, self.inputs = self.outputs, [], [], None
        return self.unpack(outputs) if self.unpack is not None else outputs


def all_to_all(tensors: Sequence[torch.Tensor], out_splits: list[int], in_splits: list[int],
               group: Optional[dist.ProcessGroup], ep_size: int, async_op: bool = False,
               widths: Optional[list[int]] = None) -> Pending:
    """``all_to_all_single`` of each tensor along dim 0 with the same split sizes.

    With ``widths`` the single tensor is a packed ``[rows, Σ widths]`` buffer (the engine's
    ``Step.pack``) and ``wait()`` returns its column views (width 0: a 1-D column).
    """
    if ep_size == 1:
        return Pending(list(tensors), [])
    outputs, works, inputs = [], [], []
    for t in tensors:
        t = t.contiguous()
        out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
        # Delayed-copies mode (tests): an all-to-all in flight runs at its wait.
        later = defer(partial(_all_to_all_now, out, t, out_splits, in_splits, group),
                      [out]) if async_op else None
        works.append(later or dist.all_to_all_single(out, t, out_splits, in_splits,
                                                     group=group, async_op=async_op))
        outputs.append(out)
        inputs.append(t)
    unpack = None if widths is None else (lambda outs: columns(outs[0], widths))
    return Pending(outputs, works, inputs if async_op else None, unpack)


def _all_to_all_now(out, t, out_splits, in_splits, group) -> None:
    """The all-to-all of a deferred :class:`Pending` (posted in flight, waited at once)."""
    dist.all_to_all_single(out, t, out_splits, in_splits, group=group, async_op=True).wait()


def columns(buf: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """Column views of a packed buffer (width 0: one column, as a 1-D view)."""
    parts, col = [], 0
    for w in widths:
        parts.append(buf[:, col] if w == 0 else buf[:, col:col + w])
        col += max(w, 1)
    return parts


def drain(items: list) -> Iterator:
    """Yield and drop the items of a list, first to last (each freed once consumed)."""
    items.reverse()
    while items:
        yield items.pop()
