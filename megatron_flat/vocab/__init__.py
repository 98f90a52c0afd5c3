"""Ring-DTP: vocabulary projection + cross-entropy that never materialises N x V logits.

``ring_dtp_cross_entropy`` (the op, with autograd) over a ring of P ranks, each holding a
vocab shard of the output projection and its own tokens; with no group it is a blocked
single-device version. Built from a pure online log-sum-exp fold (``online_lse``), a pure
plan every rank agrees on (``plan``), the per-shard strip work (``strips``) and a
neighbour exchange (``ring``). architecture.md §2.2.
"""

from megatron_flat.vocab.cross_entropy import RingDTPCrossEntropy, ring_dtp_cross_entropy
from megatron_flat.vocab.online_lse import (
    LSEState,
    cross_entropy,
    fold,
    init_state,
    logsumexp,
    merge,
)
from megatron_flat.vocab.plan import (
    DEFAULT_BLOCK_SIZE,
    IGNORE_INDEX,
    MODES,
    RingPlan,
    resolve_mode,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "IGNORE_INDEX",
    "LSEState",
    "MODES",
    "RingDTPCrossEntropy",
    "RingPlan",
    "cross_entropy",
    "fold",
    "init_state",
    "logsumexp",
    "merge",
    "resolve_mode",
    "ring_dtp_cross_entropy",
]
