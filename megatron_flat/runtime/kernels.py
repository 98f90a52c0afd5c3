"""What kind of kernel each counted op launches: the ledger's kernel profile.

A unit's time on a GPU is not its total FLOPs over peak plus its total bytes over HBM
bandwidth: a GEMM too small to fill the SMs runs at a fraction of peak, a tiny kernel costs
its fixed minimum however few bytes it moves, an accumulate through 16-bit atomics runs far
below HBM bandwidth, and an op on host data launches nothing at all. The ledger therefore
keeps, beside its totals, a profile of the kernels a GPU would launch, keyed by class and
size; :mod:`megatron_flat.plan.time` turns it into seconds with each device's constants.

Profile keys (each value ``[count, work, bytes]``):

``gemm:T``     an op with FLOPs (matmuls, attention) whose output covers ``T`` 128 x 128 tiles
               (batch included); ``work`` is its FLOPs. ``gemm32:T``: the same with an fp32
               (or fp64) result, which CUDA runs without tensor cores (torch does not allow
               TF32 for matmuls by default). The tile count is what decides how
               many SMs one launch fills (wave quantization), so equal-FLOP GEMMs of other
               shapes are kept apart. ``gemm:0``: a kernel of unknown shape (a Triton
               kernel the dispatcher does not see), taken as filling the device.
``atomic16`` / ``atomic32`` / ``atomic64``
               an accumulate by index (``index_add``, ``scatter_add``, ``index_put`` with
               ``accumulate=True``, ``put`` with ``accumulate``): CUDA runs it with one
               atomic add per source element; ``work`` is the elements added, keyed by the
               element width in bits; its bytes are the rows it touches, not the whole
               destination.
``copy``       a host<->device copy (its time is the copy engines', counted in h2d/d2h).
``mem:B``      any other kernel, memory-bound; ``B`` = floor(log2(bytes)): the bytes its
               inputs and outputs hold (an in-place op that returns nothing, a ``_foreach_``
               update, counts what it writes as its output), so a device's minimum kernel
               time can be applied per size class.

Ops on host data only launch no kernel; the ledger counts them as ``host_ops`` (host time).
Pure functions, no ledger state: :func:`profile_key` classifies one op.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ATOMIC_OPS", "TILE", "atomic_elements", "mem_key", "overloads", "profile_key"]

TILE = 128  # the output tile edge the tile count is taken at (Hopper GEMMs: 128 x 128..256)

_aten = torch.ops.aten


def overloads(packet: Any, *names: str) -> frozenset:
    """Every overload of each op ``names`` in ``packet`` (``torch.ops.aten``); names this
    torch lacks are skipped."""
    out = []
    for name in names:
        ops = getattr(packet, name, None)
        if ops is not None:
            out.extend(getattr(ops, o) for o in ops.overloads())
    return frozenset(out)


# Accumulates by index that CUDA implements with an atomic add per source element.
_ADD = overloads(_aten, "index_add", "index_add_", "scatter_add", "scatter_add_")
_PUT = overloads(_aten, "index_put", "index_put_", "_index_put_impl_", "put", "put_")
ATOMIC_OPS = _ADD | _PUT


def atomic_elements(func: Any, args: tuple, kwargs: dict) -> int:
    """Elements an accumulate-by-index op adds atomically (0 when it does not accumulate).

    ``index_add(self, dim, index, source)`` and ``scatter_add(self, dim, index, src)`` always
    accumulate; ``index_put(self, indices, values, accumulate)`` and ``put(self, index,
    source, accumulate)`` only with ``accumulate=True`` (else they are plain writes)."""
    if func in _ADD:
        source = kwargs.get("source", kwargs.get("src", args[3] if len(args) > 3 else None))
    elif func in _PUT:
        if not kwargs.get("accumulate", args[3] if len(args) > 3 else False):
            return 0
        source = kwargs.get("values", kwargs.get("source", args[2] if len(args) > 2 else None))
    else:
        return 0
    return int(source.numel()) if isinstance(source, torch.Tensor) else 0


def _first(out: Any) -> Any:
    """An op's (first) output."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def mem_key(nbytes: int) -> str:
    """The profile key of a memory-bound kernel moving ``nbytes``."""
    return f"mem:{max(0, int(nbytes).bit_length() - 1)}"


def _tiles(out: Any) -> int:
    t = _first(out)
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return 1
    if t.dim() == 1:
        return math.ceil(t.shape[0] / TILE)
    batch = math.prod(t.shape[:-2]) if t.dim() > 2 else 1
    return max(1, batch * math.ceil(t.shape[-2] / TILE) * math.ceil(t.shape[-1] / TILE))


def profile_key(func: Any, args: tuple, kwargs: dict, out: Any, flops: int, nbytes: int,
                copy: bool) -> tuple[str, int, int]:
    """``(key, work, bytes)`` of one op that runs on the device (see the module docstring).

    ``nbytes`` is what the op's inputs and outputs hold; an accumulate by index touches only
    its source's rows of the destination, so its bytes are the source read and the rows
    written (and, out of place, the copy of the destination it starts from)."""
    if copy:
        return "copy", 0, nbytes
    if flops:
        return f"{'gemm32' if _full_precision(out) else 'gemm'}:{_tiles(out)}", int(flops), nbytes
    elements = atomic_elements(func, args, kwargs)
    if elements:
        first = args[0] if args else None
        width = first.element_size() if isinstance(first, torch.Tensor) else 4
        touched = 2 * elements * width
        if not _in_place(func) and isinstance(first, torch.Tensor):
            touched += 2 * first.numel() * width  # the out-of-place form copies self first
        return f"atomic{8 * width}", elements, touched
    return mem_key(nbytes), 0, nbytes


def _full_precision(out: Any) -> bool:
    """A matmul whose result is fp32 or fp64: CUDA runs it without tensor cores unless TF32
    is allowed (torch's default for matmuls is not to)."""
    t = _first(out)
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64)


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "") or str(func)
    return name.split(".")[0].endswith("_") and not name.startswith("_index_put_impl")
