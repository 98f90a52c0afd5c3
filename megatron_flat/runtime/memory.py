"""Exact peak accounting of live device bytes, with host-pool bytes kept apart.

``MemoryMeter`` reports the peak of live device bytes inside a ``with`` block,
relative to the bytes live at entry, and separately the peak of bytes in use
in the project's host pool (``peak_host_bytes``).

CUDA
    The caching allocator's counters are used:
    ``max_memory_allocated() - memory_allocated() at entry``. Every meter or
    section entry folds the current maximum into all open meters on that
    device before calling ``reset_peak_memory_stats``, so nesting never loses
    an outer peak. Figures are the allocator's, whose blocks are rounded up
    to 512 bytes. Limits: code outside this module that resets the peak stats
    inside a block corrupts the figure, and allocations made by other host
    threads between the fold and the reset are not attributed to outer meters.
    Pinned host memory is not in these counters, so the host pool never
    reaches the device figure.

CPU
    There is no allocator counter to read, so live tensor storage bytes are
    accounted (not RSS). A ``TorchDispatchMode`` sees every op while a CPU
    meter is open in the calling thread (autograd backward included, because
    the engine carries the mode's thread-local state). Each CPU storage it has
    not seen before is counted once, identified by the storage object (torch
    keeps one Python object per C++ storage), and a ``weakref.finalize``
    subtracts it when the C++ storage is freed. Views, in-place ops and
    storages shared by several tensors therefore count once. A storage whose
    size changed (``aten.resize_``, ``out=`` resizes, storage-level
    ``resize_``) is re-measured whenever an op touches it. At entry the
    Python heap is scanned for CPU tensors and storages, so freeing a tensor
    that existed before the block lowers the live figure.

    Limits of the CPU figure:

    * Only ops dispatched in threads that have a CPU meter (or section) open
      are seen; tensors allocated by other threads are not.
    * Scratch memory that a single kernel allocates and frees internally never
      reaches Python and is not seen; the figure counts op outputs.
    * Storages reachable only from C++ at entry (for example autograd saved
      tensors of a graph built before the block that never had a Python
      object) are not found by the scan. When an op later touches one, its
      bytes at that moment are taken as invisible: later growth or shrinkage
      is counted, but its existence and final release are not.
    * Storages created without an op (``torch.UntypedStorage(n)``,
      ``tensor.data = ...`` swaps) are seen only when an op touches them,
      with the same rule as above.
    * ``aten.lift_fresh`` (``torch.tensor``, ``torch.as_tensor``,
      ``torch.from_numpy``) counts the wrapped data as new, even when it is a
      NumPy array that existed before.
    * Tensor subclasses with their own ``__torch_dispatch__`` (fake tensors,
      wrapper subclasses) are ignored, as are meta, sparse and non-CPU
      tensors; allocations a subclass makes inside its own dispatch are not
      seen.
    * Storage-level resizes are picked up only when an op next touches the
      storage or a new meter scan runs.
    * Entering a CPU meter in a thread that has none open walks
      ``gc.get_objects()``; its cost grows with the size of the Python heap.

    Collectives: a process group's worker thread (gloo) frees a finished collective's
    tensors when it gets the CPU, which would make a figure depend on load. While a CPU
    meter is open, collectives run on shadows of their tensors (same memory, a storage
    that does not own it) and the tensors themselves are let go of at the first op after
    the collective completed (``_Collectives``), so each tensor dies where the program
    drops it: the figures are a function of the program, not of timing.

Host pool attribution
    The pool allocates its buffer inside :func:`host_allocation` and registers
    it with :func:`register_host_storage`; such storages never count as
    device bytes. The pool reports bytes taken and returned with
    :func:`note_host_bytes`, and every open meter and section keeps the peak
    of host bytes in use relative to its entry.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "MemoryMeter",
    "format_bytes",
    "SectionStats",
    "host_allocation",
    "is_host_storage",
    "note_host_bytes",
    "register_host_storage",
]

DeviceLike = Union[str, int, torch.device, None]

# The plain ``__torch_dispatch__`` every ordinary tensor (and Parameter) has;
# anything else is a subclass whose bytes, if any, live in inner tensors.
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__

# Ops whose inputs are tensors built outside the dispatcher just before.
_LIFT_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("lift_fresh", "lift_fresh_copy")
    if hasattr(torch.ops.aten, name)
)


class _Scope:
    """One open meter or section: baselines at entry and peaks since entry."""

    __slots__ = (
        "cuda_index",
        "base_device",
        "base_host",
        "peak_device",
        "peak_host",
        "low_device",
        "rise_device",
        "timeline",
        "t0",
        "open",
    )

    def __init__(
        self,
        cuda_index: Optional[int],
        base_device: int,
        base_host: int,
        timeline: Optional[list[tuple[float, int]]],
    ) -> None:
        self.cuda_index = cuda_index
        self.base_device = base_device
        self.base_host = base_host
        self.peak_device = 0
        self.peak_host = 0
        self.low_device = 0  # lowest live bytes seen, relative to entry (CPU)
        self.rise_device = 0  # largest rise above the lowest level before it (CPU)
        self.timeline = timeline
        self.t0 = time.perf_counter()
        self.open = True
        if timeline is not None:
            timeline.append((0.0, 0))

    def append_sample(self, live_rel: int) -> None:
        """Append a timeline sample, keeping times non-decreasing."""
        assert self.timeline is not None
        t = time.perf_counter() - self.t0
        # A finalizer firing in the middle of another update can append a
        # later time first; clamping keeps the series ordered.
        if self.timeline and t < self.timeline[-1][0]:
            t = self.timeline[-1][0]
        self.timeline.append((t, live_rel))


class _Record:
    """What is known about one CPU storage.

    Its contribution to the live figure is ``nbytes - base``: ``base`` is the
    part that was already there, unseen, when the storage was first observed.
    """

    __slots__ = ("nbytes", "base", "host", "finalizer")

    def __init__(self, nbytes: int, base: int, host: bool) -> None:
        self.nbytes = nbytes
        self.base = base
        self.host = host
        self.finalizer: Optional[weakref.finalize] = None

    @property
    def contribution(self) -> int:
        return 0 if self.host else self.nbytes - self.base


def _leaves(tree: Any) -> Iterator[Any]:
    """The leaves of an op's arguments or outputs. What the dispatcher hands a mode is
    tensors, scalars and None in tuples, lists and (kwargs) dicts, so this walks those
    alone: ``pytree.tree_leaves`` walked them at several times the cost, on every op."""
    if isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _leaves(item)
    else:
        yield tree


def _cpu_storage(obj: Any) -> Optional[torch.UntypedStorage]:
    """The CPU storage behind ``obj``, or None when it owns no countable bytes."""
    if isinstance(obj, torch.Tensor):
        if getattr(type(obj), "__torch_dispatch__", None) is not _PLAIN_DISPATCH:
            return None
        if obj.device.type != "cpu" or obj.layout != torch.strided:
            return None
        try:
            return obj.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
    if isinstance(obj, torch.UntypedStorage):
        return obj if obj.device.type == "cpu" else None
    return None


class _CpuMode(TorchDispatchMode):
    """Reports every op's inputs and outputs to the tracker; runs collectives so that
    their tensors are freed at a point of the program, not of a worker thread."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = _Collectives()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.collectives.settle()
        inputs: dict[int, torch.UntypedStorage] = {}
        for leaf in _leaves((args, kwargs)):
            storage = _cpu_storage(leaf)
            if storage is not None:
                inputs[id(storage)] = storage
        if func.namespace == "c10d":
            out = self.collectives.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        _TRACKER.after_op(func in _LIFT_OPS, inputs, out)
        return out


