"""SCO: checkpoint boundaries offloaded to the host pool, prefetched back in backward.

``SelectiveCheckpointOffload(host_budget_bytes, prefetch=1).checkpoint(fn, *args)``
is ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` whose saved
inputs wait in host memory (see :mod:`.offload`). ``tensor_parallel_checkpoint`` gives
it Megatron's ``tensor_parallel.checkpoint`` call shape without importing Megatron.
"""

from megatron_flat.checkpoint.offload import (
    SCOStats,
    SelectiveCheckpointOffload,
    default_offload_policy,
)
from megatron_flat.checkpoint.tp_adapter import rng_tracker_context_fn, tensor_parallel_checkpoint

__all__ = [
    "SCOStats",
    "SelectiveCheckpointOffload",
    "default_offload_policy",
    "rng_tracker_context_fn",
    "tensor_parallel_checkpoint",
]
