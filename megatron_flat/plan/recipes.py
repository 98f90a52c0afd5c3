"""The recipe baselines: what today's long-context recipes hold beside the model state.

``plan.baselines``' first three baselines differ from stock Megatron in the model state only.
The two here also change the activations, as the recipes users run at 1M tokens do:

``fsdp2-cp`` — the PyTorch-native recipe (Hugging Face TRL's long-context guide, torchtitan,
DeepSpeed's ALST): FSDP2 (``fully_shard`` per layer, one layer prefetched) over DP·CP,
PyTorch's context parallelism around SDPA, each layer checkpointed with its input saved to
pinned host memory (``save_on_cpu(pin_memory=True)``: both copies on the compute stream),
TRL's chunked NLL loss (each chunk of tokens checkpointed: its logits live only in its own
forward and backward), the experts as the recipe runs them (no dispatch chunking).
Symbols as in ``peaks.py``; ``S`` the tokens of the sequence, ``c`` the loss chunk, ``R`` the
power-of-two rounding of torch's caching host allocator::

    boundaries  device  1·B + fixed          only the input being recomputed is back
                host    L_s·m·R(B)           every layer's input, pinned
    vocab       3·b·N·H                      the final hidden state packed by its valid
                                             tokens (TRL sorts them first), its gradient
                                             and the chunk's gradient being added to it
                + c·(V/TP)·(b + 8)           the chunk's logits, fp32 log-softmax and its
                                             fp32 gradient
                + 37·N                       the sort order (int64), loss bookkeeping
                + (b + g)·(V/TP)·H           the output layer gathered once, and its
                                             unsharded gradient (g: the reduce dtype's bytes)
    other       stock's other term, its ring blocks (2·b·N·w_kv) replaced, CP > 1, by
                what PyTorch CP's backward holds (torch's ``_templated_ring_attention_
                backward``; w_q = h·d/TP, w_kv = g_l·(d + d_v), g_l = max(g/TP, 1))::

                  b·S·w_kv  [allgather]      the whole K and V, gathered again
                  (2·b·N·w_kv [alltoall])    or two ring blocks
                  + 4·N·(w_q + w_kv)         fp32 dQ, dK, dV accumulators
                  + b·N·(w_q + w_kv)         one step's gradients before they are added
                  + 8·N·w_kv                 the fp32 dK, dV passed around the ring, two

                or, with Ulysses (DeepSpeed's ALST; ``kv="ulysses"``, CP dividing the heads
                per TP rank; K/V heads replicated up to CP where fewer, w_kv' their width)::

                  b·N·(w_q + w_kv')          the all-to-all's second copy of Q, K, V
                  + b·N·(w_kv' − w_kv)       the replicated K/V heads (0 when CP divides g_l)

                + b·N·F_d/TP                 an unfused MLP keeps gate, up, act and their
                                             product (4·F_d, not Megatron's fused 3·F_d);
                                             with ALST's tiled MLP, 4·F_d·t for one tile of
                                             t tokens instead of N
                + [hf_norms] (8 + b)·N·H     Hugging Face's RMSNorm upcasts: each of the two
                                             layer norms keeps its fp32 input, the second its
                                             output too (stock counts the first's)
                  + (4 + b)·N·(h + g)·d/TP   and with q/k norms (Qwen3) theirs

Model state (``Fsdp2CP.params_on_host``, ``optimizer_on_host``):

    on the host   FSDP2's ``CPUOffloadPolicy``: ``plan.baselines``' ``fsdp2-offload`` terms
    optimizer     ZeRO-3 with the optimizer offloaded: b·P_s on the device (sharded params)
    on host       + 2·b·P_u gathered + b·P_u (the layer's gradient before its reduce-scatter;
                  DeepSpeed keeps the gradient partitions on the optimizer's device, the
                  host); 16·P_s on the host (fp32 master, its gradient, m, v)
    on the device sharded params, grads and AdamW moments (fp32 master: 4 + 4 + 8 B per
    P_s; without it b + b + 2·b) + the current and prefetched layer gathered (2·b·P_u) +
    its unsharded gradient (g·P_u)

``megatron-offload`` — Megatron-Core's own long-context memory configuration (0.16 on):
fine-grained activation offloading (``--fine-grained-activation-offloading --offload-modules
attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act``) with selective
recompute (``--recompute-modules layernorm moe_act mlp``: the offloading is built for it, and
under full recompute the first forward saves nothing to offload), the optimizer on the host
(``--optimizer-cpu-offload --optimizer-offload-fraction 1``: ``megatron-cpu-offload``'s model
state) and CP as the layout gives it. Every tensor autograd saves inside an offload group goes
to pinned host memory on a side stream; a group is reloaded one group ahead in the backward,
and the last layer of each group name of the first microbatch to run backward stays on the
device (``fine_grained_activation_offload.py``: ``post_warmup_callback``). What no group
covers stays on the device for every layer and microbatch in flight. Per layer, with
w_qkv, w_o Q/K/V and O's widths per TP rank, σ the routing skew, F1 = 2 gated::

    offloaded  o = b·N_sp·H                  attn_norm: the layer input
                 + b·N_sp·H                  qkv_linear: the norm output
                 + b·N·(w_qkv + w_o)         core_attn: Q, K, V (rotated) and O (attn_proj's
                                             input is O again)
                 + b·N_sp·H                  mlp_norm: the residual after attention
                 + [MoE] b·σ·k·N_sp·(H + F1·F)   expert_fc1: the dispatched tokens;
                                             moe_act: fc1's output
    kept       r = b·N_sp·H                  the router's (or a dense MLP's recompute) input
                 + [MoE] router bookkeeping  (``peaks.ROUTER_BYTES_*``)
                 + 4·N·h/TP + 8·N_sp         log-sum-exp, the norms' rstd
    boundaries  device  L_s·m·r + o + fixed  the kept layer's groups; the one being consumed
                                             and the one prefetched fit inside it
                host    (L_s·m − 1)·R(o)
    dispatch, other, vocab: stock's. Megatron's cross-entropy (unfused or fused ``native``)
    builds the logits in every release (its linear cross-entropy is on the dev branch only,
    Blackwell-only); paged stash (0.18) bounds the stashed expert activations across layers,
    not the live layer's dispatch transient, so neither lowers a term here.

The step runs no full recompute (3 × the forward's work, not 4) and moves o per layer down and
up on the side streams beside the layers' compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from megatron_flat.plan.baselines import caching_host_bytes
from megatron_flat.plan.model import Layout, ModelSpec, PlanError

__all__ = ["FSDP2_CP", "TRL_LONG_CONTEXT", "Fsdp2CP", "RecipeTerms", "attention_method",
           "fsdp2_cp_terms", "ulysses_fits",
           "megatron_offload_terms", "offloaded_per_layer"]

FP32 = 4
# The chunked loss's bookkeeping per token: the int64 order that packs the valid tokens
# and the CE's own (max, sum-exp, target, loss, masks: ``peaks.CE_BYTES_PER_TOKEN``).
CHUNKED_LOSS_BYTES_PER_TOKEN = 8 + 29
KV_METHODS = ("allgather", "alltoall", "ulysses", "auto")


@dataclass(frozen=True)
class Fsdp2CP:
    """The knobs of the PyTorch-native recipe.

    ``params_on_host``: FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and the
    optimizer on the host; AdamW on the CPU). ``optimizer_on_host`` (without
    ``params_on_host``): DeepSpeed ZeRO-3 with ``offload_optimizer: cpu`` as ALST runs it,
    parameters sharded on the device in the model dtype, the gradient partitions, the fp32
    master and the moments on the host. ``fp32_master``: sharded parameters kept in
    fp32 with bf16 compute (accelerate's FSDP2 upcasts under ``mixed_precision: bf16``);
    False: everything in the model dtype. ``loss_chunk``: tokens per checkpointed loss
    chunk (TRL: 256). ``checkpoint_offload``: each layer's checkpointed input in pinned
    host memory. ``kv``: how attention spans the CP ranks: PyTorch CP's rotate method,
    ``"allgather"`` (its default) or ``"alltoall"`` (ring blocks passed on); ``"ulysses"``
    (heads exchanged by all-to-all, ALST's; CP must divide the heads per TP rank); ``"auto"``:
    Ulysses where the heads allow it, else ``"alltoall"``. ``tiled_mlp``: ALST's tiled MLP,
    tiles of H tokens (its ``ceil(S / H)`` shards). ``hf_norms``: Hugging Face's RMSNorm,
    which keeps an fp32 copy of its input (a fused norm keeps none). ``pinned_checkpoints``:
    the offloaded layer inputs are pinned (``save_on_cpu(pin_memory=True)``, rounded to a
    power of two by torch's caching host allocator); False: pageable copies (ALST's
    ``.to("cpu")``).
    """

    params_on_host: bool = True
    optimizer_on_host: bool = False
    fp32_master: bool = True
    loss_chunk: int = 256
    checkpoint_offload: bool = True
    kv: str = "alltoall"
    tiled_mlp: bool = False
    hf_norms: bool = False
    pinned_checkpoints: bool = True

    def __post_init__(self) -> None:
        if self.kv not in KV_METHODS:
            raise PlanError(f"fsdp2-cp: kv {self.kv!r} is not one of {', '.join(KV_METHODS)}")
        if self.params_on_host and self.optimizer_on_host:
            raise PlanError("fsdp2-cp: params_on_host already puts the optimizer on the host; "
                            "optimizer_on_host is ZeRO-3's offload without it")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 1:
            raise PlanError(f"fsdp2-cp: loss_chunk must be a positive integer, got "
                            f"{self.loss_chunk!r}")


# The planner's baseline: the recipe at its strongest for reach (model state on the host,
# Ulysses where the heads allow it and ring blocks elsewhere, ALST's tiled MLP).
FSDP2_CP = Fsdp2CP(params_on_host=True, kv="auto", tiled_mlp=True)
# TRL's published runs (examples/accelerate_configs/context_parallel_8gpu.yaml): parameters
# on the device, accelerate's fp32 master, PyTorch CP's default allgather, transformers'
# modelling code (its RMSNorm).
TRL_LONG_CONTEXT = Fsdp2CP(params_on_host=False, fp32_master=True, kv="allgather",
                           hf_norms=True)


@dataclass(frozen=True)
class RecipeTerms:
    """A recipe's activation terms for one stage (bytes): they replace stock's."""

    boundaries_device: int
    boundaries_host: int
    vocab: int
    other_extra: int


def mlp_tile_tokens(recipe: Fsdp2CP, model: ModelSpec, n: int) -> int:
    """Tokens of the dense MLP's working set: N, or one tile of H tokens (ALST)."""
    return min(n, model.hidden) if recipe.tiled_mlp else n


def ulysses_fits(model: ModelSpec, layout: Layout) -> bool:
    """Whether Ulysses can split this layout's heads over CP: CP divides the query heads per
    TP rank, and the K/V heads per TP rank divide CP or are divided by it."""
    h_l, g_l, cp = model.heads // layout.tp, max(model.kv_heads // layout.tp, 1), layout.cp
    return h_l % cp == 0 and (g_l % cp == 0 or cp % g_l == 0)


def attention_method(recipe: Fsdp2CP, model: ModelSpec, layout: Layout) -> str:
    """The recipe's attention over CP on ``layout``: ``recipe.kv`` resolved (``"auto"``:
    Ulysses where the heads allow it, else ``"alltoall"``); ``PlanError`` when Ulysses is
    asked for and the heads do not split."""
    if recipe.kv == "auto":
        return "ulysses" if ulysses_fits(model, layout) else "alltoall"
    if recipe.kv == "ulysses" and not ulysses_fits(model, layout):
        raise PlanError(f"fsdp2-cp: Ulysses cannot split {model.heads // layout.tp} query "
                        f"heads and {max(model.kv_heads // layout.tp, 1)} K/V heads per TP "
                        f"rank over CP {layout.cp}")
    return recipe.kv


def fsdp2_cp_terms(recipe: Fsdp2CP, model: ModelSpec, layout: Layout, *, seq_len: int, n: int,
                   boundary: int, held: int, fixed: int, has_dense: bool, last_stage: bool,
                   reduce_bytes: int) -> RecipeTerms:
    """The activation terms of ``fsdp2-cp`` (module docstring) for one stage.

    ``n``: tokens per CP rank; ``boundary``: one layer input (B, stock's: N_sp·H·b);
    ``held``: layer inputs the stage keeps (L_s·m); ``fixed``: the last stage's final-norm
    tensors (stock's); ``reduce_bytes``: g.
    """
    b, H, TP = model.bytes_per_value, model.hidden, layout.tp
    B = boundary
    if recipe.checkpoint_offload:
        device = min(held, 1) * B + fixed
        host = held * (caching_host_bytes(B) if recipe.pinned_checkpoints else B)
    else:
        device, host = held * B + fixed, 0
    vocab = 0
    if last_stage:
        shard = math.ceil(model.vocab / TP)
        c = min(recipe.loss_chunk, n)
        vocab = 3 * b * n * H + c * shard * (b + 8) + CHUNKED_LOSS_BYTES_PER_TOKEN * n \
            + (b + reduce_bytes) * shard * H
    extra = 0
    if layout.cp > 1:
        w_q = model.heads * model.head_dim // TP
        g_l = max(model.kv_heads // TP, 1)
        w_kv = g_l * (model.head_dim + model.dv)
        ring = 2 * b * n * w_kv  # stock's other term counts two ring blocks
        method = attention_method(recipe, model, layout)
        if method == "ulysses":
            w_kv_a2a = max(g_l, layout.cp) * (model.head_dim + model.dv)
            extra += b * n * (w_q + w_kv_a2a) + b * n * (w_kv_a2a - w_kv) - ring
        else:
            kv = b * seq_len * layout.micro_batch_size * w_kv if method == "allgather" \
                else ring
            extra += kv + (4 + b) * n * (w_q + w_kv) + 8 * n * w_kv - ring
    if recipe.hf_norms:
        extra += (8 + b) * n * H
        if "--qk-layernorm" in model.arch_flags:
            extra += (4 + b) * n * (model.heads + model.kv_heads) * model.head_dim // TP
    if has_dense:
        t = mlp_tile_tokens(recipe, model, n)
        # stock's other term counts 3·F_d·N; the unfused MLP 4·F_d over its tile
        extra += b * model.dense_ffn * (4 * t - 3 * n) // TP
    return RecipeTerms(device, host, vocab, extra)


def offloaded_per_layer(model: ModelSpec, layout: Layout, n: int, n_sp: int, sigma: float,
                        moe: bool) -> int:
    """``megatron-offload``'s o: bytes one layer's offload groups move to the host."""
    b, H, TP = model.bytes_per_value, model.hidden, layout.tp
    g_local = max(model.kv_heads // TP, 1) * TP
    w_qkv = (model.heads * model.head_dim + g_local * (model.head_dim + model.dv)) // TP
    w_o = model.heads * model.dv // TP
    out = 3 * b * n_sp * H + b * n * (w_qkv + w_o)
    if moe:
        f1 = 2 if model.gated else 1
        out += int(b * sigma * model.topk * n_sp * (H + f1 * model.expert_ffn))
    return out


def megatron_offload_terms(model: ModelSpec, layout: Layout, *, n: int, n_sp: int,
                           sigma: float, held: int, fixed: int, has_moe: bool,
                           router_bytes: int) -> RecipeTerms:
    """The activation terms of ``megatron-offload`` (module docstring) for one stage:
    ``sigma`` the routing skew, ``held`` L_s·m, ``router_bytes`` the router's bookkeeping
    per layer (0 without MoE layers)."""
    b, H = model.bytes_per_value, model.hidden
    o = offloaded_per_layer(model, layout, n, n_sp, sigma, has_moe)
    r = b * n_sp * H + router_bytes + 4 * n * model.heads // layout.tp + 8 * n_sp
    device = held * r + (o if held else 0) + fixed
    host = max(held - 1, 0) * caching_host_bytes(o)
    return RecipeTerms(device, host, 0, 0)

