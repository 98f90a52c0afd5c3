"""OffloadStreamAdamW: host-resident AdamW state, updated on the device bucket by bucket.

``buckets`` plans the flat layout and buckets (pure), ``host_state`` holds the fp32 host
buffers, ``pipeline`` streams buckets through the device staging slots, and
``offload_adamw`` is the ``torch.optim.Optimizer``. Nothing here imports Megatron.
"""

from megatron_flat.optim.buckets import (
    SPLIT_ALIGN,
    STAGING_BYTES_PER_ELEMENT,
    Bucket,
    BucketPlan,
    Segment,
    coalesce,
    plan_buckets,
)
from megatron_flat.optim.offload_adamw import OffloadStreamAdamW

__all__ = [
    "SPLIT_ALIGN",
    "STAGING_BYTES_PER_ELEMENT",
    "Bucket",
    "BucketPlan",
    "OffloadStreamAdamW",
    "Segment",
    "coalesce",
    "plan_buckets",
]