class _Collectives:
    """Collectives (``c10d`` ops) run so that no worker thread decides when a tensor dies.

    A gloo worker thread keeps a collective's tensors (and views it makes of them) until
    it drops the finished work, which may be after the caller has moved on: a tensor the
    caller has let go of then dies in the worker at a moment of the scheduler's choosing,
    and an allocation made before that moment sees it still live (a figure that depends
    on load). Each collective therefore runs on shadows of its tensors: the same memory,
    offsets and strides, through a storage that does not own that memory, so what the
    worker keeps (and frees whenever) is only the shadows. The caller's tensors are kept
    alive here until the collective is seen completed (at the next op, or when a scope
    opens or closes: for a blocking collective, before anything else runs), so the
    worker never writes into freed memory; from then on each tensor dies where the
    program drops it, as on an idle machine. (A program that drops a tensor of an
    asynchronous collective before waiting for it relies on the work to keep it alive:
    it then dies at the first op after the collective completed.)"""

    def __init__(self) -> None:
        # (works, whether each reports its completion only, the caller's tensors)
        self.pending: list[tuple[list, bool, list]] = []

    def run(self, func, args, kwargs):
        shadows: dict[int, torch.UntypedStorage] = {}
        originals: dict[int, torch.Tensor] = {}
        held: list = []

        def shadow(leaf):
            storage = _cpu_storage(leaf)
            if storage is None or storage.nbytes() == 0:
                return leaf
            if id(storage) not in shadows:
                shadows[id(storage)] = torch._C._construct_storage_from_data_pointer(
                    storage.data_ptr(), storage.device, storage.nbytes())
            twin = torch.empty(0, dtype=leaf.dtype).set_(
                shadows[id(storage)], leaf.storage_offset(), leaf.size(), leaf.stride())
            originals[id(twin)] = leaf
            held.append(leaf)
            return twin

        args, kwargs = pytree.tree_map(shadow, (args, kwargs))
        out = func(*args, **kwargs)
        if held:
            works = [leaf for leaf in pytree.tree_leaves(out)
                     if isinstance(leaf, torch.ScriptObject)]
            self.pending.append((works, func._schema.name in _POINT_TO_POINT, held))
        # the caller gets its own tensors back where the op returns its arguments
        return pytree.tree_map(lambda leaf: originals.get(id(leaf), leaf), out)

    def settle(self) -> None:
        """Let go of the tensors of every collective that has completed."""
        if self.pending:
            self.pending = [(works, p2p, held) for works, p2p, held in self.pending
                            if not all(_completed(work, p2p) for work in works)]


