"""Deterministic counts of the costs that decide GPU step time, for a block of code.

Contract: ``with CostLedger() as ledger:`` counts, for the ops run in the block (autograd's
backward included), ``flops``, ``collective_bytes`` / ``collective_calls`` (bytes this rank puts
on its links, read from the ``c10d`` ops), ``h2d_bytes`` / ``d2h_bytes``, ``syncs`` /
``sync_kinds`` (what blocks the host on CUDA), ``ops`` (a launch proxy), fused-attention calls
and ``mem_bytes``, overall and per :meth:`CostLedger.section`. Counts are deterministic, so
tests may assert them. Shaped like :class:`~megatron_flat.runtime.memory.MemoryMeter`.

A CPU run counts with CUDA semantics: device data is told from host planning data by a taint
kept on each storage (:func:`mark_host`, :func:`mark_host_memory`, :func:`is_device_data`),
and every host→device copy a GPU would block on is a sync even though the CPU makes it free.
The rules, with their limits, are in docs/costs.md ("The cost ledger's rules").
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from megatron_flat.runtime import kernels, memory, patching

__all__ = [
    "CostLedger",
    "Costs",
    "mark_host",
    "mark_host_memory",
    "record_flops",
    "foreign_kernel",
    "record_stream_call",
    "record_sync",
    "record_transfer",
    "count",
    "counts_cells",
    "counts_header",
    "format_count",
    "is_device_data",
    "sync_mismatch",
    "sync_mismatches",
    "HOST_MASK_NON_BLOCKING",
    "UNFLAGGED_SYNC_KINDS",
]

# Host waits that torch makes without reaching warn_or_error_on_sync (docs/cuda-syncs.md, B9):
# real syncs, but set_sync_debug_mode does not flag them.
UNFLAGGED_SYNC_KINDS = frozenset({"event_synchronize", "device_synchronize"})

_TAINT = "_megatron_flat_taint"  # attribute on a storage's Python object
_HOST, _FACTORY, _DEVICE, _HOST_MEMORY = "host", "factory", "device", "host-memory"

_aten = torch.ops.aten
_c10d = torch.ops.c10d


_overloads = kernels.overloads


_SCALAR_SYNC = _overloads(_aten, "_local_scalar_dense", "equal")
# Output shape read from device data: the host waits for the device to know it.
_SHAPE_SYNC = _overloads(
    _aten,
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
)
# Ops that read a device value on the host twice (docs/cuda-syncs.md, B3): repeat_interleave
# reads the total and checks the repeats; bincount reads the minimum and the maximum.
_TWICE = frozenset({"repeat_interleave", "bincount"})
_REPEAT_INTERLEAVE = _overloads(_aten, "repeat_interleave")
_INDEX_READ = _overloads(_aten, "index")
_INDEX_PUT = _overloads(_aten, "index_put", "index_put_", "_index_put_impl_")
_MASK_INDEX = _INDEX_READ | _INDEX_PUT
# where(condition, self, other): a 0-dim host operand is moved to the device with a blocking
# copy (TensorCompare.cpp, where_self_out).
_WHERE = _overloads(_aten, "where")
# torch 2.13 turns a host boolean mask into indices on the host and copies them from pinned
# memory without blocking (ATen IndexingUtils.h, expandTensors); before, it blocked.
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
HOST_MASK_NON_BLOCKING = _TORCH >= (2, 13)
_COPIES = _overloads(_aten, "copy_", "_to_copy", "_copy_from")
# torch.tensor(data) wraps a tensor made from Python data: host data, whatever its input.
_LIFT = _overloads(_aten, "lift_fresh", "lift_fresh_copy", "lift")
# Fused attention kernels (torch's CPU flash kernel and its CUDA backends), forward and
# backward: what attention replay saves is counted in calls of these.
_ATTENTION_FORWARD = _overloads(
    _aten, "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward")
_ATTENTION_BACKWARD = _overloads(
    _aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
    "_efficient_attention_backward")


# -- FLOPs ------------------------------------------------------------------------


def _mm(a: torch.Tensor, b: torch.Tensor) -> int:
    return 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, *rest: Any, **kw: Any) -> int:
    # 2-D x 3-D with offsets: every row of a meets one expert's K x N.
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 3 and b.dim() == 3:
        return _bmm(a, b)
    return 2 * a.shape[0] * a.shape[1] * b.shape[-1]


_FLOPS: dict[Any, Callable[..., int]] = {}
for _op in _overloads(_aten, "mm"):
    _FLOPS[_op] = lambda a, b, *r, **k: _mm(a, b)
for _op in _overloads(_aten, "addmm", "addmm_"):
    _FLOPS[_op] = lambda c, a, b, *r, **k: _mm(a, b)
for _op in _overloads(_aten, "bmm"):
    _FLOPS[_op] = lambda a, b, *r, **k: _bmm(a, b)
for _op in _overloads(_aten, "baddbmm", "addbmm", "baddbmm_", "addbmm_"):
    _FLOPS[_op] = lambda c, a, b, *r, **k: _bmm(a, b)
for _op in _overloads(_aten, "mv"):
    _FLOPS[_op] = lambda a, v, *r, **k: 2 * a.shape[0] * a.shape[1]
for _op in _overloads(_aten, "addmv", "addmv_"):
    _FLOPS[_op] = lambda c, a, v, *r, **k: 2 * a.shape[0] * a.shape[1]
for _op in _overloads(_aten, "dot", "vdot"):
    _FLOPS[_op] = lambda a, b, *r, **k: 2 * a.shape[0]
for _op in _overloads(_aten, "_grouped_mm"):
    _FLOPS[_op] = _grouped_mm


def _attention_pairs(sq: int, sk: int, causal: bool) -> int:
    """Query-key pairs a fused kernel computes: all, or the causal ones (torch's is_causal
    is aligned top-left: query i sees keys 0..i)."""
    if not causal:
        return sq * sk
    full = min(sq, sk)
    return full * (full + 1) // 2 + max(0, sq - sk) * sk


def _cpu_flash_forward(q, k, v, dropout_p=0.0, is_causal=False, *r, **kw) -> int:
    # [b, h, s, d]: S = QK^T and O = PV, 2 FLOPs per multiply-add.
    pairs = q.shape[0] * q.shape[1] * _attention_pairs(q.shape[2], k.shape[2], bool(is_causal))
    return 2 * pairs * (q.shape[3] + v.shape[3])


def _cpu_flash_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *r,
                        **kw) -> int:
    # S again, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.
    pairs = q.shape[0] * q.shape[1] * _attention_pairs(q.shape[2], k.shape[2], bool(is_causal))
    return 2 * pairs * (3 * q.shape[3] + 2 * v.shape[3])


def _cuda_flash_backward(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                         dropout_p=0.0, is_causal=False, *r, **kw) -> int:
    # The CUDA kernel's backward takes the sequence bounds before dropout_p and is_causal.
    return _cpu_flash_backward(grad_out, q, k, v, out, lse, dropout_p, is_causal)


for _op in _overloads(_aten, "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_flash_attention"):
    _FLOPS[_op] = _cpu_flash_forward  # the same (q, k, v, dropout_p, is_causal, ...) head
for _op in _overloads(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
    _FLOPS[_op] = _cpu_flash_backward
for _op in _overloads(_aten, "_scaled_dot_product_flash_attention_backward"):
    _FLOPS[_op] = _cuda_flash_backward


# -- collectives --------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size_rank(pg: Any) -> tuple[int, int]:
    """(size, rank in group) of the process group a c10d op received.

    The dispatcher hands over a TorchScript object; ``ProcessGroup.unbox``
    gives back the Python group.
    """
    group = pg
    if not hasattr(group, "size"):
        unbox = getattr(torch.distributed.ProcessGroup, "unbox", None)
        if unbox is None:
            raise RuntimeError("CostLedger: cannot read the process group of a collective")
        group = unbox(pg)
    return int(group.size()), int(group.rank())


def _a2a_bytes(output, input, pg, output_split_sizes, input_split_sizes, *r, **k) -> int:
    size, rank = _group_size_rank(pg)
    total = _nbytes(input)
    if input.numel() == 0:
        return 0
    row = total // max(input.shape[0], 1)
    if input_split_sizes:
        kept = input_split_sizes[rank] * row if rank < len(input_split_sizes) else 0
    else:
        kept = total // size
    return total - kept


def _allgather_bytes(output, input, pg, *r, **k) -> int:
    size, _ = _group_size_rank(pg)
    return (size - 1) * _nbytes(input)


def _reduce_scatter_bytes(output, input, pg, *r, **k) -> int:
    size, _ = _group_size_rank(pg)
    return (size - 1) * _nbytes(input) // size


def _allreduce_bytes(tensors, pg, *r, **k) -> int:
    size, _ = _group_size_rank(pg)
    return sum(2 * (size - 1) * _nbytes(t) // size for t in tensors)


def _list_bytes(tensors, *r, **k) -> int:
    return sum(_nbytes(t) for t in tensors)


def _input_bytes(outputs, inputs, *r, **k) -> int:
    return sum(_nbytes(t) for t in inputs)


def _allgather_list_bytes(outputs, inputs, pg, *r, **k) -> int:
    """All-gathers with input tensors (list form and coalesced): (P−1)·each input."""
    size, _ = _group_size_rank(pg)
    return sum((size - 1) * _nbytes(t) for t in inputs)


def _reduce_scatter_coalesced_bytes(outputs, inputs, pg, *r, **k) -> int:
    size, _ = _group_size_rank(pg)
    return sum((size - 1) * _nbytes(t) // size for t in inputs)


def _reduce_scatter_list_bytes(outputs, input_lists, pg, *r, **k) -> int:
    size, _ = _group_size_rank(pg)
    return sum((size - 1) * _nbytes(out) for out in outputs)


def _zero(*r, **k) -> int:
    return 0


# c10d op -> (name in the ledger, bytes this rank sends)
_COLLECTIVES: dict[Any, tuple[str, Callable[..., int]]] = {}
for _name, _packet, _fn in (
    ("all_to_all_single", "alltoall_base_", _a2a_bytes),
    ("all_gather_into_tensor", "_allgather_base_", _allgather_bytes),
    ("reduce_scatter_tensor", "_reduce_scatter_base_", _reduce_scatter_bytes),
    ("all_reduce", "allreduce_", _allreduce_bytes),
    ("all_reduce", "allreduce_coalesced_", _allreduce_bytes),
    ("broadcast", "broadcast_", _list_bytes),
    ("send", "send", _list_bytes),
    ("recv", "recv_", _zero),
    ("recv", "recv_any_source_", _zero),
    ("all_gather", "allgather_", _allgather_list_bytes),
    ("all_gather", "allgather_coalesced_", _allgather_list_bytes),
    ("all_gather_into_tensor", "allgather_into_tensor_coalesced_", _allgather_list_bytes),
    ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced_",
     _reduce_scatter_coalesced_bytes),
    ("reduce_scatter", "reduce_scatter_", _reduce_scatter_list_bytes),
    ("reduce", "reduce_", _list_bytes),
    ("gather", "gather_", _input_bytes),
    ("scatter", "scatter_", lambda outs, ins, *r, **k: sum(_nbytes(t) for t in outs)),
    ("all_to_all", "alltoall_", _input_bytes),
    ("barrier", "barrier", _zero),
):
    for _op in _overloads(_c10d, _packet):
        _COLLECTIVES[_op] = (_name, _fn)


# -- taint ----------------------------------------------------------------------------


def _storage(t: Any) -> Optional[torch.UntypedStorage]:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _taint_of(s: torch.UntypedStorage) -> Optional[str]:
    # A host pool registers its buffer after allocating it (inside an op the ledger
    # already marked), so the registry wins over the mark.
    if memory.is_host_storage(s):
        return _HOST_MEMORY
    return getattr(s, _TAINT, None)


def _set_taint(s: torch.UntypedStorage, mark: str) -> None:
    try:
        setattr(s, _TAINT, mark)
    except (AttributeError, TypeError):
        pass


def is_device_data(t: torch.Tensor) -> bool:
    """Whether ``t`` counts as device data (see the module docstring)."""
    if t.device.type != "cpu":
        return t.device.type != "meta"
    if not _cpu_run():  # beside a GPU, a CPU tensor is host memory, whatever made it
        return False
    s = _storage(t)
    if s is None:
        return False
    mark = _taint_of(s)
    return mark is None or mark == _DEVICE


def _is_host_side(t: Any) -> bool:
    """Whether ``t`` is data the host holds: a CPU tensor beside a GPU; on a CPU run, host
    data (Python data, a host read) or host memory. Factory data may be on the device."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    return not _cpu_run() or _mark_of(t) in (_HOST, _HOST_MEMORY)


