"""PipelinedLLEP: least-loaded, chunk-capped MoE dispatch (DESIGN.md §2.1).

``plan`` holds the pure planning API (LLEP plan, chunk counts and membership, route
destinations, send matrices); ``profiles`` the synthetic routings used by benchmarks.
"""

from megatron_flat.dispatch.plan import (
    MEMBERSHIPS,
    LLEPPlan,
    chunk_indices,
    imbalance,
    llep_capacity,
    llep_plan,
    native_rank_loads,
    num_chunks,
    plain_ep_plan,
    plan_dispatch,
    receive_bound,
    route_destinations,
    send_counts,
    send_matrix,
    use_llep,
)
from megatron_flat.dispatch.profiles import routing_profile

__all__ = [
    "MEMBERSHIPS",
    "LLEPPlan",
    "chunk_indices",
    "imbalance",
    "llep_capacity",
    "llep_plan",
    "native_rank_loads",
    "num_chunks",
    "plain_ep_plan",
    "plan_dispatch",
    "receive_bound",
    "route_destinations",
    "routing_profile",
    "send_counts",
    "send_matrix",
    "use_llep",
]
