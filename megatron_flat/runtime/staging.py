"""Host-made tables to the device in one copy that never waits for the device.

A plan computed on the host reaches the device as index tables. Each ``.to(device)`` of a
pageable host tensor is a blocking copy on CUDA: the host waits until the device has drained
its queue, and the device then idles while the host launches the next kernels. A call that
needs several tables therefore packs them into one pinned staging buffer and uploads it with
``non_blocking=True``: one copy, no wait. torch's caching host allocator keeps the staging
block until the copy that reads it has run, so the next call cannot overwrite it early.

On CPU the staging buffer is ordinary memory marked as host memory for the cost ledger, so
a CPU run counts what a GPU run does (h2d bytes, no sync).
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_flat.runtime import ledger

__all__ = ["upload_together"]


def upload_together(tables: Mapping[str, torch.Tensor], device: torch.device,
                    dtype: torch.dtype = torch.long) -> dict[str, torch.Tensor]:
    """Each host tensor of ``tables`` on ``device``, as views of one buffer copied there in
    one non-blocking copy from pinned memory (shapes kept, values cast to ``dtype``).
    Empty ``tables`` give ``{}`` and copy nothing."""
    if not tables:
        return {}
    sizes = [t.numel() for t in tables.values()]
    pinned = device.type == "cuda"
    staging = torch.empty(sum(sizes), dtype=dtype, pin_memory=pinned)
    ledger.mark_host_memory(staging)
    # cat, not copy_ per table: one op, and a host-to-host fill (no copy to count)
    torch.cat([t.reshape(-1).to(dtype) for t in tables.values()], out=staging)
    on_device = staging.to(device, non_blocking=True)
    out, at = {}, 0
    for (name, t), size in zip(tables.items(), sizes):
        out[name] = on_device[at:at + size].view(t.shape)
        at += size
    return out