def _is_host_memory(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        s = _storage(t)
        if s is None:
            return False
        if torch.cuda.is_available():
            return True
        return _taint_of(s) == _HOST_MEMORY
    return False


def _mark_of(t: torch.Tensor) -> Optional[str]:
    """A CPU tensor's taint (None: never seen, or not a CPU tensor with a storage)."""
    if t.device.type != "cpu":
        return None
    s = _storage(t)
    return None if s is None else _taint_of(s)


def _mark_device(t: torch.Tensor) -> None:
    """Mark an upload's result as device data (host memory keeps its mark)."""
    s = _storage(t)
    if s is not None and t.device.type == "cpu" and _taint_of(s) != _HOST_MEMORY:
        _set_taint(s, _DEVICE)


def _origin(leaves: list) -> str:
    """Taint of what an op without device-data inputs makes: host data if any input came
    from the host (Python data, a host read, host memory), else a factory's output. A 0-dim
    host value beside tensors with dimensions is a kernel argument (a number), not data that
    makes the result host-resident: ``buf[mask] = 0`` leaves a factory buffer a factory's."""
    shaped = [t for t in leaves if t.dim() > 0]
    for t in shaped or leaves:
        if _mark_of(t) in (_HOST, _HOST_MEMORY):
            return _HOST
    return _FACTORY


def _cpu_run() -> bool:
    """Whether CPU tensors stand for the compute device's data (no CUDA here): the
    Python-level upload rules apply; with CUDA, the dispatcher sees real copies."""
    return not torch.cuda.is_available()


def _names_compute_device(spec: Any) -> bool:
    """On a CPU run, whether a ``device`` argument names the compute device: a
    ``torch.device`` object or an int (what device-agnostic code passes, ``x.device``),
    or a tensor holding device data (``.to(other)``). A string (``"cpu"``) names the host."""
    if isinstance(spec, torch.Tensor):
        return is_device_data(spec)
    if isinstance(spec, bool):
        return False
    return isinstance(spec, (torch.device, int))


def mark_host(*tensors: torch.Tensor) -> None:
    """Mark tensors as host data (a plan cached on the host): reading them is no sync, and
    an op that also reads device data uploads them (see the module docstring); no ledger
    needed.

    On CUDA this is a no-op: the device tells host data from device data.
    """
    for t in tensors:
        s = _storage(t)
        if s is not None and t.device.type == "cpu" and _taint_of(s) != _HOST_MEMORY:
            _set_taint(s, _HOST)


def mark_host_memory(*tensors: torch.Tensor) -> None:
    """Mark tensors' storages as host memory: copies to or from them count as h2d/d2h."""
    for t in tensors:
        s = _storage(t)
        if s is not None and t.device.type == "cpu":
            _set_taint(s, _HOST_MEMORY)


# -- figures --------------------------------------------------------------------------


@dataclass
class Costs:
    """Counts over a block or a section; sections entered several times add up."""

    name: str = ""
    flops: int = 0
    collective_bytes: dict[str, int] = field(default_factory=dict)
    collective_calls: dict[str, int] = field(default_factory=dict)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    syncs: int = 0
    sync_kinds: Counter = field(default_factory=Counter)
    ops: int = 0
    mem_bytes: int = 0
    attention_forward_calls: int = 0
    attention_backward_calls: int = 0
    entries: int = 0
    # ops on host data only (no kernel on a GPU) and the kernels the rest launch, by class
    # and size (runtime.kernels): what plan.time turns into seconds per device
    host_ops: int = 0
    kernels: dict[str, list[int]] = field(default_factory=dict)
    # host calls into the CUDA runtime that launch no kernel (runtime.streams): an event
    # recorded or waited on, a stream switched, a block recorded on a stream, by kind
    stream_calls: Counter = field(default_factory=Counter)

    @property
    def all_to_all_bytes(self) -> int:
        """Bytes sent by all-to-all collectives (single and list forms)."""
        return self.collective_bytes.get("all_to_all_single", 0) + self.collective_bytes.get(
            "all_to_all", 0
        )

    @property
    def flagged_syncs(self) -> int:
        """The syncs ``torch.cuda.set_sync_debug_mode`` flags: all but the host waits torch
        makes without its hook (an event's or the device's synchronize)."""
        return self.syncs - sum(self.sync_kinds[k] for k in UNFLAGGED_SYNC_KINDS)

    @property
    def other_collective_bytes(self) -> int:
        """Bytes sent by every collective that is not an all-to-all."""
        return sum(self.collective_bytes.values()) - self.all_to_all_bytes

    def add_collective(self, name: str, nbytes: int) -> None:
        self.collective_bytes[name] = self.collective_bytes.get(name, 0) + nbytes
        self.collective_calls[name] = self.collective_calls.get(name, 0) + 1

    def add_sync(self, kind: str) -> None:
        self.syncs += 1
        self.sync_kinds[kind] += 1

    def add_kernel(self, key: str, work: int, nbytes: int) -> None:
        """One launched kernel into the profile (``[count, work, bytes]`` per key)."""
        row = self.kernels.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += int(work)
        row[2] += int(nbytes)

    def as_dict(self) -> dict[str, Any]:
        """Plain-JSON figures (the keys the benchmarks write)."""
        return {
            "flops": self.flops,
            "all_to_all_bytes": self.all_to_all_bytes,
            "other_collective_bytes": self.other_collective_bytes,
            "collective_bytes": dict(self.collective_bytes),
            "collective_calls": dict(self.collective_calls),
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "syncs": self.syncs,
            "flagged_syncs": self.flagged_syncs,
            "sync_kinds": dict(self.sync_kinds),
            "ops": self.ops,
            "mem_bytes": self.mem_bytes,
            "attention_forward_calls": self.attention_forward_calls,
            "attention_backward_calls": self.attention_backward_calls,
            "host_ops": self.host_ops,
            "kernels": {k: list(v) for k, v in sorted(self.kernels.items())},
            "stream_calls": dict(self.stream_calls),
        }


class _LedgerMode(TorchDispatchMode):
    """Counts every op into the ledger's open targets (its totals and sections)."""

    def __init__(self, ledger: "CostLedger") -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _quiet():
            self.ledger._count(func, args, kwargs, out)
        return out


_LOCAL = threading.local()


def _quiet() -> bool:
    return getattr(_LOCAL, "quiet", 0) > 0


@contextmanager
def quietly() -> Iterator[None]:
    _LOCAL.quiet = getattr(_LOCAL, "quiet", 0) + 1
    try:
        yield
    finally:
        _LOCAL.quiet -= 1


def _open_ledgers() -> list["CostLedger"]:
    return [m.ledger for m in _get_current_dispatch_mode_stack() if isinstance(m, _LedgerMode)]


def _open_targets() -> list["Costs"]:
    """Every open ledger's and section's figures in this thread (none while quiet)."""
    if _quiet():
        return []
    return [target for ledger in _open_ledgers() for target in ledger._targets()]


def record_sync(kind: str) -> None:
    """Count a host sync the dispatcher cannot see (an event or stream synchronize)
    in every open ledger here. Called by :mod:`megatron_flat.runtime.streams` and by the
    CPU backend's stand-ins for CUDA events, so that CPU runs count the waits a GPU run
    makes."""
    for target in _open_targets():
        target.add_sync(kind)


def record_stream_call(kind: str, n: int = 1) -> None:
    """Count ``n`` host calls into the CUDA runtime that launch no kernel (``event_record``,
    ``event_wait``, ``set_stream``, ``record_stream``, ``event_query``) in every open ledger
    here. Called by :mod:`megatron_flat.runtime.streams` on either device: a GPU run makes
    the same calls, each costing host time between two launches."""
    for target in _open_targets():
        target.stream_calls[kind] += n


def record_transfer(h2d_bytes: int = 0, d2h_bytes: int = 0) -> None:
    """Count a host↔device copy the dispatcher cannot tell from a device copy on CPU
    (an emulated non-blocking device→host copy) in every open ledger here."""
    for target in _open_targets():
        target.h2d_bytes += int(h2d_bytes)
        target.d2h_bytes += int(d2h_bytes)


def record_flops(flops: int) -> None:
    """Add FLOPs of a kernel the dispatcher does not see to every open ledger here."""
    for target in _open_targets():
        target.flops += int(flops)


@contextmanager
def foreign_kernel(flops: int = 0, mem_bytes: int = 0) -> Iterator[None]:
    """Run one kernel the dispatcher does not see (a Triton kernel): it counts as one op
    with the given FLOPs and bytes in every open ledger here, and the torch ops run inside
    the block are not counted (on CPU, the Triton interpreter's own copies of the kernel's
    arguments are an artifact of emulation, not work a GPU does)."""
    for target in _open_targets():
        target.ops += 1
        target.flops += int(flops)
        target.mem_bytes += int(mem_bytes)
        target.add_kernel("gemm:0" if flops else kernels.mem_key(mem_bytes), flops, mem_bytes)
    with quietly():
        yield


# -- Python-level syncs and uploads: calls that never reach the dispatcher on CPU --

_PATCH_LOCK = threading.Lock()
_PATCH_COUNT = 0


def _count_python_sync(kind: str, t: torch.Tensor) -> bool:
    if not isinstance(t, torch.Tensor) or not is_device_data(t):
        return False
    targets = _open_targets()
    for target in targets:
        target.add_sync(kind)
        target.d2h_bytes += _nbytes(t)
        target.ops += 1
        target.add_kernel("copy", 0, _nbytes(t))
    return bool(targets)


def _patched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:

    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted = _count_python_sync(name, self)
        with quietly():
            out = original(self, *args, **kwargs)
            if (
                name == "cpu"
                and counted
                and self.device.type == "cpu"
                and isinstance(out, torch.Tensor)
            ):
                # On a GPU this is a fresh host copy; on CPU it would alias the
                # device data, so make the copy and mark it host memory.
                out = out.clone()
                mark_host_memory(out)
        return out

    method.__name__ = name
    method.__doc__ = original.__doc__
    return method


def _count_upload(src: Optional[torch.Tensor], nbytes: int, non_blocking: bool) -> None:
    """One host→device copy: an op, its bytes, and a sync unless it leaves pinned memory
    (host memory) without blocking."""
    sync = not (non_blocking and src is not None and _is_host_memory(src))
    for target in _open_targets():
        target.ops += 1
        target.h2d_bytes += int(nbytes)
        target.add_kernel("copy", 0, nbytes)
        if sync:
            target.add_sync("h2d_copy")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = _storage(a), _storage(b)
    return sa is not None and sb is not None and sa.data_ptr() == sb.data_ptr()


def _uploaded(out: Any, src: Optional[torch.Tensor]) -> Any:
    """An upload's result on CPU: device data, never the host source re-marked (on CPU
    ``.to(device)`` returns its input; on a GPU the result is a fresh device tensor)."""
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return out
    if src is not None and _shares_storage(out, src):
        with quietly():
            out = out.clone()
    _mark_device(out)
    return out


def _is_cpu_host_source(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and not is_device_data(t)


def _to_device_spec(args: tuple, kwargs: dict) -> Any:
    """The device argument of ``Tensor.to`` as written: a device, string, int or tensor."""
    if "device" in kwargs:
        return kwargs["device"]
    if "other" in kwargs:
        return kwargs["other"]
    if args and not isinstance(args[0], torch.dtype):
        return args[0]
    return None


def _to_non_blocking(args: tuple, kwargs: dict) -> bool:
    try:
        return bool(torch._C._nn._parse_to(*args, **kwargs)[2])
    except (TypeError, RuntimeError):
        return bool(kwargs.get("non_blocking", False))


def _patched_to(original: Callable[..., Any]) -> Callable[..., Any]:

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not (
            _cpu_run()
            and _is_cpu_host_source(self)
            and _names_compute_device(_to_device_spec(args, kwargs))
            and _open_targets()
        ):
            return original(self, *args, **kwargs)
        with quietly():
            out = original(self, *args, **kwargs)
        _count_upload(self, _nbytes(self), _to_non_blocking(args, kwargs))
        return _uploaded(out, self)

    to.__name__ = "to"
    to.__doc__ = original.__doc__
    return to


def _patched_cuda(original: Callable[..., Any]) -> Callable[..., Any]:

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # Without CUDA, ``.cuda()`` raises unless a CPU backend made it the identity
        # (megatron_flat.cpu.training): then it moves to the compute device.
        if not (_cpu_run() and _is_cpu_host_source(self) and _open_targets()):
            return original(self, *args, **kwargs)
        with quietly():
            out = original(self, *args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            return out
        non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
        _count_upload(self, _nbytes(self), bool(non_blocking))
        return _uploaded(out, self)

    cuda.__name__ = "cuda"
    cuda.__doc__ = original.__doc__
    return cuda


def _patched_from_data(name: str, device_position: Optional[int],
                       original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.tensor`` / ``torch.as_tensor``: an upload when ``device=`` names the compute
    device and the data comes from the host (Python data, NumPy, a host tensor)."""

    def from_data(data: Any, *args: Any, **kwargs: Any) -> Any:
        targets = _open_targets()
        source = data if isinstance(data, torch.Tensor) else None
        if not targets or (source is not None and not _is_cpu_host_source(source)):
            return original(data, *args, **kwargs)
        if not _cpu_run():
            # On CUDA, the copy of Python data to the device happens below the
            # dispatcher (only ``lift_fresh`` is seen); a tensor's copy is seen.
            before = targets[0].h2d_bytes
            out = original(data, *args, **kwargs)
            if (
                isinstance(out, torch.Tensor)
                and out.device.type == "cuda"
                and targets[0].h2d_bytes == before
            ):
                _count_upload(None, _nbytes(out), False)
            return out
        spec = kwargs.get("device")
        if device_position is not None and len(args) > device_position:
            spec = args[device_position]
        if not _names_compute_device(spec):
            return original(data, *args, **kwargs)
        with quietly():
            out = original(data, *args, **kwargs)
        _count_upload(source, _nbytes(source if source is not None else out), False)
        return _uploaded(out, source)

    from_data.__name__ = name
    from_data.__doc__ = original.__doc__
    return from_data


# Calls that never reach the dispatcher on CPU; the wrappers are in place while any ledger is
# open (runtime.patching: one registry, reverted when the last ledger closes).
_SYNC_WHY = "a device-to-host read there is a sync the dispatcher does not see on CPU"
_UPLOAD_WHY = "a host-to-device copy there is an upload the dispatcher does not see on CPU"
_PATCHES: tuple = (
    *(patching.Patch("torch.Tensor", name, functools.partial(_patched, name),
                     expects=f"Tensor.{name}", why=_SYNC_WHY)
      for name in ("tolist", "numpy", "cpu")),
    patching.Patch("torch.Tensor", "to", _patched_to, expects="Tensor.to", why=_UPLOAD_WHY),
    patching.Patch("torch.Tensor", "cuda", _patched_cuda, expects="Tensor.cuda",
                   why=_UPLOAD_WHY),
    # device= keyword-only
    patching.Patch("torch", "tensor", functools.partial(_patched_from_data, "tensor", None),
                   expects="torch.tensor", why=_UPLOAD_WHY),
    # (data, dtype, device)
    patching.Patch("torch", "as_tensor", functools.partial(_patched_from_data, "as_tensor", 1),
                   expects="torch.as_tensor", why=_UPLOAD_WHY),
)


def _install_patches() -> None:
    global _PATCH_COUNT
    with _PATCH_LOCK:
        if _PATCH_COUNT == 0:
            for patch in _PATCHES:
                patching.apply(patch)
        _PATCH_COUNT += 1


def _remove_patches() -> None:
    global _PATCH_COUNT
    with _PATCH_LOCK:
        _PATCH_COUNT -= 1
        if _PATCH_COUNT == 0:
            # A wrapper put on top while a ledger was open (a CPU backend's ``.cuda``) stays;
            # ours stays inside it (revert says False) and counts nothing with no ledger open.
            for patch in reversed(_PATCHES):
                patching.revert(patch)


# -- the ledger -------------------------------------------------------------------


class CostLedger:
    """Count FLOPs, collective bytes, host↔device bytes, syncs and ops in a block.

    Totals are attributes of the ledger (``flops``, ``collective_bytes``, …,
    the fields of :class:`Costs`), readable during the block and final after
    it; :meth:`section` counts a named part into ``sections[name]``. Ledgers
    nest: an inner ledger's ops count in the outer one too. A ledger is
    entered once. See the module docstring for what each figure means and how
    device data is told from host data on CPU.
    """

    def __init__(self, cuda_sync_check: bool = False) -> None:
        self.totals = Costs(name="total")
        self.sections: dict[str, Costs] = {}
        self.cuda_sync_warnings = 0
        self._open: list[Costs] = []
        self._mode: Optional[_LedgerMode] = None
        self._closed = False
        self._lock = threading.Lock()
        self._cuda_sync_check = bool(cuda_sync_check) and torch.cuda.is_available()
        self._warn_ctx: Any = None
        self._warn_log: Optional[list] = None
        self._old_sync_mode: Optional[int] = None

    # -- figures (totals) ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally: the totals' fields.
        if name in Costs.__dataclass_fields__ or name in (
            "all_to_all_bytes",
            "other_collective_bytes",
        ):
            return getattr(self.__dict__["totals"], name)
        raise AttributeError(name)

    def as_dict(self) -> dict[str, Any]:
        """Totals as plain JSON, with ``sections`` by name."""
        out = self.totals.as_dict()
        out["sections"] = {n: c.as_dict() for n, c in self.sections.items()}
        if self._cuda_sync_check:
            out["cuda_sync_warnings"] = self.cuda_sync_warnings
        return out

    # -- context ------------------------------------------------------------

    def __enter__(self) -> "CostLedger":
        if self._mode is not None or self._closed:
            raise RuntimeError("a CostLedger can be entered only once")
        _install_patches()
        self._mode = _LedgerMode(self)
        self._open = [self.totals]
        if self._cuda_sync_check:
            self._warn_ctx = warnings.catch_warnings(record=True)
            self._warn_log = self._warn_ctx.__enter__()
            warnings.simplefilter("always")
            self._old_sync_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is None or self._closed:
            return
        self._mode.__exit__(*exc)
        self._closed = True
        self._open = []
        if self._cuda_sync_check:
            torch.cuda.set_sync_debug_mode(self._old_sync_mode or 0)
            assert self._warn_log is not None
            self.cuda_sync_warnings = sum(
                "synchroniz" in str(w.message).lower() for w in self._warn_log
            )
            self._warn_ctx.__exit__(*exc)
        _remove_patches()

    @contextmanager
    def section(self, name: str) -> Iterator[Costs]:
        """Count a named part of the block into ``sections[name]`` (and the totals)."""
        if self._mode is None or self._closed:
            raise RuntimeError("CostLedger.section needs an open ledger")
        costs = self.sections.setdefault(name, Costs(name=name))
        with self._lock:
            self._open.append(costs)
        try:
            yield costs
        finally:
            with self._lock:
                self._open.remove(costs)
            costs.entries += 1

    def _targets(self) -> list[Costs]:
        return list(self._open)

    # -- counting -----------------------------------------------------------

    def _count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        targets = self._targets()
        if not targets:
            return
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        device_in = func not in _LIFT and any(is_device_data(t) for t in leaves)
        collective = _COLLECTIVES.get(func)
        if collective is not None:
            name, fn = collective
            nbytes = int(fn(*args, **kwargs))
            for target in targets:
                target.add_collective(name, nbytes)
                target.ops += 1
            # What a collective writes is device data: on a GPU, NCCL moves device memory
            # only (a gloo group for host data does not exist in a CPU run's picture). Its
            # inputs keep their mark: on a GPU a host row is copied to the device first, and
            # on CPU that copy is the row itself.
            written = [] if name in ("send", "barrier") else [
                t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
            self._taint_outputs(written, out)
            return
        origin = None if device_in else _HOST if func in _LIFT else _origin(leaves)
        if func.is_view:  # no kernel; the alias shares its storage's mark
            if origin is None:
                self._taint_outputs((), out)
            else:
                self._mark_fresh(origin, (), out)
            return
        flops = _FLOPS.get(func)
        f = int(flops(*args, **kwargs)) if flops is not None else 0
        h2d, d2h, copy_sync = self._copy_bytes(func, args, kwargs, out)
        syncs = self._sync_kinds(func, args, kwargs, device_in)
        if copy_sync is not None:
            syncs.append(copy_sync)
        implicit, implicit_syncs = (self._implicit_uploads(func, args, leaves)
                                    if device_in and func not in _COPIES else (0, 0))
        syncs.extend(["h2d_implicit"] * implicit_syncs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        written = self._written(func, args, kwargs)
        # an in-place update that returns nothing (a _foreach_ step) writes its arguments
        mem = sum(_nbytes(t) for t in leaves) + sum(_nbytes(t) for t in outs or written)
        attn_fwd, attn_bwd = func in _ATTENTION_FORWARD, func in _ATTENTION_BACKWARD
        # an op on host data only launches nothing on a GPU (host time only)
        host_only = not device_in and origin == _HOST and not (h2d or d2h)
        key, work, kernel_bytes = ("", 0, 0) if host_only else kernels.profile_key(
            func, args, kwargs, out, f, mem, copy=bool(h2d or d2h))
        for target in targets:
            target.ops += 1
            if host_only:
                target.host_ops += 1
            else:
                target.add_kernel(key, work, kernel_bytes)
            target.flops += f
            target.attention_forward_calls += attn_fwd
            target.attention_backward_calls += attn_bwd
            target.h2d_bytes += h2d + implicit
            target.d2h_bytes += d2h
            target.mem_bytes += mem
            for kind in syncs:
                target.add_sync(kind)
        if origin is None or h2d:  # an upload's destination is device data
            self._taint_outputs(written, out)
        else:
            self._mark_fresh(origin, written, out)

    @staticmethod
    def _mark_fresh(origin: str, written: Any, out: Any) -> None:
        """Outputs of an op without device-data inputs: host data if an input came from the
        host, else factory data; a factory buffer that host data is written into is host data."""
        for t in list(written) + pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            s = _storage(t)
            if s is None or memory.is_host_storage(s):
                continue
            mark = getattr(s, _TAINT, None)
            if mark is None or (mark == _FACTORY and origin == _HOST):
                _set_taint(s, origin)

    @staticmethod
    def _implicit_uploads(func: Any, args: tuple, leaves: list) -> tuple[int, int]:
        """(bytes, blocking copies) of the host tensors an op with device-data inputs reads,
        each uploaded on CUDA (an index) or an error there: HOST-marked CPU tensors with
        dim > 0 on CPU, any CPU tensor with dim > 0 beside CUDA ones on CUDA, each one
        blocking copy (``index.to(device)``). 0-dim tensors are scalars (see
        :meth:`_sync_kinds` for the ops that upload those). A host boolean mask of an index
        op is the exception: its ``nonzero`` runs on the host and the indices travel from
        pinned memory without blocking (torch >= 2.13, ``expandTensors``)."""
        cuda = any(t.device.type == "cuda" for t in leaves)
        masks = _index_masks(func, args) if HOST_MASK_NON_BLOCKING else []
        seen: set = set()
        total = blocking = 0
        for t in leaves:
            if t.dim() == 0 or t.device.type != "cpu" or id(t) in seen:
                continue
            if cuda or _mark_of(t) == _HOST:
                seen.add(id(t))
                if any(t is m for m in masks):
                    total += int(torch.count_nonzero(t)) * t.dim() * 8  # int64 indices
                else:
                    total += _nbytes(t)
                    blocking += 1
        return total, blocking

    @staticmethod
    def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        written: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
        return written

    @staticmethod
    def _taint_outputs(written: Any, out: Any) -> None:
        for t in list(written) + pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            s = _storage(t)
            if s is not None and _taint_of(s) != _HOST_MEMORY:
                _set_taint(s, _DEVICE)

    @staticmethod
    def _copy_bytes(func: Any, args: tuple, kwargs: dict,
                    out: Any) -> tuple[int, int, Optional[str]]:
        """(h2d bytes, d2h bytes, the sync's kind or None) of a host↔device copy op, else
        zeros and None. A blocking copy (no ``non_blocking=True``) between host and device
        is a sync on CUDA, from pinned memory too (``copy_kernel_cuda`` →
        ``memcpy_and_sync``); of a 0-dim host value it is an ``h2d_scalar``."""
        if func not in _COPIES:
            return 0, 0, None
        if func._overloadpacket is _aten._to_copy:
            src, dst = args[0], out
        elif func._overloadpacket is _aten.copy_:
            dst, src = args[0], args[1]
        else:  # _copy_from(self, dst)
            src, dst = args[0], args[1]
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            return 0, 0, None
        non_blocking = bool(
            kwargs.get("non_blocking", args[2] if len(args) > 2 and func._overloadpacket is _aten.copy_ else False)
        )
        upload = "h2d_scalar" if src.dim() == 0 else "h2d_copy"
        if src.device.type == "cuda" or dst.device.type == "cuda":
            if src.device.type == dst.device.type:
                return 0, 0, None
            n = _nbytes(src)
            if src.device.type == "cpu":
                return n, 0, None if non_blocking else upload
            return 0, n, None if non_blocking else "d2h_copy"
        src_host, dst_host = _is_host_memory(src), _is_host_memory(dst)
        if src_host == dst_host:
            if (
                not src_host
                and func._overloadpacket is _aten.copy_
                and _mark_of(src) == _HOST
                and is_device_data(dst)
                and not (non_blocking and src.dim() == 0)
            ):  # host data (pageable) into device data: an upload that blocks (a 0-dim
                # value too: the CUDA copy of a 0-dim CPU tensor is blocking unless asked)
                return _nbytes(src), 0, upload
            return 0, 0, None
        n = _nbytes(src)
        # As on CUDA: a copy between host memory and the device blocks unless asked not to
        # (the code states on CPU what it would do on a GPU; CPU copies are done either way).
        if src_host:
            return n, 0, None if non_blocking else upload
        return 0, n, None if non_blocking else "d2h_copy"

    @staticmethod
    def _sync_kinds(func: Any, args: tuple, kwargs: dict, device_in: bool) -> list[str]:
        """The host syncs an op with device-data inputs makes on CUDA (besides a copy's and
        a host index's upload), one kind per blocking point, read from torch's source
        (docs/cuda-syncs.md)."""
        if not device_in:
            return []
        name = func._overloadpacket.__name__
        if func in _SCALAR_SYNC:
            return ["item" if name == "_local_scalar_dense" else name]
        if func in _SHAPE_SYNC:
            kind = name.lstrip("_")
            if kind == "bincount" and isinstance(args[0], torch.Tensor) \
                    and args[0].dtype == torch.uint8:
                return [kind]  # no minimum to check for uint8
            return [kind] * (2 if kind in _TWICE else 1)
        if func in _REPEAT_INTERLEAVE:
            # Only a repeats tensor without output_size makes the output size unknown.
            if kwargs.get("output_size") is not None:
                return []
            position = 0 if func._overloadname == "Tensor" else 1
            repeats = args[position] if len(args) > position else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and is_device_data(repeats):
                return ["repeat_interleave"] * 2
            return []
        if func in _WHERE:
            # where(cond, self, other): each 0-dim host operand goes to the device blocking
            return ["h2d_scalar" for t in args[1:3] if isinstance(t, torch.Tensor)
                    and t.dim() == 0 and _is_host_side(t)]
        if func in _INDEX_PUT:
            return _index_put_syncs(func, args, kwargs)
        if func in _INDEX_READ:
            # each boolean mask on the device is turned into indices with nonzero
            return ["mask_index" for m in _index_masks(func, args) if is_device_data(m)]
        return []


def _index_tensors(func: Any, args: tuple, kwargs: Optional[dict] = None) -> list:
    """The tensors of an index op's ``indices`` argument (None entries left out)."""
    if func not in _MASK_INDEX:
        return []
    indices = args[1] if len(args) > 1 else (kwargs or {}).get("indices")
    return [i for i in indices or () if isinstance(i, torch.Tensor)]


def _index_masks(func: Any, args: tuple, kwargs: Optional[dict] = None) -> list[torch.Tensor]:
    """The boolean (or uint8) index tensors of an index op's ``indices`` argument."""
    return [i for i in _index_tensors(func, args, kwargs)
            if i.dtype in (torch.bool, torch.uint8)]


def _index_put_syncs(func: Any, args: tuple, kwargs: dict) -> list[str]:
    """``index_put_(self, indices, value, accumulate)`` on CUDA (``_index_put_impl_``,
    TensorAdvancedIndexing.cpp): one boolean mask on the device and a one-element host value
    without accumulation become ``masked_fill_`` (no sync: the value is read on the host);
    else a 0-dim host value is moved to the device with a blocking copy, and each mask on
    the device is turned into indices with ``nonzero``."""
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
    given = _index_tensors(func, args, kwargs)
    masks = [i for i in given if i.dtype in (torch.bool, torch.uint8)]
    host_value = isinstance(value, torch.Tensor) and _is_host_side(value)
    # the mask on self's device: device data, or factory data (which may be there, as a
    # mask computed from a factory-made batch is on a GPU)
    if (not accumulate and host_value and value.numel() == 1 and len(given) == 1
            and len(masks) == 1 and not _is_host_side(masks[0])):
        return []
    kinds = ["h2d_scalar"] if host_value and value.dim() == 0 else []
    return kinds + ["mask_index" for m in masks if is_device_data(m)]


def sync_mismatch(record: dict) -> Optional[str]:
    """For a ledger's ``as_dict()`` made with ``cuda_sync_check=True`` on CUDA: None when its
    flagged syncs equal ``set_sync_debug_mode``'s warnings, else a line saying both (and the
    kinds). None too when the record holds no CUDA count (a CPU run)."""
    warned = record.get("cuda_sync_warnings")
    if warned is None:
        return None
    flagged = record.get("flagged_syncs", record.get("syncs", 0))
    if flagged == warned:
        return None
    return (f"the ledger counted {flagged} flagged syncs, CUDA's sync-debug mode warned "
            f"{warned} times (kinds {record.get('sync_kinds', {})})")


def sync_mismatches(records: dict) -> list[str]:
    """``name: why`` for each of ``records`` (name -> a ledger's ``as_dict()``) whose flagged
    syncs differ from CUDA's sync-debug warnings (:func:`sync_mismatch`), in order."""
    return [f"{name}: {why}" for name, record in records.items()
            if (why := sync_mismatch(record)) is not None]


def format_count(n: float) -> str:
    """Counts for tables: ``1.23G``, ``45.6M``, ``7.8K``, ``12``."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}"


def count(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``fn(*args, **kwargs)`` once under a fresh ledger; its totals as plain JSON."""
    with CostLedger() as ledger:
        fn(*args, **kwargs)
    out = ledger.as_dict()
    out.pop("sections", None)
    return out


# The ledger's columns in benchmark tables: (title, key, width).
COUNT_COLUMNS = (("FLOPs", "flops", 9), ("a2a", "all_to_all_bytes", 11),
                 ("other coll", "other_collective_bytes", 11), ("h2d", "h2d_bytes", 11),
                 ("d2h", "d2h_bytes", 11), ("syncs", "syncs", 6), ("ops", "ops", 7))


def counts_header() -> str:
    """Titles of the ledger's columns, right-aligned as :func:`counts_cells` prints them."""
    return "".join(f"{title:>{width}s}" for title, _, width in COUNT_COLUMNS)


def counts_cells(counts: dict[str, Any]) -> str:
    """One table row's ledger cells: FLOPs and ops as counts, bytes in binary units."""
    cells = []
    for _, key, width in COUNT_COLUMNS:
        value = counts.get(key, 0)
        if key.endswith("_bytes"):
            text = memory.format_bytes(int(value))
        elif key == "syncs":
            text = str(int(value))
        else:
            text = format_count(value)
        cells.append(f"{text:>{width}s}")
    return "".join(cells)