# Point-to-point works report their completion but have no future.
_POINT_TO_POINT = frozenset({"c10d::send", "c10d::recv_", "c10d::recv_any_source_"})


def _completed(work: Any, p2p: bool) -> bool:
    """Whether a collective's work (the op's ``ScriptObject``) is done: it says so, or
    (not a point-to-point one) it has no future to complete, which is how a backend that
    ran it in the caller's thread answers (gloo's reduce-scatter never reports
    completion)."""
    try:
        work = torch._C._distributed_c10d.Work.unbox(work)
    except (AttributeError, RuntimeError, TypeError):
        return True  # not a work handle: nothing in flight
    if work.is_completed():
        return True
    if p2p:
        return False
    try:
        work.get_future()
    except RuntimeError:
        return True
    return False


class _Tracker:
    """Process-wide state shared by all meters and sections."""

    def __init__(self) -> None:
        # Reentrant: storage finalizers can fire while this thread holds it.
        self.lock = threading.RLock()
        self.live_device = 0  # CPU bytes counted so far (absolute, arbitrary zero)
        self.live_host = 0  # bytes in use in host pools
        self.records: dict[int, _Record] = {}
        self.cpu_scopes: list[_Scope] = []
        self.cuda_scopes: list[_Scope] = []
        self.local = threading.local()

    # -- thread-local state -------------------------------------------------

    def _depth(self) -> int:
        return getattr(self.local, "depth", 0)

    def host_flag(self) -> bool:
        return getattr(self.local, "host_alloc", 0) > 0

    # -- live figures -------------------------------------------------------

    def _add_device(self, delta: int) -> None:
        """Apply a seen change of CPU live bytes and update open CPU scopes."""
        if delta == 0:
            return
        self.live_device += delta
        for scope in self.cpu_scopes:
            rel = self.live_device - scope.base_device
            if rel > scope.peak_device:
                scope.peak_device = rel
            if rel < scope.low_device:
                scope.low_device = rel
            elif rel - scope.low_device > scope.rise_device:
                scope.rise_device = rel - scope.low_device
            if scope.timeline is not None:
                scope.append_sample(rel)

    def note_host(self, delta: int) -> None:
        with self.lock:
            self.live_host += delta
            for scope in self.cpu_scopes + self.cuda_scopes:
                rel = self.live_host - scope.base_host
                if rel > scope.peak_host:
                    scope.peak_host = rel

    # -- storage records ----------------------------------------------------

    def _on_death(self, key: int, record: _Record) -> None:
        with self.lock:
            if self.records.get(key) is record:
                del self.records[key]
            self._add_device(-record.contribution)

    def _new_record(
        self, storage: torch.UntypedStorage, nbytes: int, base: int, host: bool
    ) -> _Record:
        record = _Record(nbytes, base, host)
        key = id(storage)
        finalizer = weakref.finalize(storage, self._on_death, key, record)
        # Nothing to account for at interpreter exit.
        finalizer.atexit = False
        record.finalizer = finalizer
        self.records[key] = record
        return record

    def observe(self, storage: torch.UntypedStorage, fresh: bool) -> int:
        """Bring ``storage``'s record up to date; returns the change in live bytes.

        ``fresh`` says the storage was allocated by the op just run, so all
        its bytes are new. Caller holds the lock.
        """
        nbytes = storage.nbytes()
        record = self.records.get(id(storage))
        if record is None:
            host = fresh and self.host_flag()
            base = 0 if fresh else nbytes
            record = self._new_record(storage, nbytes, base, host)
            return record.contribution
        if record.host or nbytes == record.nbytes:
            return 0
        delta = nbytes - record.nbytes
        record.nbytes = nbytes
        return delta

    def after_op(
        self,
        lifted: bool,
        inputs: dict[int, torch.UntypedStorage],
        out: Any,
    ) -> None:
        """Account for one op: resized inputs and newly allocated outputs."""
        with self.lock:
            for storage in inputs.values():
                self._add_device(self.observe(storage, fresh=lifted))
            for leaf in _leaves(out):
                storage = _cpu_storage(leaf)
                # An output sharing an input's storage (a view or in-place
                # result) was observed above: nothing new was allocated.
                if storage is None or id(storage) in inputs:
                    continue
                self._add_device(self.observe(storage, fresh=True))

    def register_host(self, storage: torch.UntypedStorage) -> None:
        with self.lock:
            record = self.records.get(id(storage))
            if record is None:
                self._new_record(storage, storage.nbytes(), 0, host=True)
                return
            if not record.host:
                # Peaks already recorded stay; from now on it is host memory.
                self._add_device(-record.contribution)
                record.host = True

    def scan(self) -> None:
        """Find CPU storages reachable from Python and refresh known sizes.

        Bytes found here were not seen by any open scope, so every open CPU
        scope's baseline moves with them: they change no relative figure.
        """
        found = 0
        with self.lock:
            for record in list(self.records.values()):
                alive = record.finalizer.peek() if record.finalizer else None
                if alive is None or record.host:
                    continue
                nbytes = alive[0].nbytes()
                found += nbytes - record.nbytes
                record.nbytes = nbytes
            # type() rather than isinstance(): some objects (lazy module
            # proxies) run code when their __class__ is read.
            wanted: dict[type, bool] = {}
            for obj in gc.get_objects():
                cls = type(obj)
                hit = wanted.get(cls)
                if hit is None:
                    hit = wanted[cls] = issubclass(cls, (torch.Tensor, torch.UntypedStorage))
                if not hit:
                    continue
                storage = _cpu_storage(obj)
                if storage is None or id(storage) in self.records:
                    continue
                found += self._new_record(storage, storage.nbytes(), 0, False).contribution
            self.live_device += found
            for scope in self.cpu_scopes:
                scope.base_device += found

    # -- scopes -------------------------------------------------------------

    def open(
        self, device: torch.device, timeline: Optional[list[tuple[float, int]]]
    ) -> _Scope:
        if device.type == "cuda":
            return self._open_cuda(_cuda_index(device), timeline)
        if self._depth() == 0:
            self.scan()
        else:
            self.local.mode.collectives.settle()
        with self.lock:
            scope = _Scope(None, self.live_device, self.live_host, timeline)
            self.cpu_scopes.append(scope)
        if self._depth() == 0:
            mode = _CpuMode()
            mode.__enter__()
            self.local.mode = mode
        self.local.depth = self._depth() + 1
        return scope

    def close(self, scope: _Scope) -> None:
        if scope.cuda_index is not None:
            self._close_cuda(scope)
            return
        self.local.mode.collectives.settle()
        self.local.depth = self._depth() - 1
        if self.local.depth == 0:
            mode = self.local.mode
            self.local.mode = None
            mode.__exit__(None, None, None)
        with self.lock:
            self.cpu_scopes.remove(scope)
            scope.open = False

    def _open_cuda(
        self, index: int, timeline: Optional[list[tuple[float, int]]]
    ) -> _Scope:
        with self.lock:
            self._fold_cuda(index)
            torch.cuda.reset_peak_memory_stats(index)
            scope = _Scope(
                index, torch.cuda.memory_allocated(index), self.live_host, timeline
            )
            self.cuda_scopes.append(scope)
            return scope

    def _close_cuda(self, scope: _Scope) -> None:
        with self.lock:
            self._fold_cuda(scope.cuda_index)  # type: ignore[arg-type]
            self.cuda_scopes.remove(scope)
            scope.open = False

    def _fold_cuda(self, index: int) -> None:
        """Move the allocator's current maximum into every open scope on ``index``."""
        high = torch.cuda.max_memory_allocated(index)
        for scope in self.cuda_scopes:
            if scope.cuda_index == index:
                scope.peak_device = max(scope.peak_device, high - scope.base_device)

    def peak_device(self, scope: _Scope) -> int:
        with self.lock:
            if scope.open and scope.cuda_index is not None:
                self._fold_cuda(scope.cuda_index)
            return scope.peak_device

    def current_device(self, scope: _Scope) -> int:
        if scope.cuda_index is not None:
            return torch.cuda.memory_allocated(scope.cuda_index) - scope.base_device
        with self.lock:
            return self.live_device - scope.base_device

    def sample(self, scope: _Scope) -> None:
        if scope.timeline is None:
            return
        with self.lock:
            scope.append_sample(self.current_device(scope))


