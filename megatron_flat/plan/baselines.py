"""The baselines megatron-flat is compared with: what a user runs at this scale without it.

Each baseline changes only the *model-state* terms of the peak model (weights, gradients,
optimizer state: where they live) and, for FSDP2, what the vocabulary projection gathers;
dispatch, boundaries and the other activations are stock Megatron's for all three (no
dispatch chunking, full per-layer recompute keeping each layer's input, dense vocabulary
cross-entropy). Symbols as in ``peaks.py``; ``P`` parameters on this device (its TP/EP/PP
share), ``P_s`` its optimizer shard (the distributed optimizer's, or FSDP's: dense over
DP·CP, experts over TP·CP·DP/EP), ``b`` bytes per weight, ``P_u`` the parameters of the
largest layer on this device, ``V/TP·H`` the output layer's shard.

``megatron`` — stock Megatron-Core (distributed optimizer, fp32 grad buffer, mixed precision)::

    device   W + G + O = b·P + 4·P + 12·P_s     (8·P_s for fp32 models: m, v)
    host     0

``megatron-cpu-offload`` — Megatron-LM's ``--optimizer-cpu-offload
--optimizer-offload-fraction 1.0`` (with ``--use-precision-aware-optimizer``, which Megatron
asserts, and so the distributed optimizer): ``HybridDeviceOptimizer`` keeps the fp32 master and
both moments on the host and runs torch's AdamW there, after copying each gradient down::

    device   W + G = b·P + 4·P                  no optimizer state, no master on the device
    host     12·P_s   fp32 master (pageable: a CPU ``.float()`` copy), m and v (torch's CPU
                      AdamW, pageable)
           + Σ_t R(4·n_t/s_t)   each parameter's fp32 gradient copy, pinned through torch's
                      caching host allocator (``pin_cpu_grads``), which rounds every tensor up
                      to a power of two (R; see ``runtime.host_tier.caching_allocator_bytes``):
                      n_t elements of tensor t, s_t its shard factor (P_s/P per kind)

``fsdp2-offload`` — PyTorch FSDP2 (``fully_shard`` per layer, ``CPUOffloadPolicy(pin_memory=
True)``, bf16 parameters with fp32 gradient reduction, one layer prefetched), full activation
recompute, dense vocabulary cross-entropy, no dispatch chunking; TP, CP and EP as the layout
gives them (as torchtitan composes them)::

    device   2·b·P_u + 4·P_u    the current and the prefetched layer gathered, the current
                                layer's unsharded fp32 gradient before its reduce-scatter
    vocab    + (b + 4)·V/TP·H   the output layer gathered for the projection, and its gradient
    host     Σ_t 2·R(4·n_t/s_t) fp32 sharded parameters and gradients, pinned (per tensor,
                                rounded as above)
           + 8·P_s              m and v (torch's CPU AdamW, pageable)

``megatron-offload`` — Megatron-Core's fine-grained activation offloading with selective
recompute and ``--optimizer-cpu-offload``: the model state of ``megatron-cpu-offload``, its
activations in ``plan.recipes``.

``fsdp2-cp`` — the PyTorch-native long-context recipe (TRL, torchtitan, ALST): its model
state and its activations are in ``plan.recipes`` (with ``params_on_host``, the state of
``fsdp2-offload`` above, its output layer gathered by the chunked loss instead).

A baseline "fits" when its device total is within the usable device memory and its host bytes
times the node's GPUs within the node's host memory (less the margin), as for megatron-flat.
``allowed(name, layout)`` says when the layout cannot run a baseline (the CPU offload needs the
distributed optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from megatron_flat.plan.model import Layout, ModelSpec, PlanError

__all__ = ["BASELINES", "DESCRIPTIONS", "RECIPE_BASELINES", "PAPER_BASELINE", "PAPER_LABEL",
           "ModelState", "allowed", "caching_host_bytes", "check_name", "model_state",
           "paper_layout", "param_tensors", "pinned_bytes"]

BASELINES = ("megatron", "megatron-cpu-offload", "megatron-offload", "fsdp2-offload",
             "fsdp2-cp")
# The baselines whose activations are not stock Megatron's (``plan.recipes``).
RECIPE_BASELINES = ("megatron-offload", "fsdp2-cp")
DESCRIPTIONS = {
    "megatron": "stock Megatron-Core: optimizer state on the GPU",
    "megatron-cpu-offload": "Megatron's --optimizer-cpu-offload (HybridDeviceOptimizer): fp32 "
                            "master and moments on the host, AdamW on the CPU",
    "fsdp2-offload": "FSDP2 with CPU offload: parameters, gradients and optimizer state "
                     "sharded on the host, gathered per layer; full recompute, dense "
                     "cross-entropy, no dispatch chunking",
    "megatron-offload": "Megatron-Core's fine-grained activation offloading (every module's "
                        "saved tensors on the host, selective recompute) with "
                        "--optimizer-cpu-offload",
    "fsdp2-cp": "the PyTorch long-context recipe (TRL, torchtitan, ALST): FSDP2 with CPU "
                "offload, context parallelism, each layer's checkpointed input on the host, "
                "TRL's chunked NLL loss, ALST's tiled MLP; experts unchunked",
}

ADAM_BYTES_PER_PARAM = 12       # fp32 master + m + v
ADAM_BYTES_PER_PARAM_FP32 = 8   # m + v: an fp32 parameter is its own master
MOMENT_BYTES_PER_PARAM = 8      # m + v
FP32 = 4


def check_name(name: str) -> str:
    if name not in BASELINES:
        raise PlanError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    return name


def allowed(name: str, layout: Layout) -> Optional[str]:
    """Why ``layout`` cannot run baseline ``name`` (None: it can)."""
    check_name(name)
    if name in ("megatron-cpu-offload", "megatron-offload") and \
            not layout.distributed_optimizer:
        return ("--optimizer-cpu-offload needs --use-precision-aware-optimizer, which needs "
                "the distributed optimizer")
    return None


def caching_host_bytes(nbytes: int) -> int:
    """What a pinned allocation of ``nbytes`` takes from torch's caching host allocator: the
    request rounded up to a power of two (the rule of ``runtime.host_tier``'s
    ``caching_allocator_bytes``, kept here so that planning imports no torch)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def param_tensors(model: ModelSpec, layout: Layout, first: int, count: int,
                  first_stage: bool, last_stage: bool) -> List[Tuple[int, int, bool]]:
    """The parameter tensors of one device of a pipeline stage, as Megatron's unfused path
    builds them: ``(elements, how many, expert?)``. Their sum is ``stage_params``'s."""
    H, TP = model.hidden, layout.tp
    out: List[Tuple[int, int, bool]] = []
    attn = model.attention_params_per_layer()
    proj = model.heads * model.dv * H
    fc1 = (model.ffn_matrices - 1)
    for layer in range(first, first + count):
        out += [((attn - proj) // TP, 1, False), (proj // TP, 1, False), (H, 2, False)]
        if model.is_moe_layer(layer):
            out.append((H * model.experts, 1, False))
            if model.shared_experts:
                width = model.shared_experts * model.shared_expert_ffn
                out += [(fc1 * H * width // TP, 1, False), (H * width // TP, 1, False)]
            e_local = model.experts // layout.ep
            out += [(fc1 * H * model.expert_ffn, e_local, True),
                    (H * model.expert_ffn, e_local, True)]
        else:
            out += [(fc1 * H * model.dense_ffn // TP, 1, False),
                    (H * model.dense_ffn // TP, 1, False)]
    emb = math.ceil(model.vocab / TP) * H
    if first_stage:
        out.append((emb, 1, False))
    if last_stage:
        out.append((H, 1, False))
        if not (model.tied_embeddings and first_stage):
            out.append((emb, 1, False))
    return [t for t in out if t[0] > 0]


def pinned_bytes(tensors: List[Tuple[int, int, bool]], layout: Layout, per_element: int,
                 copies: int = 1) -> int:
    """Host bytes of ``copies`` pinned fp32-or-other tensors per parameter shard, each
    allocated through torch's caching host allocator (rounded up to a power of two). The
    shard of a tensor is taken as its elements over the shard factor (dense DP·CP, experts
    TP·CP·DP/EP), the even split both sharded optimizers approach."""
    total = 0
    for numel, n, expert in tensors:
        share = layout.expert_dp if expert else layout.dense_dp
        total += n * copies * caching_host_bytes(per_element * math.ceil(numel / share))
    return total


@dataclass(frozen=True)
class ModelState:
    """The model-state terms of one baseline on one device (bytes)."""

    weights: int            # resident low-precision weights
    grads: int              # resident gradient buffer
    optimizer_device: int   # optimizer state on the device
    optimizer_host: int     # host bytes (pinned and pageable)
    host_pinned: int        # of which pinned, as torch allocates it
    vocab_extra: int = 0    # bytes the vocabulary transient adds (FSDP2's gathered output layer)


def model_state(name: str, model: ModelSpec, layout: Layout, *, params: Dict[str, int],
                shard: int, tensors: List[Tuple[int, int, bool]], last_stage: bool,
                layer_params: int, recipe=None) -> ModelState:
    """The model-state terms of baseline ``name`` (formulas in the module docstring).

    ``params``: this device's dense and expert parameters; ``shard``: its optimizer shard
    (P_s); ``tensors``: ``param_tensors`` of the stage; ``layer_params``: P_u; ``recipe``:
    ``fsdp2-cp``'s knobs (``plan.recipes.Fsdp2CP``), which that baseline needs.
    """
    check_name(name)
    if name == "fsdp2-cp":
        if recipe is None:
            raise PlanError("fsdp2-cp's model state needs its recipe (plan.recipes.Fsdp2CP)")
        if recipe.params_on_host:  # the chunked loss gathers the output layer (its term)
            return replace(model_state("fsdp2-offload", model, layout, params=params,
                                       shard=shard, tensors=tensors, last_stage=last_stage,
                                       layer_params=layer_params), vocab_extra=0)
        b = model.bytes_per_value
        if recipe.optimizer_on_host:
            # ZeRO-3 with offload_optimizer: cpu. Its flat gradient-partition buffer is on
            # the host then (stage3.py allocates it on the optimizer's device), so only the
            # current layer's gradient, before its reduce-scatter, is on the GPU.
            return ModelState(b * shard + 2 * b * layer_params, b * layer_params,
                              0, 4 * FP32 * shard, 0)
        master = FP32 if recipe.fp32_master else b
        # sharded parameters and gradients in the master dtype, m and v beside them; the
        # current and prefetched layer gathered in b, the current one's unsharded gradient
        return ModelState(master * shard + 2 * b * layer_params,
                          master * shard + master * layer_params, 2 * master * shard, 0, 0)
    b = model.bytes_per_value
    P = params["dense"] + params["expert"]
    grad_bytes = FP32 if layout.grad_fp32 else b
    if name == "megatron":
        per = ADAM_BYTES_PER_PARAM if b < 4 else ADAM_BYTES_PER_PARAM_FP32
        return ModelState(b * P, grad_bytes * P, per * shard, 0, 0)
    if name in ("megatron-cpu-offload", "megatron-offload"):
        grads_pinned = pinned_bytes(tensors, layout, FP32)
        host = shard * (ADAM_BYTES_PER_PARAM if b < 4 else ADAM_BYTES_PER_PARAM_FP32)
        return ModelState(b * P, grad_bytes * P, 0, host + grads_pinned, grads_pinned)
    # fsdp2-offload
    pinned = pinned_bytes(tensors, layout, FP32, copies=2)  # sharded params and grads
    out_layer = math.ceil(model.vocab / layout.tp) * model.hidden if last_stage else 0
    return ModelState(2 * b * layer_params, FP32 * layer_params, 0,
                      pinned + MOMENT_BYTES_PER_PARAM * shard, pinned,
                      vocab_extra=(b + FP32) * out_layer)


def largest_layer_params(model: ModelSpec, layout: Layout, first: int, count: int) -> int:
    """P_u: parameters of the largest layer of the stage on one device (its FSDP unit)."""
    H = model.hidden
    best = 0
    for layer in range(first, first + count):
        n = model.attention_params_per_layer() // layout.tp + 2 * H
        if model.is_moe_layer(layer):
            n += H * model.experts + (model.experts // layout.ep) * model.expert_params()
            n += model.shared_experts * model.ffn_matrices * H * model.shared_expert_ffn \
                // layout.tp
        else:
            n += model.ffn_matrices * H * model.dense_ffn // layout.tp
        best = max(best, n)
    return best


# The baseline as the paper ran it: FSDP2 without sequence sharding. Plain data parallelism
# over every GPU (TP 1, CP 1, PP 1): each GPU holds a whole sequence. Experts stay expert-
# parallel as wide as the expert count allows (EP shards the experts, not the sequence); at
# EP 1 every GPU would gather all of a layer's experts (about 17B parameters for the paper's
# family: two layers in bf16 and one fp32 gradient, 8 B each, 127 GiB), which fits no length.
PAPER_BASELINE = "fsdp2-offload"
PAPER_LABEL = "the baseline as the paper ran it (FSDP2 without sequence sharding)"


def paper_layout(model: ModelSpec, gpus: int, **kw) -> Layout:
    """The layout of ``PAPER_LABEL``: TP 1, CP 1, PP 1, DP = ``gpus``, EP the largest
    divisor of the expert count that divides ``gpus`` (1 for a dense model)."""
    ep = 1
    if model.experts:
        ep = max(d for d in range(1, gpus + 1) if gpus % d == 0 and model.experts % d == 0)
    return Layout(tp=1, cp=1, pp=1, dp=gpus, ep=ep, **kw)
