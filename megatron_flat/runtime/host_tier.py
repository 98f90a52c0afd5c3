"""The host tier: every byte of host memory megatron-flat pins, in one place per process.

SCO (checkpoint boundaries) and OffloadStreamAdamW (optimizer state) each draw their host
memory from the process's :func:`tier`, under their own budget:

* **Lazy.** Nothing is allocated or pinned until a technique first needs its memory (SCO's
  first offload, the optimizer's first step), so ``install()`` — which Megatron-LM 0.19-era
  scripts call before each rank sets its CUDA device — touches no device: pinning before
  ``torch.cuda.set_device`` would create a CUDA context on GPU 0 from every rank.
* **Exact.** torch's caching host allocator rounds each pinned request up (to a power of
  two), so an 85 GiB pool would hold 128 GiB. On CUDA the tier allocates pageable memory of
  exactly the requested size and page-locks it with ``cudaHostRegister``
  (:func:`pin_exact`); it is unregistered when the buffer dies.
* **Checked against the node.** Before any allocation — and at ``install()`` for the budgets
  known then — ranks per node (``LOCAL_WORLD_SIZE``) × this rank's host bytes must fit the
  node's host memory (``--flat-host-mem-per-node-gib``, else the machine's total): one error
  that lists each technique's bytes, before anything is allocated.
* **No silent fallback.** When pinning fails the tier raises; ``--flat-host-pageable`` opts
  in to pageable memory instead (with one warning: every copy from it is synchronous).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Dict, Optional

import torch

from megatron_flat.runtime import memory
from megatron_flat.runtime.host_pool import HostPool

__all__ = ["HostTier", "HostTierError", "LazyHostPool", "caching_allocator_bytes", "configure",
           "node_memory_bytes", "pin_exact", "ranks_per_node", "tier"]

GIB = 1 << 30


class HostTierError(RuntimeError):
    """Host memory cannot be provided as configured (node budget exceeded, pinning failed)."""


# ---------------------------------------------------------------------------- the machine
def node_memory_bytes() -> int:
    """Total host memory of this machine (``MemTotal``), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ranks_per_node() -> int:
    """Processes sharing this machine's host memory (torchrun's ``LOCAL_WORLD_SIZE``)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def caching_allocator_bytes(nbytes: int) -> int:
    """What ``torch.empty(nbytes, pin_memory=True)`` takes from torch's caching host allocator:
    the request rounded up to a power of two. Read from torch 2.13's
    ``ATen/core/CachingHostAllocator.h`` (``PowerOf2Ceil`` for every size up to
    ``pinned_max_round_threshold``, unlimited unless ``PYTORCH_CUDA_ALLOC_CONF`` sets it);
    ``benchmarks/gpu_host_tier.py`` measures it on a GPU."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


# ---------------------------------------------------------------------------- exact pinning
def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process's memory goes anyway
        pass