_TRACKER = _Tracker()


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _resolve_device(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {resolved} requested but CUDA is not available")
        return torch.device("cuda", _cuda_index(resolved))
    if resolved.type != "cpu":
        raise ValueError(f"MemoryMeter supports cpu and cuda devices, got {resolved}")
    return resolved


# -- host pool hooks ------------------------------------------------------------


def note_host_bytes(delta: int) -> None:
    """Report ``delta`` bytes taken (positive) or returned (negative) in a host pool."""
    _TRACKER.note_host(int(delta))


def register_host_storage(storage: torch.UntypedStorage) -> None:
    """Exclude ``storage`` (a host pool's backing buffer) from device accounting.

    If it had already been counted as device bytes, they leave the live
    figure now; peaks recorded before stay as they are.
    """
    if not isinstance(storage, torch.UntypedStorage):
        raise TypeError(f"expected torch.UntypedStorage, got {type(storage).__name__}")
    if storage.device.type == "cpu":
        _TRACKER.register_host(storage)


def is_host_storage(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` was registered as a host pool's buffer."""
    record = _TRACKER.records.get(id(storage))
    return record is not None and record.host


@contextmanager
def host_allocation() -> Iterator[None]:
    """Storages allocated by ops in this thread inside the block are host memory.

    Used by the host pool around allocating and registering its buffer, so
    that creating a pool inside a meter never shows up as a device peak. The
    tracker's lock is held throughout: a meter entered by another thread
    cannot scan the new buffer as device bytes before it is registered.
    """
    local = _TRACKER.local
    with _TRACKER.lock:
        local.host_alloc = getattr(local, "host_alloc", 0) + 1
        try:
            yield
        finally:
            local.host_alloc -= 1


# -- public meter -----------------------------------------------------------------


@dataclass
class SectionStats:
    """Peaks of one named section, relative to the live bytes at section entry.

    Updated when the section exits; a section entered several times keeps the
    largest peak of any entry.
    """

    name: str
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    entries: int = 0


class MemoryMeter:
    """Measure the peak of live device bytes in a block, relative to its entry.

    ``device`` is None (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``
    or ``"cuda:N"``. ``peak_device_bytes`` and ``peak_host_bytes`` are
    readable during the block and final after it. With ``timeline=True``,
    ``timeline`` holds ``(seconds since entry, live device bytes relative to
    entry)`` samples: on CPU one per change, on CUDA at section boundaries
    and on :meth:`sample`. A meter is entered once.
    """

    def __init__(self, device: DeviceLike = None, timeline: bool = False) -> None:
        self.device = _resolve_device(device)
        self.timeline: list[tuple[float, int]] = []
        self.sections: dict[str, SectionStats] = {}
        self._want_timeline = bool(timeline)
        self._scope: Optional[_Scope] = None

    def __enter__(self) -> "MemoryMeter":
        if self._scope is not None:
            raise RuntimeError("a MemoryMeter can be entered only once")
        # Garbage left in reference cycles by earlier code would otherwise be freed by
        # Python's collector at some point inside the block and show as negative bytes.
        gc.collect()
        self._scope = _TRACKER.open(
            self.device, self.timeline if self._want_timeline else None
        )
        return self

    def __exit__(self, *exc: object) -> None:
        scope = self._require_scope()
        if scope.open:
            self.sample()
            _TRACKER.close(scope)

    def _require_scope(self) -> _Scope:
        if self._scope is None:
            raise RuntimeError("MemoryMeter has not been entered")
        return self._scope

    @property
    def peak_device_bytes(self) -> int:
        """Peak live device bytes above the entry level (0 before entry)."""
        return 0 if self._scope is None else _TRACKER.peak_device(self._scope)

    @property
    def peak_rise_bytes(self) -> int:
        """The largest rise of live device bytes above the lowest level seen before it.

        Equal to :attr:`peak_device_bytes` unless bytes live at entry were freed inside
        the block (leftovers of earlier work), which would otherwise hide part of a later
        peak. On CPU tracked exactly; on CUDA the allocator keeps no history, so this is
        :attr:`peak_device_bytes`.
        """
        if self._scope is None:
            return 0
        if self._scope.cuda_index is not None:
            return self.peak_device_bytes
        return max(self._scope.rise_device, self._scope.peak_device)

    @property
    def peak_host_bytes(self) -> int:
        """Peak host-pool bytes in use above the entry level (0 before entry)."""
        return 0 if self._scope is None else self._scope.peak_host

    def current_device_bytes(self) -> int:
        """Live device bytes now, relative to entry; only while the meter is open."""
        scope = self._require_scope()
        if not scope.open:
            raise RuntimeError("MemoryMeter is closed")
        return _TRACKER.current_device(scope)

    def current_host_bytes(self) -> int:
        """Host-pool bytes in use now, relative to entry; only while the meter is open."""
        scope = self._require_scope()
        if not scope.open:
            raise RuntimeError("MemoryMeter is closed")
        return _TRACKER.live_host - scope.base_host

    def sample(self) -> None:
        """Append a timeline sample now (no-op without ``timeline=True``)."""
        scope = self._require_scope()
        if scope.open:
            _TRACKER.sample(scope)

    @contextmanager
    def section(self, name: str) -> Iterator[SectionStats]:
        """Measure a named part of the block; peaks land in ``sections[name]``."""
        scope = self._require_scope()
        if not scope.open:
            raise RuntimeError("MemoryMeter is closed")
        stats = self.sections.setdefault(name, SectionStats(name))
        self.sample()
        inner = _TRACKER.open(self.device, None)
        try:
            yield stats
        finally:
            _TRACKER.close(inner)
            stats.entries += 1
            stats.peak_device_bytes = max(stats.peak_device_bytes, inner.peak_device)
            stats.peak_host_bytes = max(stats.peak_host_bytes, inner.peak_host)
            self.sample()


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units for tables (``"16.01 MiB"``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
