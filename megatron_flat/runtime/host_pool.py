"""A fixed host budget carved into tensor views of one preallocated buffer.

Pinning host memory is slow and fragments the pinned allocator, so the pool
pins ONE buffer of ``budget_bytes`` up front and hands out views of it.
Running out is an ordinary outcome: :meth:`HostPool.acquire` returns None and
the caller falls back (keeps the tensor on device, uses pageable memory...).

Bytes in use are reported to :mod:`megatron_flat.runtime.memory`, so open
meters see them as ``peak_host_bytes`` and never as device bytes.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from typing import Optional, Sequence, Union

import torch

from megatron_flat.runtime import memory

__all__ = ["HostPool"]

ShapeLike = Union[int, Sequence[int], torch.Size]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _FreeList:
    """First-fit allocator over ``[0, capacity)`` with coalescing; not thread-safe.

    Free blocks are kept sorted by offset in two parallel lists so that a
    released block finds its neighbours by bisection.
    """

    def __init__(self, capacity: int) -> None:
        self.starts: list[int] = [0] if capacity else []
        self.sizes: list[int] = [capacity] if capacity else []
        self.used = 0

    def take(self, size: int, align: int) -> Optional[int]:
        """Reserve ``size`` bytes at an ``align``-multiple offset; None if no block fits."""
        for i, (start, length) in enumerate(zip(self.starts, self.sizes)):
            offset = _round_up(start, align)
            pad = offset - start
            if pad + size > length:
                continue
            rest = length - pad - size
            starts: list[int] = []
            sizes: list[int] = []
            if pad:
                starts.append(start)
                sizes.append(pad)
            if rest:
                starts.append(offset + size)
                sizes.append(rest)
            self.starts[i : i + 1] = starts
            self.sizes[i : i + 1] = sizes
            self.used += size
            return offset
        return None

    def give(self, offset: int, size: int) -> None:
        """Return a reserved block, merging it with adjacent free blocks."""
        self.used -= size
        i = bisect.bisect_left(self.starts, offset)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == offset:
            i -= 1
            offset = self.starts[i]
            size += self.sizes[i]
            del self.starts[i], self.sizes[i]
        if i < len(self.starts) and offset + size == self.starts[i]:
            size += self.sizes[i]
            del self.starts[i], self.sizes[i]
        self.starts.insert(i, offset)
        self.sizes.insert(i, size)

    def largest(self) -> int:
        return max(self.sizes, default=0)


def _return_host_bytes(free_list: _FreeList) -> None:
    """On pool death, bytes still handed out stop counting as host bytes in use."""
    if free_list.used:
        memory.note_host_bytes(-free_list.used)


def _is_pinned(tensor: torch.Tensor) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return False


def _normalize_shape(shape: ShapeLike) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"shape must hold non-negative ints, got {shape!r}")
    return dims


class HostPool:
    """Host budget of ``budget_bytes`` handed out as tensor views; thread-safe.

    The buffer is pinned when CUDA is available and ``pin_memory`` is not
    False; otherwise it is ordinary memory. Offsets are multiples of
    ``alignment`` (a power of two) and of the dtype's item size, relative to
    the buffer start, and each block reserves its byte size rounded up to
    ``alignment``; ``used_bytes`` counts reserved bytes. Acquired tensors are
    uninitialised and stay valid until released; after release the bytes may
    be handed out again, so the caller must make sure no pending copy still
    reads or writes them.
    """

    def __init__(
        self,
        budget_bytes: int,
        pin_memory: Optional[bool] = None,
        alignment: int = 512,
        *,
        buffer: Optional[torch.Tensor] = None,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be None or a bool, got {pin_memory!r}")
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment < 1
            or alignment & (alignment - 1)
        ):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        self._alignment = alignment
        if buffer is not None:
            # Memory someone else allocated (the host tier pins it at its exact size).
            if (buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.device.type != "cpu"
                    or buffer.numel() != budget_bytes or pin_memory is not None):
                raise ValueError("buffer must be a 1-D uint8 CPU tensor of budget_bytes "
                                 "elements (and pin_memory left None)")
            self._pinned = bool(budget_bytes) and _is_pinned(buffer)
            self._buffer = buffer
            self._storage = buffer.untyped_storage()
            memory.register_host_storage(self._storage)
        else:
            # Pinning zero bytes buys nothing.
            self._pinned = bool(
                budget_bytes and pin_memory is not False and torch.cuda.is_available()
            )
            with memory.host_allocation():
                self._buffer = torch.empty(
                    budget_bytes, dtype=torch.uint8, pin_memory=self._pinned
                )
                self._storage = self._buffer.untyped_storage()
                memory.register_host_storage(self._storage)
        self._base = self._buffer.data_ptr()
        self._lock = threading.Lock()
        self._free = _FreeList(budget_bytes)
        self._live: dict[int, int] = {}  # offset -> reserved bytes
        self._peak = 0
        self._acquires = 0
        self._releases = 0
        self._failed = 0
        finalizer = weakref.finalize(self, _return_host_bytes, self._free)
        finalizer.atexit = False

    # -- properties ---------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._buffer.numel()

    @property
    def used_bytes(self) -> int:
        return self._free.used

    @property
    def peak_used_bytes(self) -> int:
        return self._peak

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._free.used

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def pinned(self) -> bool:
        return self._pinned

    def stats(self) -> dict[str, int]:
        """Snapshot of the counters, taken atomically."""
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self._free.used,
                "peak_used_bytes": self._peak,
                "free_bytes": self.capacity_bytes - self._free.used,
                "acquires": self._acquires,
                "releases": self._releases,
                "failed_acquires": self._failed,
                "largest_free_block": self._free.largest(),
                "live_blocks": len(self._live),
            }

    # -- acquire / release --------------------------------------------------

    def acquire(self, shape: ShapeLike, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A view of the buffer with ``shape`` and ``dtype``, or None if no block fits.

        Never raises for exhaustion. A zero-byte request returns an empty
        tensor on the pool's storage; releasing it is accepted and does
        nothing.
        """
        dims = _normalize_shape(shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        itemsize = dtype.itemsize
        nbytes = math.prod(dims) * itemsize
        if nbytes == 0:
            with self._lock:
                self._acquires += 1
            return self._buffer.narrow(0, 0, 0).view(dtype).view(dims)
        size = _round_up(nbytes, self._alignment)
        with self._lock:
            offset = self._free.take(size, max(self._alignment, itemsize))
            if offset is None:
                self._failed += 1
                return None
            self._live[offset] = size
            self._acquires += 1
            self._peak = max(self._peak, self._free.used)
        # Reported outside the pool lock: garbage collection running while
        # the tracker holds its lock may call release() on this pool, so
        # holding both locks at once could deadlock two threads.
        memory.note_host_bytes(size)
        return self._buffer.narrow(0, offset, nbytes).view(dtype).view(dims)

    def release(self, tensor: torch.Tensor) -> None:
        """Give back a tensor returned by :meth:`acquire` (or a view starting at it).

        Raises ValueError for a tensor that is not from this pool or whose
        block is not currently acquired (double release).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError) as exc:
            raise ValueError("tensor was not acquired from this pool") from exc
        # One Python object per C++ storage, so identity means same buffer.
        if storage is not self._storage:
            raise ValueError("tensor was not acquired from this pool")
        if tensor.numel() == 0:
            with self._lock:
                self._releases += 1
            return
        offset = tensor.data_ptr() - self._base
        with self._lock:
            size = self._live.pop(offset, None)
            if size is None:
                raise ValueError(
                    f"no acquired block starts at offset {offset}: "
                    "double release, or a view that does not start at an acquired tensor"
                )
            self._free.give(offset, size)
            self._releases += 1
        memory.note_host_bytes(-size)

    def __repr__(self) -> str:
        return (
            f"HostPool(capacity_bytes={self.capacity_bytes}, used_bytes={self.used_bytes}, "
            f"alignment={self._alignment}, pinned={self._pinned})"
        )
