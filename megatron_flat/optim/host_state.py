"""Host-resident fp32 state of OffloadStreamAdamW: flat buffers carved from a HostPool.

Three flat fp32 buffers follow a :class:`~megatron_flat.optim.buckets.BucketPlan`'s flat
layout: ``exp_avg`` and ``exp_avg_sq`` over the whole layout, ``master`` over the span
from the first to the last low-precision parameter (fp32 parameters are their own
master, so they need none). Each comes from the host pool (pinned when CUDA is there);
when the pool has no room the buffer is ordinary pageable memory instead — slower to
copy, never wrong — and the caller is told which buffers fell back so it can warn once.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from megatron_flat.runtime import HostPool

__all__ = ["HostState", "host_bytes_needed"]

_F32 = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def host_bytes_needed(buffer_numels: list[int], alignment: int = 512) -> int:
    """Pool bytes that hold fp32 buffers of these sizes (each block rounded to ``alignment``)."""
    return sum(_round_up(n * _F32, alignment) for n in buffer_numels)


def _release(pool: HostPool, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        pool.release(t)


class HostState:
    """The flat host buffers; ``fallbacks`` names those that are not from the pool.

    ``pool=None`` takes a pool sized exactly for the buffers from the host tier (pinned
    when CUDA is available; a failed pinning raises unless the tier allows pageable
    memory). Blocks taken from a shared pool go back to it when this object is garbage
    collected.
    """

    def __init__(
        self,
        flat_numel: int,
        master_numel: int,
        pool: Optional[HostPool] = None,
    ) -> None:
        sizes = {"exp_avg": flat_numel, "exp_avg_sq": flat_numel}
        if master_numel:
            sizes["master"] = master_numel
        self.fallbacks: list[str] = []
        if pool is None:
            pool = _private_pool(host_bytes_needed(list(sizes.values())), self.fallbacks)
        self.pool = pool
        taken: list[torch.Tensor] = []
        buffers: dict[str, torch.Tensor] = {}
        for name, numel in sizes.items():
            block = pool.acquire((numel,), torch.float32)
            if block is None:
                block = torch.empty(numel, dtype=torch.float32)
                self.fallbacks.append(name)
            elif numel:
                taken.append(block)
            buffers[name] = block
        self.exp_avg: torch.Tensor = buffers["exp_avg"]
        self.exp_avg_sq: torch.Tensor = buffers["exp_avg_sq"]
        self.master: Optional[torch.Tensor] = buffers.get("master")
        self.pinned = {
            name: name not in self.fallbacks and pool.pinned for name in buffers
        }
        self.nbytes = sum(t.numel() * _F32 for t in buffers.values())
        self._finalizer = weakref.finalize(self, _release, pool, taken)

    def release(self) -> None:
        """Give the pool blocks back now (the buffers must not be used afterwards)."""
        self._finalizer()


def _private_pool(nbytes: int, fallbacks: list[str]) -> HostPool:
    """A pool of exactly ``nbytes`` from the process's host tier (checked against the node,
    pinned exactly on CUDA). A failed pinning raises, unless the tier allows pageable memory
    (``--flat-host-pageable``): then the pool is pageable and ``fallbacks`` says so."""
    from megatron_flat.runtime import host_tier

    pool = host_tier.tier().pool("optimizer", nbytes)
    if nbytes and torch.cuda.is_available() and not pool.pinned:
        fallbacks.append("pinning")
    return pool
