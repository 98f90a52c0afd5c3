"""The sixth term: model state with param offload (``--flat-param-offload``), per device.

Without it, every layer's weights (b bytes per parameter) and gradient buffer (4 B, Megatron's
fp32 ``main_grad``) sit on the device for the whole step. With it, the routed experts' state
of every MoE layer on the stage moves to the host tier and the device keeps two weight slots
and two gradient slots of one layer's experts (``params.plan.ParamOffloadPlan``: the layer in
use and the next one in flight), whatever the depth::

    P_e   routed-expert parameters on this device (E_l experts in each of the stage's MoE layers)
    P_l   = E_l · expert params: one MoE layer's share (the slot size)

    device weights   = b·P_dense + 2·b·P_l
    device grads     = g·P_dense + 2·4·P_l          (g: the dense grad buffer's bytes)
    host tier        = (b + 4)·P_e                  every layer's weights and fp32 gradients

The experts' sub-optimizer (``ParamOffloadOptimizer``) shards their fp32 state as Megatron's
distributed optimizer would (``megatron.param_offload_shards``): with it, each of the
s_e = TP·CP·DP/EP expert-data-parallel replicas keeps and steps P_o = ⌈P_e / s_e⌉ of them,
then all-gathers the updated weights; without it, every replica steps every local expert
(P_o = P_e). It stages its fp32 gradients through OffloadStreamAdamW's slots beside master,
m and v, and the all-gather through the device in rounds of ``GATHER_CHUNK_NUMEL`` per rank::

    host optimizer   = 12·P_o (b < 4: master, m, v) or 8·P_o (fp32: m, v; the weight is its
                       own master)
    device staging   = slots · min(bucket, P_o) · 16
                       + (1 + s_e) · min(chunk, P_o) · b       (the all-gather, s_e > 1)

Per microbatch over PCIe (an upper bound, the runtime's ``ParamOffloadPlan.microbatch_bytes``
after the first microbatch): every layer's weights up twice (forward; recompute and backward
share one fetch), the running gradient sum up once, each fp32 gradient down once::

    h2d = (2·b + 4)·P_e        d2h = 4·P_e

The per-tensor 512 B alignment of the host and slot ranges is left out (under 1 KiB a tensor).
Param offload needs EP > 1 (at EP 1 Megatron puts the experts in the dense optimizer, which
``install`` refuses), PipelinedLLEP or LLEP and OffloadStreamAdamW (``FlatConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_flat.plan.model import Layout, ModelSpec

__all__ = ["GATHER_CHUNK_NUMEL", "GRAD_BYTES", "SLOTS", "STAGING_BYTES_PER_PARAM",
           "ParamOffloadTerm", "applies", "term"]

SLOTS = 2  # weight slots and gradient slots on the device (one in use, the next in flight)
GRAD_BYTES = 4  # the offloaded experts' main_grad is fp32 whatever the weights' dtype
# The experts' staging: master, m, v and the fp32 gradient fetched from the host tier.
STAGING_BYTES_PER_PARAM = 16
# Elements per rank in one round of the updated weights' all-gather (the runtime's
# megatron.param_offload_shards.GATHER_CHUNK_NUMEL; tests/plan checks they agree).
GATHER_CHUNK_NUMEL = 1 << 20


def applies(layout: Layout, model: Optional[ModelSpec] = None) -> Optional[str]:
    """None when param offload can run on ``layout``; else why not (what ``install``
    refuses)."""
    if layout.ep <= 1:
        return ("needs expert parallelism (EP > 1): at EP 1 Megatron steps the routed experts "
                "in the dense optimizer")
    if model is not None and not model.experts:
        return "the model has no routed experts"
    return None


@dataclass(frozen=True)
class ParamOffloadTerm:
    """One stage's routed-expert state under param offload (module docstring)."""

    expert_params: int      # P_e
    slot_params: int        # P_l
    bytes_per_value: int    # b
    replicas: int = 1       # s_e when the distributed optimizer shards the state, else 1

    @property
    def optimizer_params(self) -> int:
        """P_o: the experts' parameters whose fp32 state this replica keeps and steps."""
        return math.ceil(self.expert_params / self.replicas)

    @property
    def device_weights(self) -> int:
        return SLOTS * self.bytes_per_value * self.slot_params

    @property
    def device_grads(self) -> int:
        return SLOTS * GRAD_BYTES * self.slot_params

    @property
    def host_bytes(self) -> int:
        """The host tier's weights and fp32 gradients of every offloaded layer."""
        return (self.bytes_per_value + GRAD_BYTES) * self.expert_params

    @property
    def optimizer_host(self) -> int:
        per = 12 if self.bytes_per_value < 4 else 8
        return per * self.optimizer_params

    def staging(self, num_slots: int, bucket_numel: int) -> int:
        slots = num_slots * STAGING_BYTES_PER_PARAM * min(bucket_numel, self.optimizer_params)
        if self.replicas == 1:
            return slots
        return slots + (1 + self.replicas) * min(GATHER_CHUNK_NUMEL, self.optimizer_params) \
            * self.bytes_per_value

    @property
    def resident_bytes(self) -> int:
        """What the same experts hold on the device without param offload (weights and
        fp32 gradients; their optimizer state is counted apart)."""
        return (self.bytes_per_value + GRAD_BYTES) * self.expert_params

    def microbatch_bytes(self) -> tuple:
        """(h2d, d2h) bytes of one microbatch (the upper bound in the module docstring)."""
        b = self.bytes_per_value
        return (2 * b + GRAD_BYTES) * self.expert_params, GRAD_BYTES * self.expert_params


def term(model: ModelSpec, layout: Layout, expert_params: int) -> Optional[ParamOffloadTerm]:
    """The stage's term for its ``expert_params`` routed-expert parameters (None where the
    stage holds none: no MoE layer on it)."""
    if not expert_params:
        return None
    slot = (model.experts // layout.ep) * model.expert_params()
    return ParamOffloadTerm(expert_params=expert_params, slot_params=slot,
                            bytes_per_value=model.bytes_per_value,
                            replicas=layout.expert_dp if layout.distributed_optimizer else 1)