def pin_exact(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory as a uint8 tensor, page-locked at exactly that size on CUDA
    (pageable ``torch.empty`` + ``cudaHostRegister``; unregistered when the tensor's storage
    dies). Without CUDA: ordinary memory. Raises :class:`HostTierError` if pinning fails."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0 or not torch.cuda.is_available():
        return buffer
    ptr = buffer.data_ptr()
    try:
        status = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    except Exception as exc:  # no cudart binding, driver refused
        raise HostTierError(f"pinning {nbytes:,} bytes of host memory failed: {exc}") from exc
    code = getattr(status, "value", status)
    if code not in (0, None):
        raise HostTierError(f"pinning {nbytes:,} bytes of host memory failed: cudaHostRegister "
                            f"returned {status} (too much page-locked memory? check "
                            "'ulimit -l' and the node's other pinned users)")
    weakref.finalize(buffer.untyped_storage(), _unregister, ptr)
    return buffer


# ---------------------------------------------------------------------------- the tier
class HostTier:
    """This process's host memory for megatron-flat, by technique (see the module doc).

    ``node_budget_bytes``: the node's host memory available to megatron-flat (None: the
    machine's total); ``allow_pageable``: fall back to pageable memory when pinning fails
    (else raise); ``local_ranks``: processes per node (None: from the environment).
    """

    def __init__(self, *, node_budget_bytes: Optional[int] = None, allow_pageable: bool = False,
                 local_ranks: Optional[int] = None) -> None:
        self.node_budget_bytes = node_budget_bytes
        self.allow_pageable = allow_pageable
        self.local_ranks = local_ranks
        self._declared: Dict[str, int] = {}
        self._allocated: Dict[str, int] = {}
        self._pinned: Dict[str, int] = {}
        self._buffers: Dict[int, tuple] = {}  # live buffers: key -> (technique, bytes)
        self._next_key = 0
        # Reentrant: a buffer's finalizer (``_freed``) takes it, and Python's collector may
        # run one in this thread while it is held (freeing an earlier buffer left in a
        # reference cycle during the next allocation), which deadlocked with a plain Lock.
        self._lock = threading.RLock()
        self._warned = False

    # -- accounting --
    @property
    def allocated_bytes(self) -> Dict[str, int]:
        """Host bytes held now, by technique (a buffer stops counting when it dies)."""
        return dict(self._allocated)

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now (exact: what the tier asked the driver for)."""
        return sum(self._pinned.values())

    def report(self) -> dict:
        """What this rank holds and what the node holds, for benchmarks and logs:
        ``allocated_bytes`` (by technique), ``allocated_total_bytes``, ``pinned_bytes``
        (exact), ``buffers`` (live buffer count), ``ranks_per_node``, ``per_node_bytes``
        (ranks per node x this rank's bytes), ``node_budget_bytes`` and
        ``caching_allocator_bytes`` (what ``pin_memory=True`` would hold for the same
        buffers, see :func:`caching_allocator_bytes`)."""
        with self._lock:
            allocated = dict(self._allocated)
            sizes = [n for _, n in self._buffers.values()]
            pinned = sum(self._pinned.values())
        total = sum(allocated.values())
        ranks = self._ranks()
        return {"allocated_bytes": allocated, "allocated_total_bytes": total,
                "pinned_bytes": pinned, "buffers": len(sizes), "ranks_per_node": ranks,
                "per_node_bytes": ranks * total, "node_budget_bytes": self._node_budget(),
                "caching_allocator_bytes": sum(caching_allocator_bytes(n) for n in sizes)}

    def _node_budget(self) -> int:
        return self.node_budget_bytes if self.node_budget_bytes else node_memory_bytes()

    def _ranks(self) -> int:
        return self.local_ranks or ranks_per_node()

    def _check(self, planned: Dict[str, int]) -> None:
        per_rank = sum(planned.values())
        ranks = self._ranks()
        budget = self._node_budget()
        if per_rank * ranks <= budget:
            return
        parts = ", ".join(f"{name} {n / GIB:.2f} GiB" for name, n in sorted(planned.items()))
        source = ("--flat-host-mem-per-node-gib" if self.node_budget_bytes
                  else "this machine's MemTotal")
        raise HostTierError(
            f"megatron-flat's host memory does not fit the node: {ranks} rank(s) per node x "
            f"{per_rank / GIB:.2f} GiB per rank ({parts}) = {per_rank * ranks / GIB:.2f} GiB > "
            f"{budget / GIB:.2f} GiB ({source}). Lower --flat-sco-host-budget-gib or turn a "
            "technique off, or give the node's real budget with --flat-host-mem-per-node-gib")

    def declare(self, technique: str, nbytes: int) -> None:
        """Announce ``technique``'s host budget (nothing is allocated) and check the node now,
        so a budget that cannot fit fails before any model or collective exists."""
        with self._lock:
            declared = {**self._declared, technique: int(nbytes)}
            self._check(self._planned(declared=declared))
            self._declared = declared  # only a budget that fits is recorded

    def _planned(self, extra: Optional[Dict[str, int]] = None,
                 declared: Optional[Dict[str, int]] = None) -> Dict[str, int]:
        planned = dict(self._declared if declared is None else declared)
        for name, n in self._allocated.items():
            planned[name] = max(planned.get(name, 0), n)
        for name, n in (extra or {}).items():
            planned[name] = max(planned.get(name, 0), self._allocated.get(name, 0) + n)
        return planned

    # -- allocation --
    def buffer(self, technique: str, nbytes: int) -> torch.Tensor:
        """``nbytes`` for ``technique``: checked against the node, pinned exactly on CUDA."""
        with self._lock:
            self._check(self._planned({technique: nbytes}))
            try:
                # Inside host_allocation: an open memory meter sees host bytes, not device.
                with memory.host_allocation():
                    buffer = pin_exact(nbytes)
                pinned = bool(nbytes) and torch.cuda.is_available()
            except HostTierError:
                if not self.allow_pageable:
                    raise
                if not self._warned:
                    warnings.warn(f"megatron-flat: pinning host memory for {technique} failed; "
                                  "using pageable memory (--flat-host-pageable): every copy "
                                  "from it is synchronous", RuntimeWarning, stacklevel=2)
                    self._warned = True
                with memory.host_allocation():
                    buffer = torch.empty(nbytes, dtype=torch.uint8)
                pinned = False
            self._count(self._allocated, technique, nbytes)
            if pinned:
                self._count(self._pinned, technique, nbytes)
            key, self._next_key = self._next_key, self._next_key + 1
            self._buffers[key] = (technique, nbytes)
            # A buffer that dies (an optimizer re-planned, a pool dropped) stops counting, so
            # the node check sees what is held now, not everything ever allocated.
            weakref.finalize(buffer.untyped_storage(), self._freed, technique, nbytes, pinned,
                             key)
            return buffer

    @staticmethod
    def _count(counts: Dict[str, int], technique: str, nbytes: int) -> None:
        left = counts.get(technique, 0) + nbytes
        if left:
            counts[technique] = left
        else:
            counts.pop(technique, None)

    def _freed(self, technique: str, nbytes: int, pinned: bool, key: int = -1) -> None:
        with self._lock:
            self._buffers.pop(key, None)
            self._count(self._allocated, technique, -nbytes)
            if pinned:
                self._count(self._pinned, technique, -nbytes)

    def pool(self, technique: str, nbytes: int, alignment: int = 512) -> HostPool:
        """A :class:`HostPool` of exactly ``nbytes`` for ``technique``, allocated now."""
        return HostPool(nbytes, alignment=alignment, buffer=self.buffer(technique, nbytes))

    def lazy_pool(self, technique: str, nbytes: int, alignment: int = 512) -> "LazyHostPool":
        """A pool of ``nbytes`` for ``technique`` allocated at its first ``acquire`` (declared
        now, so the node check runs now)."""
        self.declare(technique, nbytes)
        return LazyHostPool(lambda: self.pool(technique, nbytes, alignment), nbytes, alignment)


class LazyHostPool:
    """A :class:`HostPool` created at its first :meth:`acquire`; before that it holds no
    memory and reports an empty pool of its capacity."""

    def __init__(self, create, capacity_bytes: int, alignment: int = 512) -> None:
        self._create = create
        self._pool: Optional[HostPool] = None
        self._capacity = capacity_bytes
        self._alignment = alignment
        self._lock = threading.Lock()

    @property
    def allocated(self) -> bool:
        return self._pool is not None

    def _real(self) -> HostPool:
        with self._lock:
            if self._pool is None:
                self._pool = self._create()
            return self._pool

    def acquire(self, shape, dtype):
        return self._real().acquire(shape, dtype)

    def release(self, tensor: torch.Tensor) -> None:
        if self._pool is None:
            raise ValueError("tensor was not acquired from this pool")
        self._pool.release(tensor)

    def stats(self) -> dict:
        if self._pool is not None:
            return self._pool.stats()
        return {"capacity_bytes": self._capacity, "used_bytes": 0, "peak_used_bytes": 0,
                "free_bytes": self._capacity, "acquires": 0, "releases": 0,
                "failed_acquires": 0, "largest_free_block": self._capacity, "live_blocks": 0}

    def __getattr__(self, name):
        # capacity_bytes, used_bytes, pinned, ...: the real pool's (allocated on demand).
        if name.startswith("_"):
            raise AttributeError(name)
        if self._pool is None and name in ("capacity_bytes", "free_bytes"):
            return self._capacity
        if self._pool is None and name in ("used_bytes", "peak_used_bytes"):
            return 0
        if self._pool is None and name == "alignment":
            return self._alignment
        return getattr(self._real(), name)


_TIER: Optional[HostTier] = None
_TIER_LOCK = threading.Lock()


def tier() -> HostTier:
    """This process's host tier (created with defaults on first use)."""
    global _TIER
    with _TIER_LOCK:
        if _TIER is None:
            _TIER = HostTier()
        return _TIER


def configure(*, node_budget_bytes: Optional[int] = None, allow_pageable: bool = False,
              local_ranks: Optional[int] = None) -> HostTier:
    """Replace this process's host tier (``install()`` calls this; nothing is allocated)."""
    global _TIER
    with _TIER_LOCK:
        _TIER = HostTier(node_budget_bytes=node_budget_bytes, allow_pageable=allow_pageable,
                         local_ranks=local_ranks)
        return _TIER
