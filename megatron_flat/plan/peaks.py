"""The peak model: each of the four peaks, the other activations and resident state, per device.

``estimate(model, layout, seq_len, flat)`` evaluates every term in bytes for the worst
pipeline stage and composes the step peak (architecture.md §2.5)::

    total = weights + grads + optimizer_device + boundaries_device
            + max(dispatch + other, vocab)

The two transients never coexist (the vocabulary projection runs after the last layer's
forward and before its backward), and the attention/other activations of the layer being
recomputed are live during that layer's MoE transient, hence ``dispatch + other``. With
attention replay, SCO's pool also holds each layer's core-attention output and log-sum-exp
(``sco_pool``), and the one restored ahead of its layer counts with the boundaries on device.
With param offload, weights and grads hold the dense state plus two slots of one MoE layer's
experts, and the rest of the experts' state is host memory (``plan.param_offload``).

Symbols (per device, one microbatch unless noted):

    S     sequence length (tokens per sample)            mbs  micro-batch size
    N     = S·mbs / CP    tokens of the microbatch on this context-parallel rank
    N_sp  = N / TP with sequence parallelism (else N): tokens in the norm/residual/MoE regions
    H, L_s, h, g, d, d_v, E, k, F, F_s, F_d, V: model shape (``ModelSpec``), L_s layers on stage
    E_l   = E / EP local experts            b  bytes per activation/weight element (2 for bf16)
    σ     routing skew: max/mean routes received per EP rank (1 under balance, 1 when EP = 1)
    m     microbatches in flight on the stage (1F1B: PP − s on stage s)

Every formula below models Megatron-Core's implementation (megatron-core 0.16, the
alltoall dispatcher with per-expert GEMMs, ``vocab_parallel_cross_entropy``, full per-layer
recompute, the distributed optimizer). The dispatch and vocabulary formulas of the baseline
are validated against the memory meter on the tiny MoE GPT (``tests/plan/test_validation.py``),
and so are the "flat" ones where one process can run them (``test_validation_flat.py``:
PipelinedLLEP at EP = 1, Ring-DTP on one rank, SCO's boundaries on device and host,
OffloadStreamAdamW's staging and host state). Their multi-rank parts (all-to-all rows,
LLEP spills, the Ring-DTP ring, sub-optimizers per parameter kind) follow architecture.md §2
and the techniques' documented bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from megatron_flat.config import FlatConfig
from megatron_flat.dispatch.plan import num_chunks
from megatron_flat.plan import baselines
from megatron_flat.plan import param_offload as po_term
from megatron_flat.plan import recipes
from megatron_flat.plan.baselines import ADAM_BYTES_PER_PARAM_FP32
from megatron_flat.plan.model import Layout, ModelSpec, PlanError, check_layout, stage_layers

# Routing skew assumed when none is given: the hottest EP rank receives 1.5x the mean.
DEFAULT_SKEW = 1.5

# --- per-token bookkeeping, measured on megatron-core 0.16.1 (small next to the main terms)
# Router, per token and expert: logits fp32 (4) + scores fp32 (4) + scattered probs fp32 (4)
# + routing map bool (1).
ROUTER_BYTES_PER_TOKEN_EXPERT = 13
# Router, per route: top-k value fp32 (4) + index int64 (8) + permuted prob fp32 (4).
ROUTER_BYTES_PER_ROUTE = 16
# Permutation: token index int64 per token.
ROUTER_BYTES_PER_TOKEN = 8
# vocab_parallel_cross_entropy at its forward peak, per token: fp32 max, sum-exp, predicted
# logit, loss, the int64 masked target and the bool target mask (measured: 29 B).
CE_BYTES_PER_TOKEN = 29
# RMSNorm keeps one fp32 rsqrt per token.
NORM_BYTES_PER_TOKEN = 4
# PipelinedLLEP backward, per route of the chunk: the int64 route, token and restore-order
# indices it selects the chunk's rows with.
CHUNK_INDEX_BYTES_PER_ROUTE = 24
# PipelinedLLEP moves each route's router probability in fp32 beside its rows.
PROB_BYTES = 4
# Attention replay keeps each core attention's log-sum-exp in fp32 beside its output O.
LSE_BYTES = 4
# Attention replay restores one layer's O + LSE ahead of its recompute (one slot on device).
REPLAY_PREFETCH = 1

# --- optimizer state
# Stock AdamW state per parameter (12 B mixed precision, 8 B fp32): ``plan.baselines``.
# OffloadStreamAdamW on host for low-precision parameters: fp32 master, m, v. The fp32
# gradient is read from Megatron's grad buffer on the device (counted in ``grads``). With the
# distributed optimizer the master is in host memory (Megatron's precision-aware path); the
# non-distributed Float16 optimizer keeps its fp32 main params (the master) on the device,
# so there only m and v go to host (HOST_BYTES_PER_PARAM_FP32) and 4 B/param stay.
HOST_BYTES_PER_PARAM = 12
MASTER_BYTES_PER_PARAM = 4
# OffloadStreamAdamW on host for fp32 parameters: m and v only. An fp32 parameter is its
# own master (uploaded from where it lives and written back in place) and its gradient is
# read from the device grad buffer (counted in ``grads``), so neither has a host copy.
HOST_BYTES_PER_PARAM_FP32 = 8
STAGING_BYTES_PER_PARAM = 12       # one staged parameter: master, m, v (fp32; the fp32
                                   # gradient Megatron hands over is read in place)
# AdamW kernel scratch per element updated at once: torch's single-tensor kernel keeps
# sqrt(v) and the step's quotient (8 B/element of the largest parameter or bucket piece);
# fused kernels none (OffloadStreamAdamW runs torch's fused kernel on CUDA in place of
# transformer-engine's or apex's FusedAdam).
ADAM_SCRATCH_SINGLE_TENSOR = 8
# Megatron's gradient clipping without apex/transformer-engine (local_multi_tensor_scale)
# writes each scaled fp32 gradient to a temporary before copying it back.
CLIP_SCRATCH_BYTES_PER_PARAM = 4

COMPONENTS = ("dispatch", "vocab", "boundaries", "optimizer", "other")
# The memory meter's section names (megatron_flat.megatron.peaks), for ``sections``.
METER_DISPATCH = "expert dispatch"
METER_VOCAB = "vocabulary projection + loss"
METER_BOUNDARIES = "checkpoint boundaries"
METER_OPTIMIZER = "optimizer step"
METER_STEP = "step"  # the whole step, as ``testing.training.measure`` names it
METER_ATTENTION = "attention block"  # the fifth term's section (not one of the four peaks)
# Megatron's persistent sequence-parallel gather buffer (not a meter section: its bytes,
# read from ``parallel_state.get_global_memory_buffer()``).
METER_GATHER_BUFFER = "SP gather buffer"


@dataclass
class PeakReport:
    """Bytes per device of every term, for the worst pipeline stage.

    Composed: ``total = weights + grads + optimizer_device + boundaries_device +
    max(dispatch + other, vocab)``; ``binding`` names the largest of ``dispatch`` / ``vocab``
    (whichever transient wins), ``boundaries``, ``optimizer`` (weights + grads + optimizer
    state on device) and ``other``. ``sections`` gives the figures in the memory meter's
    definitions (per-section peaks relative to the section's entry, the boundaries as held
    bytes, the optimizer step's as its first step, and ``"step"``: a run of two or more
    steps above the live set before the first, ``testing.training.measure``'s figure), for
    validation and the demo's context sweep.
    """

    model: str
    layout: Layout
    seq_len: int
    flat: Optional[FlatConfig]
    stage: int
    tokens: int                 # N
    tokens_sp: int              # N_sp
    skew: float                 # σ used for the dispatch term
    dispatch: int               # MoE layer transient (routing, dispatch buffers, experts, combine)
    dispatch_buffers: int       # of which route buffers, send + receive (DESIGN §1: 2·k·N·H·b)
    dispatch_bound: int         # the same transient at the routing-independent worst case
    vocab: int                  # output projection + loss transient
    boundaries_device: int      # checkpoint boundaries held on device (incl. final norm's)
    boundaries_host: int        # SCO's pinned pool, as the host tier allocates it (the budget)
    boundary_bytes: int         # one layer input: N_sp·H·b
    boundaries_held: int        # layer inputs held (L_s·m)
    boundaries_offloaded: int   # of which on host
    weights: int                # resident low-precision weights
    grads: int                  # gradient buffer
    optimizer_device: int       # master + moments on device (baseline) or staging (offload)
    optimizer_host: int         # optimizer state in pinned host memory
    other: int                  # attention and other activations of the layer being recomputed
    total: int
    binding: str
    num_chunks: int = 1         # PipelinedLLEP K (1 when off)
    chunk_tokens: int = 0       # c_eff
    vocab_mode: str = "none"    # Ring-DTP schedule used ("weights"/"activations"), or "none"
    sections: Dict[str, int] = field(default_factory=dict)
    params: int = 0             # parameters on this device
    baseline: str = "megatron"  # what runs without megatron-flat (``plan.baselines``)
    host_pinned: int = 0        # of host_per_device, pinned bytes as they are allocated
    replay_bytes: int = 0       # one layer's kept O + LSE, one microbatch (``replay_slot``)
    replay_kept: int = 0        # of boundaries_held, layers whose O + LSE replay keeps on host
    replay_device: int = 0      # of boundaries_device, the O + LSE restored ahead of its layer
    replay_off: Optional[str] = None  # why replay, asked for, keeps nothing (None otherwise)
    params_host: int = 0        # param offload: the host tier's expert weights + fp32 grads
    params_slots: int = 0       # of weights + grads, param offload's device slots
    params_offloaded: int = 0   # routed-expert parameters param offload keeps on the host
    recipe: Optional[object] = None  # fsdp2-cp's knobs (``plan.recipes.Fsdp2CP``), else None
    offloaded_per_layer: int = 0  # megatron-offload: bytes one layer's groups move (o)

    @property
    def flat_on(self) -> bool:
        """Whether any megatron-flat technique is on in this report."""
        return self.flat is not None and self.flat.any_enabled

    @property
    def optimizer(self) -> int:
        """Optimizer/model state on device: weights + grads + optimizer state (or staging)."""
        return self.weights + self.grads + self.optimizer_device

    @property
    def boundaries(self) -> int:
        return self.boundaries_device

    @property
    def boundaries_host_in_use(self) -> int:
        """Of SCO's pool (``boundaries_host``, allocated whole), the bytes the offloaded
        boundaries fill."""
        return self.boundaries_offloaded * self.boundary_bytes

    @property
    def replay_host(self) -> int:
        """Of SCO's pool (``boundaries_host``), the bytes attention replay fills: the O + LSE
        of the ``replay_kept`` layers (L_s·m of them when the pool holds every one)."""
        return self.replay_kept * self.replay_bytes

    @property
    def replay_need(self) -> int:
        """Host bytes attention replay needs for every layer on this stage, kept or not: one
        O + LSE for every layer input held (L_s·m)."""
        return self.boundaries_held * self.replay_bytes

    @property
    def replay_fraction(self) -> float:
        """Of the stage's layer re-runs, the fraction that replays (skips the kernel)."""
        return self.replay_kept / self.boundaries_held if self.boundaries_held else 0.0

    @property
    def host_per_device(self) -> int:
        """Host memory this device's rank holds: SCO's pool + optimizer state + param
        offload's expert weights and gradients, as allocated (megatron-flat's host tier pins
        exactly what it asks for; a baseline's pinned tensors are rounded up by torch's
        caching host allocator)."""
        return self.boundaries_host + self.optimizer_host + self.params_host

    @property
    def host_per_node(self) -> int:
        return self.host_per_device * min(self.layout.gpus_per_node, self.layout.gpus)

    def components(self) -> Dict[str, int]:
        """The JSON/table view: dispatch, vocab, boundaries, optimizer, other, total."""
        return {"dispatch": self.dispatch, "vocab": self.vocab,
                "boundaries": self.boundaries_device, "optimizer": self.optimizer,
                "other": self.other, "total": self.total}

    def fits(self, device_bytes: int, margin: float = 0.0) -> bool:
        return self.total <= usable(device_bytes, margin)


def usable(device_bytes: int, margin: float) -> int:
    """Bytes the plan may use: the device size less a safety margin (fraction)."""
    if not 0 <= margin < 1:
        raise PlanError(f"margin must be a fraction in [0, 1), got {margin!r}")
    return int(device_bytes * (1.0 - margin))


# ------------------------------------------------------------------------------- helpers


def _expert_act_width(model: ModelSpec, fused: bool) -> int:
    """Expert activations per route, in units of F (live through the expert's forward).

    Gated, unfused (Megatron's reference path, what the CPU validation runs): fc1 output
    (2F), silu(gate) (F), linear + offset (F), their product (F), the product scaled by the
    route's prob (F): 6F. Fused SwiGLU kernel: fc1 output (2F), activation (F), scaled (F):
    4F. Plain (non-gated): fc1 (F) + activation (F) + scaled (F) unfused, 2F + F fused.
    """
    if model.gated:
        return 4 if fused else 6
    return 2 if fused else 3


def skew_baseline(model: ModelSpec, layout: Layout, skew: float) -> float:
    """σ for plain EP: ``skew`` capped by what routing allows.

    One rank receives at most min(k, E_l) routes of each token from each of the EP
    sources, i.e. at most EP·min(k, E_l)/k times the mean k·N_sp. With EP = 1 every route
    is local: σ = 1.
    """
    if layout.ep == 1 or not model.experts:
        return 1.0
    e_local = model.experts // layout.ep
    return max(1.0, min(float(skew), layout.ep * min(model.topk, e_local) / model.topk))


def skew_llep(model: ModelSpec, layout: Layout, skew: float, flat: FlatConfig) -> float:
    """σ after LLEP (DESIGN §2.1): below the imbalance threshold λ plain EP runs (σ stays);
    otherwise every rank is filled to at most cap = α·mean, so σ ≈ max(1, α). (Pieces smaller
    than m tokens are not spilled; that rounding is ignored here.)"""
    raw = skew_baseline(model, layout, skew)
    if raw < flat.llep_imbalance_threshold:
        return raw
    return min(raw, max(1.0, flat.llep_alpha))


def _ring_mode(flat: FlatConfig, n_local: int, strip: int) -> str:
    """Ring-DTP schedule: ``auto`` moves activations when N ≤ V/P, else weights."""
    if flat.vocab_mode != "auto":
        return flat.vocab_mode
    return "activations" if n_local <= strip else "weights"


# --------------------------------------------------------------------------------- terms


def dispatch_term(model: ModelSpec, layout: Layout, n_sp: int, skew: float,
                  flat: Optional[FlatConfig]) -> Dict[str, float]:
    """The MoE layer's transient: what the meter's "expert dispatch" section measures.

    Baseline (alltoall dispatcher, per-expert GEMMs), forward peak of one MoE layer::

        R_s   = k·N_sp                       routes sent
        R_r   = σ·k·N_sp                     routes received
        small = N_sp·(13·E + 16·k + 8)       router logits/probs/map, top-k, permutation map
        bufs  = b·H·(R_s + R_r·([EP>1] + [E_l>1]))
                send buffer; all-to-all receive (an identity when EP = 1); copy sorted by
                local expert (only when E_l > 1)
        exp   = b·R_r·(w·F + 2·H)            expert activations (w: 6 unfused SwiGLU, 4 fused)
                                             + expert outputs and their concatenation
        shared= b·n_s·N·w·F_s/TP + b·N·H·[SP]  shared experts on the gathered sequence
        fwd   = small + bufs + exp + shared
        bwd   = 2·b·R_r·H + [unfused]·3·H·F·b    grads of unsort/unpermute; one expert's
                                                 transient weight grads
        dispatch = max(fwd, bwd)

    With EP = 1 and E_l > 1 that is ``small + b·(4·k·N·H + 6·k·N·F)`` (unfused), which the
    validation checks. DESIGN §1's "≈ 2·k·N·H·b (send + receive), × skew" is the ``bufs``
    part; the expert activations and output copies live in the same window and are included.

    LLEP unchunked (``flat.dispatch == "llep"``): the baseline formula with σ' (σ after LLEP)
    and the borrowed-expert term below.

    PipelinedLLEP (``flat.dispatch == "pipelined"``): K = min(ceil(N_sp/c), K_max),
    c_eff = ceil(N_sp/K) (``dispatch.plan.num_chunks``);
    per chunk r_s = k·c_eff sent, r_r = σ'·k·c_eff received (σ' after LLEP); f = min(2, K)
    chunks' rows in flight when communication overlaps compute (``layout.overlap``), else 1;
    rows received from several sources are regrouped by expert (only when EP > 1 and
    E_l > 1: from one source they arrive grouped). Both passes run one expert at a time; the
    hottest expert of a chunk is taken at its bound r_e = min(r_r, EP·c_eff) (a token routes
    to an expert at most once, so each source sends it at most c_eff routes per chunk). The
    forward runs without autograd and writes each expert's output into the chunk's combine
    buffer::

        exp  = b·r_e·(w·F + H) + [regroup]·b·r_e·H   one expert: gathered rows, activations,
                                                      output
        fwd  = small + b·N_sp·H (combined output) + b·f·H·(r_s + [EP>1]·r_r)
               + b·r_r·H (combine buffer) + max(exp, b·r_s·H (its rows in token order))
               + shared + borrowed
        borrowed = [LLEP active]·3·H·F·(b + 4)   one borrowed expert's weights and fp32 grad

    The backward recomputes and differentiates one expert at a time (its own
    ``autograd.grad``), adding its weight gradient into ``main_grad`` before the next::

        row  = 2·b·H + 4                         token row, output-grad row, fp32 probability
        bwd  = b·N_sp·H + 4·k·N_sp               input-grad and probability-grad accumulators
               + 24·r_s                          the chunk's int64 indices
               + f·row·(r_s + [EP>1]·r_r)        the chunk's rows with their output grads
               + (b·H + 4)·r_r                   input and probability grads sent back
               + max(exp + [regroup]·(row − b·H)·r_e + b·H·F + 2·b·r_e·F,
                                                 the expert's graph, then its fc2 weight grad
                                                 and two F-wide activation grads;
                     M·b·H·F + b·r_e·H,          its M weight grads and input grad at the end;
                     b·r_s·H)                    the input grads in token order
               + shared + borrowed
        saved = s·b·r_r·F1                       s = min(dispatch_saved_chunks, K) chunks
                                                 saved for backward: the experts' first-layer
                                                 outputs (F1 = 2F gated, F plain), all alive
                                                 when forward ends; in backward the chunk
                                                 being differentiated uses its own in place
                                                 of recomputing them
        flat = max(fwd + saved, bwd + saved − b·r_r·F1 [s > 0])

    ``bound``: the same with σ at its routing-independent maximum EP·min(k, E_l)/k (per
    chunk under PipelinedLLEP: EP·min(k, E_l)·c_eff routes received; a token's k routes land
    on at most min(k, E_l) of one rank's experts, so this is a little tighter than
    ``dispatch.plan.receive_bound``'s EP·k·c_eff).
    """
    if not model.experts:
        return {"value": 0, "buffers": 0, "bound": 0, "chunks": 1, "c_eff": 0}
    b, H, F, k, E = model.bytes_per_value, model.hidden, model.expert_ffn, model.topk, model.experts
    e_local = E // layout.ep
    fused = layout.fused_kernels
    w = _expert_act_width(model, fused)
    n_full = n_sp * layout.tp if layout.sp else n_sp
    small = n_sp * (ROUTER_BYTES_PER_TOKEN_EXPERT * E + ROUTER_BYTES_PER_ROUTE * k
                    + ROUTER_BYTES_PER_TOKEN)
    shared = 0
    if model.shared_experts:
        shared = b * model.shared_experts * n_full * w * model.shared_expert_ffn // layout.tp
        if layout.sp and layout.tp > 1:
            shared += b * n_full * H
    recv_copy = (1 if layout.ep > 1 else 0) + (1 if e_local > 1 else 0)
    sigma_max = skew_baseline(model, layout, float("inf"))

    mode = "off" if flat is None else flat.dispatch
    llep_active = mode != "off" and layout.ep > 1 and \
        skew_baseline(model, layout, skew) >= flat.llep_imbalance_threshold
    borrowed = model.ffn_matrices * H * F * (b + 4) if llep_active else 0
    sigma = skew_baseline(model, layout, skew) if mode == "off" else \
        skew_llep(model, layout, skew, flat)

    if mode != "pipelined":  # Megatron's dispatcher, or LLEP unchunked
        def fwd(sig: float) -> float:
            r_s, r_r = k * n_sp, sig * k * n_sp
            bufs = b * H * (r_s + r_r * recv_copy)
            return small + bufs + b * r_r * (w * F + 2 * H) + shared + borrowed

        def bwd(sig: float) -> float:
            return 2 * b * sig * k * n_sp * H + (0 if fused else model.ffn_matrices * H * F * b)

        value = max(fwd(sigma), bwd(sigma))
        buffers = b * H * k * n_sp * (1 + sigma)
        bound = max(fwd(sigma_max), bwd(sigma_max))
        return {"value": value, "buffers": buffers, "bound": bound, "chunks": 1, "c_eff": n_sp,
                "skew": sigma}

    # One definition of K and c_eff, shared with the dispatcher.
    K, c_eff = num_chunks(n_sp, flat.dispatch_chunk_tokens, flat.dispatch_max_chunks)
    chunked = _pipelined_transient(model, layout, n_sp, K, c_eff, small, shared + borrowed,
                                   saved=min(flat.dispatch_saved_chunks, K))
    value = chunked(sigma)
    buffers = b * H * (min(2, K) if layout.overlap else 1) * k * c_eff * (1 + sigma)
    return {"value": value, "buffers": buffers, "bound": chunked(sigma_max), "chunks": K,
            "c_eff": c_eff, "skew": sigma}


def _pipelined_transient(model: ModelSpec, layout: Layout, n_sp: int, K: int, c_eff: int,
                         small: float, extra: float, saved: int = 0):
    """σ ↦ PipelinedLLEP's MoE-layer transient, max(forward, backward) (``dispatch_term``).

    ``small``: router bookkeeping; ``extra``: shared experts + borrowed expert, live in both;
    ``saved``: chunks whose expert graphs are saved from forward to backward.
    """
    b, H, F, k = model.bytes_per_value, model.hidden, model.expert_ffn, model.topk
    e_local = model.experts // layout.ep
    w = _expert_act_width(model, layout.fused_kernels)
    flight = min(2, K) if layout.overlap else 1
    remote = layout.ep > 1
    regroup = remote and e_local > 1
    row = 2 * b * H + PROB_BYTES

    def transient(sig: float) -> float:
        r_s, r_r = k * c_eff, sig * k * c_eff
        # One expert's rows in a chunk: a token routes to an expert at most once, so each
        # source sends an expert at most c_eff routes per chunk.
        r_e = min(r_r, layout.ep * c_eff)
        sent = flight * (r_s + (r_r if remote else 0))
        expert = b * r_e * (w * F + H) + (b * r_e * H if regroup else 0)
        fwd = (small + b * n_sp * H + b * H * sent + b * r_r * H
               + max(expert, b * r_s * H))
        # Backward: one expert's recomputed graph, then its fc2 weight gradient and two F-wide
        # activation gradients; at its end all M of its weight gradients and its input grad.
        expert_bwd = max(expert + (row - b * H) * r_e * regroup + b * H * F + 2 * b * r_e * F,
                         model.ffn_matrices * b * H * F + b * r_e * H)
        bwd = (b * n_sp * H + PROB_BYTES * k * n_sp + CHUNK_INDEX_BYTES_PER_ROUTE * r_s
               + row * sent + (b * H + PROB_BYTES) * r_r + max(expert_bwd, b * r_s * H))
        # Saved chunks (the planner models ETP = 1, bias-free experts): each saves its
        # experts' first-layer outputs, F1 = (ffn_matrices - 1)·F wide, from its forward to
        # its backward, all of them at the turn.
        # In backward a saved chunk's outputs stand in for the first-layer outputs its
        # recompute would make, so only the other saved chunks are extra there.
        chunk_saved = b * r_r * (model.ffn_matrices - 1) * F
        held = saved * chunk_saved
        return max(fwd + held, bwd + max(0, held - chunk_saved)) + extra

    return transient


# Bytes per token an MTP head's Ring-DTP call keeps for the backward: lse (fp32), the
# rolled labels (int64) and the active mask (bool).
MTP_SAVED_PER_TOKEN = 4 + 8 + 1


def vocab_term(model: ModelSpec, layout: Layout, n: int, n_sp: int,
               flat: Optional[FlatConfig]) -> Dict[str, float]:
    """Output projection + cross-entropy on the last stage.

    Baseline (``ColumnParallelLinear`` + Megatron's in-place ``vocab_parallel_cross_entropy``;
    logits N × V/TP on every TP rank: SP gathers the sequence first)::

        fwd   = N·(V/TP)·(b + 4·[b<4])   logits in the model dtype + their fp32 copy (CE works
                                         in place on it: max-subtract, exp, normalize)
                + b·N·H·[SP, TP>1]       the gathered input
                + 29·N                   CE bookkeeping (max, sum, target, masks)
        saved = 4·N·(V/TP)               the fp32 softmax kept for backward
        bwd   = N·(V/TP)·b·[b<4]         grad cast back to the model dtype
                + b·N·H·(1 + [SP, TP>1]) input grad (+ regathered input)
                + [unfused]·(V/TP)·H·b   transient weight grad (fused: straight into main_grad)
        section = max(fwd, bwd)          (the meter: relative to each section's entry)
        vocab   = max(fwd, saved + bwd)  (absolute, for the step composition)

    Multi-token prediction (D = ``mtp_layers`` heads): Megatron runs each head's projection +
    loss before the main head's, and each keeps its fp32 softmax for the backward, so the
    baseline's forward peak meets D saved softmaxes and its backward (1 + D)::

        vocab   = max(fwd + D·saved, (1 + D)·saved + bwd)

    Ring-DTP: a head keeps only lse, labels and the active mask (``MTP_SAVED_PER_TOKEN`` bytes
    per token) and its strips are gone when the next head starts:
    vocab += D·13·N_sp (N on one rank).

    DESIGN §1's "≈ 3·N·V fp32" describes an out-of-place loss; Megatron's in-place one keeps
    one fp32 copy (plus the model-dtype logits), which is what is measured.

    Ring-DTP over a ring of P = TP ranks (``flat.vocab``; each rank has its own N_sp tokens;
    each V/P shard folded in strips of w = ceil(V/P / ceil(V/P / vocab_block_size)) rows,
    ``vocab_tile_bytes`` > 0: c = min(N_sp, tile / (4·w)) tokens at a time, else c = N_sp;
    ``strip_geometry``), so the strips' term stays two tiles whatever N is.
    The shard's weight gradient accumulates straight into DDP's ``main_grad`` (held by the
    gradient buffer, not here); one travelling fp32 sum is relayed in place with a slot of
    1/8 of it::

        strips = 2·4·c·w                 the tile being folded + the next one in flight (fp32)
        state  = 4·N_sp·(3 + H)          (m, z, t) and the fp32 dX accumulator
        ring   = weights mode:     2·(V/P)·H·b + 4·(V/P + ⌈V/P / 8⌉)·H   shards in flight,
                                                        the travelling dW sum and its slot
                 activations mode: 2·N_sp·(H·b + 12 + 8) + 4·(N_sp + ⌈N_sp / 8⌉)·H   X,
                                                        state, targets; the dX sum, slot
        vocab  = strips + state + ring + 29·N_sp

    Ring-DTP on one rank (P = 1: the blocked version, nothing moves; ``vocab_block_size`` B
    gives ceil(V/B) strips of equal width w = ceil(V / ceil(V/B)), computed c tokens at a
    time as above; in the strip terms below N is c). One strip tile is live at a time; the
    weight gradient goes into ``main_grad`` strip by strip, and the backward returns DDP's
    placeholder (a zero gradient that autograd materialises as the weight's ``.grad`` for
    DDP's hook, which drops it: Megatron's fused accumulation does the same)::

        strip = 4·c·w + [b<4, unfused]·b·c·w/4   fp32 strip (+ its half-precision product,
                                                 made a quarter of the rows at a time)
        fwd   = strip + 29·N                     strip + online state (m, z, t), loss, masks
        loop  = 4·N·H                            the fp32 dX accumulator
                + 4·c·w + 29·N                   one recomputed strip, lse, coefficients
                + [b<4]·(b·c·w/4 + p·w·H)        half inputs: a quarter-strip of dlogits in
                                                 the input dtype and the strip's dW product
                                                 (p = 4 with fp32-output matmuls, else b)
        bwd   = max(loop, b·V·H)                 the loop, or the placeholder after it (the
                                                 loop's buffers are gone by then; the
                                                 returned dX and what the backward frees
                                                 about cancel: measured within 1%)
        section = max(fwd, bwd);  vocab = max(fwd, 4·N + bwd)   (+ lse saved by the forward)
    """
    b, H, V, P = model.bytes_per_value, model.hidden, model.vocab, layout.tp
    gathered = layout.sp and layout.tp > 1
    if flat is None or not flat.vocab:
        shard = math.ceil(V / P)
        cast = b if b < 4 else 0
        fwd = n * shard * (b + (4 if b < 4 else 0)) + (b * n * H if gathered else 0) \
            + CE_BYTES_PER_TOKEN * n
        saved = 4 * n * shard
        bwd = n * shard * cast + b * n * H * (2 if gathered else 1) \
            + (0 if layout.fused_kernels else shard * H * b)
        heads = model.mtp_layers
        return {"value": max(fwd + heads * saved, (1 + heads) * saved + bwd),
                "section": max(fwd, bwd), "mode": "none"}
    if P == 1:
        term = _blocked_vocab(model, layout, n, flat.vocab_block_size, flat.vocab_tile_bytes)
        term["value"] += model.mtp_layers * MTP_SAVED_PER_TOKEN * n
        return term
    shard = math.ceil(V / P)
    # Each V/P shard is folded in strips of at most vocab_block_size rows, of equal width,
    # a token tile at a time.
    width, rows = strip_geometry(shard, n_sp, flat.vocab_block_size, flat.vocab_tile_bytes)
    mode = _ring_mode(flat, n_sp, shard)
    strips = 2 * 4 * rows * width
    state = 4 * n_sp * (3 + H)
    from megatron_flat.vocab.plan import relay_piece_rows

    if mode == "weights":  # the travelling sum and its relay slot (one piece)
        ring = 2 * shard * H * b + 4 * (shard + relay_piece_rows([shard])) * H
    else:
        ring = 2 * n_sp * (H * b + 12 + 8) + 4 * (n_sp + relay_piece_rows([n_sp])) * H
    value = strips + state + ring + CE_BYTES_PER_TOKEN * n_sp
    return {"value": value + model.mtp_layers * MTP_SAVED_PER_TOKEN * n_sp, "section": value,
            "mode": mode}


def strip_geometry(shard: int, tokens: int, block: int, tile_bytes: int) -> tuple[int, int]:
    """(strip width w, tokens per tile) of Ring-DTP over a ``shard`` of vocabulary rows and
    ``tokens`` tokens, as ``megatron_flat.vocab.plan`` picks them: strips of at most
    ``block`` rows of equal width, narrowed so one token's strip fits a tile
    (``tile_bytes`` / 4, fp32), and tiles of ``tile_bytes // (4·w)`` tokens (all the tokens
    when ``tile_bytes`` is 0 or the strip fits)."""
    if tile_bytes:
        block = min(block, max(1, tile_bytes // 4))
    width = math.ceil(shard / math.ceil(shard / block))
    rows = tokens
    if tile_bytes:
        rows = min(tokens, max(1, tile_bytes // (4 * width)))
    return width, max(rows, 0)


def _blocked_vocab(model: ModelSpec, layout: Layout, n: int, block: int,
                   tile_bytes: int = 0) -> Dict[str, float]:
    """Ring-DTP on one rank (``vocab_term``): strips of ``block`` rows at most, a token
    tile of ``tile_bytes`` at a time, no ring."""
    b, H, V = model.bytes_per_value, model.hidden, model.vocab
    width, rows = strip_geometry(V, n, block, tile_bytes)
    half = b < 4
    strip = 4 * rows * width
    fwd = strip + (b * rows * width // 4 if half and not layout.fused_kernels else 0) \
        + CE_BYTES_PER_TOKEN * n
    loop = 4 * n * H + strip + CE_BYTES_PER_TOKEN * n
    if half:
        product = 4 if layout.fused_kernels else b
        loop += b * rows * width // 4 + product * width * H
    bwd = max(loop, b * V * H)
    # Reported as "weights": the blocked version is the weights schedule's loop on one
    # rank (``vocab.plan`` calls it "blocked").
    return {"value": max(fwd, 4 * n + bwd), "section": max(fwd, bwd), "mode": "weights"}


def gathers_sequence(layout: Layout) -> bool:
    """Whether the attention block gathers the sequence over TP before its QKV projection
    (sequence parallelism over TP > 1): where the attention tiles apply."""
    return bool(layout.sp) and layout.tp > 1


def attn_tile_rows(n: int, tp: int, tile_tokens: int) -> int:
    """Rows of the gathered input the QKV projection holds at once: all N (stock), or one
    sequence tile of ``tile_tokens`` (``attention.tiles``: TP × ⌊tokens / TP⌋ rows, at least
    one per rank, at most N)."""
    if tile_tokens <= 0:
        return n
    from megatron_flat.attention.tiles import rows_for_tokens  # the op's own rule

    return min(n, tp * rows_for_tokens(tile_tokens, tp))


def _attention_widths(model: ModelSpec, layout: Layout):
    """Per-token widths on one TP rank: (QKV output, RoPE's rotated Q and K, attention
    output O, ring attention's K/V blocks: the one received and the next in flight, CP > 1
    only). KV heads are replicated when TP > g."""
    TP = layout.tp
    h, g, d, dv = model.heads, model.kv_heads, model.head_dim, model.dv
    g_local = max(g // TP, 1) * TP
    ring = 2 * g_local * (d + dv) // TP if layout.cp > 1 else 0
    return (h * d + g_local * (d + dv)) // TP, (h * d + g_local * d) // TP, h * dv // TP, ring


def other_term(model: ModelSpec, layout: Layout, n: int, n_sp: int, has_dense: bool,
               attn_tile_tokens: int = 0, gather_buffer_kept: bool = False) -> int:
    """Attention and other activations of the layer being recomputed / back-propagated.

    Flash-style attention (no N² scores), TP-split heads, SP-sharded norms::

        b·[ N_g·H·[SP, TP>1]            the gathered norm output feeding QKV: N_g = N, or
                                        one sequence tile with --flat-attn-tiles
          + N·(h·d + g·d + g·d_v)/TP    Q, K, V (the QKV projection's output, kept whole
                                        through V's view of it)
          + N·(h·d + g·d)/TP            the rotated copies of Q and K (RoPE writes new
                                        tensors, fused or not), which attention saves
          + N·h·d_v/TP                  attention output
          + [CP>1]·2·N·g·(d + d_v)/TP   ring attention: K/V block received + next in flight
          + 4·N_sp·H ]                  norm output, residual, layer output grad, input grad
        + 4·N·h/TP                      softmax log-sum-exp (fp32)
        + [dense FFN layer on stage] b·N·(w_d·F_d)/TP   its activations (w_d: 3 gated, 2 plain)

    Megatron's local column-parallel layers gather the sequence into one persistent buffer
    (``parallel_state``'s global memory buffer, N·H once the first gather sized it), so
    the tiles drop N_g to a tile only where nothing else gathers through it;
    ``gather_buffer_kept`` (another local layer on the stage gathers: see the function of
    that name) keeps N_g = N.
    """
    b, H, TP = model.bytes_per_value, model.hidden, layout.tp
    qkv, rope, out, ring = _attention_widths(model, layout)
    gathered = gathers_sequence(layout)
    tile_tokens = 0 if gather_buffer_kept else attn_tile_tokens
    gathered_rows = attn_tile_rows(n, TP, tile_tokens) if gathered else 0
    acts = gathered_rows * H + n * (qkv + rope + out + ring) + 4 * n_sp * H
    value = b * acts + 4 * n * model.heads // TP
    if has_dense:
        value += b * n * (3 if model.gated else 2) * model.dense_ffn // TP
    return value


def gather_buffer_kept(model: ModelSpec, has_dense: bool, has_moe: bool, last_stage: bool,
                       flat: Optional[FlatConfig]) -> bool:
    """Whether a local column-parallel layer other than the tiled QKV projection gathers
    through Megatron's persistent buffer on this stage: a dense FFN's or shared experts'
    first linear, or the stock output layer (Ring-DTP's strips do not)."""
    shared = has_moe and model.shared_experts > 0
    return has_dense or shared or (last_stage and not (flat is not None and flat.vocab))


def sp_gather_buffer(model: ModelSpec, layout: Layout, n: int, attn_tile_tokens: int,
                     kept: bool) -> int:
    """Bytes of Megatron's persistent sequence-parallel gather buffer on a stage: N·H·b
    once any local layer gathers the sequence through it (it is sized by the first gather
    and never freed), none when only the tiled projections would have."""
    if not gathers_sequence(layout) or (attn_tile_tokens and not kept):
        return 0
    return model.bytes_per_value * n * model.hidden


def attention_block_section(model: ModelSpec, layout: Layout, n: int, n_sp: int,
                            attn_tile_tokens: int = 0) -> int:
    """The attention block as the meter's ``attention block`` section sees it: the most
    bytes above those live when the block's forward (or its backward) began, the larger.

    Forward, at its end (with grad: the recompute)::

        b·[ N·(QKV + rotated Q, K + O)/TP         what the block keeps for its backward
          + out-proj output: N·H + N_sp·H         (SP, TP > 1: the partial sum, then its
                                                  reduce-scatter), R·H + R·H/TP + N_sp·H
                                                  with tiles (R: one tile's rows), N·H else
          + [CP>1]·2·N·g·(d + d_v)/TP ]           ring attention's K/V blocks
        + 4·N·h/TP                                log-sum-exp (fp32)
        + [unfused] 4·N·d·b                       unfused RoPE saves its cos and sin
                                                  ([N, d], every call: Q and K)

    or, while the tiled QKV projection runs, QKV + one tile gathered and projected. The
    backward, above what the forward kept: dO + dQ, dK, dV. Stock's gathered input to the
    QKV projection is not in it: Megatron's local layers gather into a persistent buffer
    that is already live when the section opens (``other_term`` counts it).
    """
    b, H, TP = model.bytes_per_value, model.hidden, layout.tp
    qkv, rope, out, ring = _attention_widths(model, layout)
    rows = 0
    if gathers_sequence(layout):
        rows = attn_tile_rows(n, TP, attn_tile_tokens) if attn_tile_tokens else 0
        proj = (rows * H + rows * H // TP + n_sp * H) if rows else (n * H + n_sp * H)
    else:
        proj = n * H
    kept = n * (qkv + rope + out + ring)
    forward = b * (kept + proj) + 4 * n * model.heads // TP
    if not layout.fused_kernels:
        forward += 4 * n * model.head_dim * b
    qkv_phase = b * (n * qkv + rows * H + rows * qkv)
    backward = b * n * (out + qkv)
    return max(forward, qkv_phase, backward)


def stage_params(model: ModelSpec, layout: Layout, first: int, count: int,
                 first_stage: bool, last_stage: bool) -> Dict[str, int]:
    """Parameters held by one device of a pipeline stage.

    dense: attention (per layer, /TP), norms (2H per layer, replicated), router (H·E), dense
    FFNs and shared experts (/TP), the embedding on the first stage and the output layer on
    the last (V·H/TP each; one matrix when tied and PP = 1). expert: E_l routed experts per
    MoE layer (ETP = 1).
    """
    H = model.hidden
    dense = expert = 0
    for layer in range(first, first + count):
        dense += model.attention_params_per_layer() // layout.tp + 2 * H
        if model.is_moe_layer(layer):
            dense += H * model.experts + (model.experts if model.linear_bias else 0)
            dense += model.shared_experts * model.ffn_params(model.shared_expert_ffn) \
                // layout.tp
            expert += (model.experts // layout.ep) * model.expert_params()
        else:
            dense += model.ffn_params(model.dense_ffn) // layout.tp
    emb = math.ceil(model.vocab / layout.tp) * H
    if first_stage:
        dense += emb
    if last_stage:
        dense += H  # final norm
        if not (model.tied_embeddings and first_stage):
            dense += emb
    return {"dense": dense, "expert": expert}


def largest_param(model: ModelSpec, layout: Layout, first: int, count: int,
                  first_stage: bool, last_stage: bool, kind: Optional[str] = None) -> int:
    """Elements of the largest parameter tensor of one device of a pipeline stage, as
    Megatron's unfused path (``SequentialMLP`` experts) builds them: embedding / output
    shard, fused QKV and output projections, an expert's fc1 (2F·H gated; fc2 is never
    larger), dense and shared FFNs, the router. ``kind``: only ``"dense"`` or only
    ``"expert"`` parameters (None: all)."""
    H, TP = model.hidden, layout.tp
    fc1 = 2 if model.gated else 1
    sizes, experts = [0], [0]
    if first_stage or last_stage:
        sizes.append(math.ceil(model.vocab / TP) * H)
    if count:
        g_local = max(model.kv_heads // TP, 1) * TP
        sizes.append(H * (model.heads * model.head_dim + g_local * (model.head_dim + model.dv))
                     // TP)
        sizes.append(model.heads * model.dv * H // TP)
    layers = range(first, first + count)
    if any(model.is_moe_layer(i) for i in layers):
        experts.append(fc1 * model.expert_ffn * H)
        sizes += [model.experts * H, fc1 * model.shared_expert_ffn * H // TP]
    if any(not model.is_moe_layer(i) for i in layers):
        sizes.append(fc1 * model.dense_ffn * H // TP)
    if kind == "dense":
        return max(sizes)
    if kind == "expert":
        return max(experts)
    return max(sizes + experts)


def optimizer_step_term(model: ModelSpec, layout: Layout, shards, biggest,
                        flat: Optional[FlatConfig], staged_grads: bool = False) -> int:
    """What the meter's "optimizer step" section sees on the device in the first step: the
    state each sub-optimizer allocates there plus its AdamW kernel's scratch; clipping
    comes first, alone.

    ``shards``: the parameters of each Megatron sub-optimizer on this device (dense, then
    expert; one entry when one optimizer holds both), ``biggest``: each one's largest
    parameter (an int: the same for all). The sub-optimizers step one after the other, so
    sub-optimizer i sees the state of 1..i allocated and only its own scratch::

        peak = max_i (Σ_{j ≤ i} state_j + scratch_i)

    Baseline: state m and v (8 B/param of the shard; a master copy exists before the first
    step), scratch (unfused: torch's single-tensor AdamW, 8 B × its largest parameter piece,
    ≤ the shard; fused: none). OffloadStreamAdamW: state its staging slots, scratch
    (unfused: 8 B × the largest piece of one bucket, ≤ min(bucket, largest parameter);
    fused kernels on CUDA: torch's fused kernel, none). Unfused clipping scales each
    gradient into an fp32 temporary (4 B × the largest parameter) before the update starts.
    ``staged_grads``: the last sub-optimizer (param offload's experts) also stages its fp32
    gradients from the host (16 B per staged parameter).
    """
    shards = [shards] if isinstance(shards, int) else list(shards)
    biggests = [biggest] * len(shards) if isinstance(biggest, int) else list(biggest)
    offload = bool(flat and flat.optimizer_offload)
    running = peak = 0
    for i, (shard, big) in enumerate(zip(shards, biggests)):
        piece = min(big, shard)
        if offload:
            bucket = min(flat.optimizer_bucket_numel, shard)
            per = po_term.STAGING_BYTES_PER_PARAM if staged_grads and i == len(shards) - 1 \
                else STAGING_BYTES_PER_PARAM
            running += flat.optimizer_num_slots * bucket * per
            piece = min(piece, bucket)
        else:
            running += shard * ADAM_BYTES_PER_PARAM_FP32
        scratch = 0 if layout.fused_kernels else ADAM_SCRATCH_SINGLE_TENSOR * piece
        peak = max(peak, running + scratch)
    clip = 0 if layout.fused_kernels else CLIP_SCRATCH_BYTES_PER_PARAM * max(biggests)
    return max(peak, clip)


# ------------------------------------------------------------------------------ estimate


def _check_seq(model: ModelSpec, layout: Layout, seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise PlanError(f"sequence length must be a positive integer, got {seq_len!r}")
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        raise PlanError(f"sequence length {seq_len} must be a multiple of 2·CP = "
                        f"{2 * layout.cp} (context parallelism splits it in 2·CP chunks)")
    if layout.sp and (seq_len * layout.micro_batch_size // layout.cp) % layout.tp:
        raise PlanError(f"sequence parallelism needs the {seq_len // layout.cp} tokens per CP "
                        f"rank to divide by TP {layout.tp}")


def _stage_report(model, layout, seq_len, flat, skew, stage,
                  baseline: str = "megatron", recipe=None) -> PeakReport:
    stages = stage_layers(model, layout)
    first, count = stages[stage]
    first_stage, last_stage = stage == 0, stage == layout.pp - 1
    flat_on = flat is not None and flat.any_enabled
    if baseline == "fsdp2-cp" and recipe is None:
        recipe = recipes.FSDP2_CP  # the planner's (``estimate`` allows a recipe only here)
    b, H = model.bytes_per_value, model.hidden
    n = seq_len * layout.micro_batch_size // layout.cp
    n_sp = n // layout.tp if layout.sp else n
    has_moe = any(model.is_moe_layer(i) for i in range(first, first + count))
    has_dense = any(not model.is_moe_layer(i) for i in range(first, first + count))

    # -- dispatch (zero on a stage without MoE layers)
    d = dispatch_term(model, layout, n_sp, skew, flat) if has_moe else \
        {"value": 0, "buffers": 0, "bound": 0, "chunks": 1, "c_eff": 0, "skew": 1.0}
    # -- vocab (last stage only)
    v = vocab_term(model, layout, n, n_sp, flat) if last_stage else \
        {"value": 0, "section": 0, "mode": "none"}

    # -- checkpoint boundaries. Full recompute keeps each layer's input (B = N_sp·H·b) from
    # forward to backward, for every microbatch in flight: m = max(1, in_flight − stage)
    # (1F1B). The last stage also keeps the last layer's output, the final RMSNorm's
    # normalised input and its output (3·B + 4·N_sp), which SCO does not offload.
    # SCO: boundaries go to pinned host up to the budget (n_host = min(count, ⌊budget/B⌋));
    # on device stay the ones past the budget plus ≤ prefetch + 1 restored ones. With
    # attention replay each layer's O + LSE shares the pool (``sco_pool``).
    B = n_sp * H * b
    in_flight = max(1, layout.in_flight - stage)
    held = count * in_flight
    fixed = (3 * B + NORM_BYTES_PER_TOKEN * n_sp) if last_stage else 0
    slot = replay_slot(model, layout, n)
    replay_off = replay_applies(flat, layout) if count else "no layers on this stage"
    offloaded = replay_kept = 0
    if flat is not None and flat.sco and B > 0:
        offloaded, replay_kept = sco_pool(flat.sco_host_budget_bytes, held, B,
                                          slot if replay_off is None else 0)
    if replay_off is None and not replay_kept:
        replay_off = (f"SCO's host budget ({flat.sco_host_budget_bytes:,} B) has no room for "
                      f"an O + LSE ({slot:,} B) after the boundaries before it")
    on_device = held - offloaded + (min(offloaded, flat.sco_prefetch + 1) if offloaded else 0)
    # In the backward one layer's O + LSE is restored ahead of its recompute, as SCO restores
    # boundaries: held on the device beside them.
    replay_device = REPLAY_PREFETCH * slot if replay_kept else 0
    boundaries_device = on_device * B + fixed + replay_device
    # The host tier allocates SCO's whole budget, exactly, at the first offload.
    boundaries_host = flat.sco_host_budget_bytes if flat is not None and flat.sco and held \
        else 0

    # -- optimizer / model state. Weights b per param; grads 4 (fp32 buffer) or b; Adam
    # state 12 B/param (8 when the params are fp32) sharded over DP·CP for dense params and
    # over expert-DP = TP·CP·DP/EP for experts (distributed optimizer; unsharded without).
    # OffloadStreamAdamW: device keeps slots × min(bucket, shard) × 12 B of staging; the
    # host holds 12 B per sharded low-precision parameter (master, m, v) with the
    # distributed optimizer, 8 (m, v) without it, where the fp32 master (4 B) stays on the
    # device; fp32 parameters: 8 (each is its own master).
    # One inner optimizer per Megatron sub-optimizer (dense, expert), each with its own
    # staging: slots × min(bucket, its shard) × 12 B. Without OffloadStreamAdamW the terms
    # are the baseline's (``plan.baselines``; stock Megatron when flat is given).
    # Param offload (``plan.param_offload``): the routed experts' weights and fp32 gradients
    # in the host tier, two slots of one layer's on the device; their sub-optimizer steps
    # its expert-DP shard of them (all of them without the distributed optimizer) with
    # 16 B/param of staging.
    p = stage_params(model, layout, first, count, first_stage, last_stage)
    params = p["dense"] + p["expert"]
    shards = _sub_optimizer_shards(p, layout)
    offload_term = _param_offload_term(model, layout, flat, p)
    if offload_term is not None:
        shards = [math.ceil(p["dense"] / layout.dense_dp) if layout.distributed_optimizer
                  else p["dense"], offload_term.optimizer_params]
    shard = sum(shards)
    vocab_extra = 0
    params_host = params_slots = 0
    if flat is not None and flat.optimizer_offload:
        g = 4 if layout.grad_fp32 else b
        weights, grads = params * b, params * g
        slots, bucket = flat.optimizer_num_slots, flat.optimizer_bucket_numel
        master_on_host = b < 4 and layout.distributed_optimizer
        host_per = HOST_BYTES_PER_PARAM if master_on_host else HOST_BYTES_PER_PARAM_FP32
        if offload_term is None:
            optimizer_device = slots * STAGING_BYTES_PER_PARAM * sum(min(bucket, n)
                                                                     for n in shards)
            optimizer_host = shard * host_per
            master_device = shard
        else:
            dense_shard = shards[0]
            weights = p["dense"] * b + offload_term.device_weights
            grads = p["dense"] * g + offload_term.device_grads
            optimizer_device = slots * STAGING_BYTES_PER_PARAM * min(bucket, dense_shard) \
                + offload_term.staging(slots, bucket)
            optimizer_host = dense_shard * host_per + offload_term.optimizer_host
            params_host = offload_term.host_bytes
            params_slots = offload_term.device_weights + offload_term.device_grads
            master_device = dense_shard  # the experts' masters are on the host either way
        if b < 4 and not master_on_host:
            optimizer_device += master_device * MASTER_BYTES_PER_PARAM
        # the host tier pins exactly this
        host_pinned = boundaries_host + optimizer_host + params_host
    else:
        if baseline != "megatron" and flat_on:
            raise PlanError(f"baseline {baseline!r} is what runs without megatron-flat: "
                            "give it no FlatConfig")
        state = baselines.model_state(
            baseline, model, layout, params=p, shard=shard,
            tensors=baselines.param_tensors(model, layout, first, count, first_stage,
                                            last_stage),
            last_stage=last_stage,
            layer_params=baselines.largest_layer_params(model, layout, first, count),
            recipe=recipe)
        weights, grads = state.weights, state.grads
        optimizer_device, optimizer_host = state.optimizer_device, state.optimizer_host
        vocab_extra = state.vocab_extra
        host_pinned = boundaries_host + state.host_pinned

    tiles = getattr(flat, "attn_tiles", 0) if flat is not None else 0
    # Other local layers gather through Megatron's persistent buffer too: where one runs on
    # this stage, that buffer stays N·H with the tiles on.
    buffer_kept = gather_buffer_kept(model, has_dense, has_moe, last_stage, flat)
    other = other_term(model, layout, n, n_sp, has_dense, attn_tile_tokens=tiles,
                       gather_buffer_kept=buffer_kept) if count else 0

    dispatch, vocab = int(math.ceil(d["value"])), int(math.ceil(v["value"])) + vocab_extra
    offloaded_layer = 0
    if baseline in baselines.RECIPE_BASELINES and not flat_on:
        # The recipe's own activations (``plan.recipes``).
        if baseline == "fsdp2-cp":  # checkpoints on the host, the chunked loss, CP, the MLP
            rt = recipes.fsdp2_cp_terms(
                recipe, model, layout, seq_len=seq_len, n=n, boundary=B,
                held=held, fixed=fixed, has_dense=has_dense, last_stage=last_stage,
                reduce_bytes=4 if layout.grad_fp32 else b)
            vocab, v["section"] = rt.vocab, rt.vocab
        else:  # megatron-offload: every module's saved tensors on the host
            router = n_sp * (ROUTER_BYTES_PER_TOKEN_EXPERT * model.experts + ROUTER_BYTES_PER_ROUTE
                             * model.topk + ROUTER_BYTES_PER_TOKEN) if has_moe else 0
            sigma = skew_baseline(model, layout, skew)
            rt = recipes.megatron_offload_terms(
                model, layout, n=n, n_sp=n_sp, sigma=sigma, held=held, fixed=fixed,
                has_moe=has_moe, router_bytes=router)
            offloaded_layer = recipes.offloaded_per_layer(model, layout, n, n_sp, sigma,
                                                          has_moe)
        boundaries_device, boundaries_host = rt.boundaries_device, rt.boundaries_host
        host_pinned += rt.boundaries_host
        # layers whose activations go to the host (megatron-offload keeps one layer's)
        offloaded = (held if baseline == "fsdp2-cp" else held - 1) if rt.boundaries_host else 0
        other += rt.other_extra if count else 0
    resident = weights + grads + optimizer_device
    total = resident + boundaries_device + max(dispatch + other, vocab)
    if dispatch + other >= vocab:
        contributions = {"dispatch": dispatch, "other": other}
    else:
        contributions = {"vocab": vocab}
    contributions.update(boundaries=boundaries_device, optimizer=resident)
    binding = max(contributions, key=lambda name: (contributions[name], name == "dispatch"))

    if len(shards) == 2:  # dense, then expert
        biggest = [largest_param(model, layout, first, count, first_stage, last_stage, kind)
                   for kind in ("dense", "expert")]
    else:
        biggest = largest_param(model, layout, first, count, first_stage, last_stage)
    sections = {
        METER_DISPATCH: dispatch,
        METER_VOCAB: int(math.ceil(v["section"])),
        METER_BOUNDARIES: _held_at_exit(count, offloaded, B, fixed),
        METER_OPTIMIZER: optimizer_step_term(model, layout, shards, biggest, flat,
                                             staged_grads=offload_term is not None),
        METER_ATTENTION: attention_block_section(model, layout, n, n_sp, tiles) if count else 0,
        METER_GATHER_BUFFER: sp_gather_buffer(model, layout, n, tiles, buffer_kept),
    }
    # Steps after the first, above the live set before training (weights, gradient
    # buffers): the optimizer state the first step allocated, the boundaries held and the
    # larger transient on top; or the first step's optimizer allocations, if larger.
    sections[METER_STEP] = max(total - weights - grads, sections[METER_OPTIMIZER])
    return PeakReport(
        model=model.name, layout=layout, seq_len=seq_len, flat=flat, stage=stage, tokens=n,
        tokens_sp=n_sp, skew=float(d.get("skew", 1.0)), dispatch=dispatch,
        dispatch_buffers=int(math.ceil(d["buffers"])), dispatch_bound=int(math.ceil(d["bound"])),
        vocab=vocab, boundaries_device=boundaries_device, boundaries_host=boundaries_host,
        boundary_bytes=B, boundaries_held=held, boundaries_offloaded=offloaded, weights=weights,
        grads=grads, optimizer_device=optimizer_device, optimizer_host=optimizer_host,
        other=other, total=total, binding=binding, num_chunks=int(d["chunks"]),
        chunk_tokens=int(d["c_eff"]), vocab_mode=v["mode"], sections=sections, params=params,
        baseline=baseline, host_pinned=host_pinned, replay_bytes=slot, replay_kept=replay_kept,
        replay_device=replay_device,
        replay_off=replay_off if flat is not None and flat.attn_replay else None,
        params_host=params_host, params_slots=params_slots,
        params_offloaded=offload_term.expert_params if offload_term is not None else 0,
        recipe=None if flat_on else recipe,
        offloaded_per_layer=offloaded_layer,
    )


def _param_offload_term(model, layout, flat, p):
    """The stage's param offload term, None when it is off or the stage has no experts;
    ``PlanError`` where it cannot run (``plan.param_offload.applies``)."""
    if flat is None or not getattr(flat, "param_offload", False):
        return None
    why = po_term.applies(layout, model)
    if why:
        raise PlanError(f"param offload {why}")
    return po_term.term(model, layout, p["expert"])


def replay_slot(model: ModelSpec, layout: Layout, n: int) -> int:
    """Bytes attention replay keeps for one layer and one microbatch on one rank: the core
    attention's output O, N·(h/TP)·d_v·b, and its log-sum-exp, N·h/TP fp32 (N: tokens per
    CP rank; the core attention runs on the whole of them, heads split over TP). Under CP,
    transformer-engine's ring calls its kernel once per step and merges the partials, so
    replay keeps every step's partial (O, LSE): CP of them on the ring's last rank, each for
    all of its queries (the binding rank; the first keeps (CP+1)/2 pairs' worth)."""
    _, _, out, _ = _attention_widths(model, layout)
    pair = n * (out * model.bytes_per_value + LSE_BYTES * model.heads // layout.tp)
    return pair * layout.cp


def replay_applies(flat: Optional[FlatConfig], layout: Layout) -> Optional[str]:
    """None when attention replay runs with ``flat`` on ``layout`` (how many layers it keeps
    is ``sco_pool``'s); else why it keeps nothing. It exists only under full recompute (the
    re-run is what it skips) and keeps its outputs in SCO's host pool, so it needs SCO on
    with a host budget."""
    if flat is None or not flat.attn_replay:
        return "off"
    if not layout.full_recompute:
        return "needs full recompute (the re-run it skips)"
    if not (flat.sco and flat.sco_host_budget_bytes > 0):
        return "needs SCO on with a host budget (its outputs live in SCO's host pool)"
    return None


def sco_pool(budget: int, held: int, boundary: int, slot: int = 0) -> tuple:
    """(boundaries offloaded, O + LSE kept) of ``held`` layer inputs in SCO's pool of
    ``budget`` bytes.

    The pool is filled first come, in forward order: each layer's input (``boundary``
    bytes) as the layer starts, then, with attention replay (``slot`` > 0), its O + LSE
    (``slot``) once the kernel ran. A span with no room is refused and later ones still
    try: a refused boundary stays on the device, a refused O + LSE is not kept (that
    layer's re-run runs the kernel, as stock). So replay keeps every layer's outputs only
    when the pool holds every boundary too: ``held·(boundary + slot)`` bytes.
    """
    if not slot:
        return min(held, budget // boundary), 0
    whole = min(held, budget // (boundary + slot))  # layers with both in the pool
    left = budget - whole * (boundary + slot)
    offloaded = kept = whole
    for _ in range(held - whole):  # past the first refusal, what still fits
        if left >= boundary:
            left, offloaded = left - boundary, offloaded + 1
        if left >= slot:
            left, kept = left - slot, kept + 1
        if left < min(boundary, slot):
            break
    return offloaded, kept


def _sub_optimizer_shards(p: Dict[str, int], layout: Layout) -> list:
    """Parameters of each Megatron sub-optimizer on this device (the distributed optimizer's
    shard of each, else all of them): dense, and expert when the stage has experts and
    EP > 1 (Megatron marks expert weights ``allreduce=False``, which puts them in their own
    sub-optimizer, only under expert parallelism; at EP = 1 one optimizer holds both)."""
    dense, expert = p["dense"], p["expert"]
    if layout.distributed_optimizer:
        dense = math.ceil(dense / layout.dense_dp)
        expert = math.ceil(expert / layout.expert_dp)
    if expert and layout.ep > 1:
        return [dense, expert]
    return [dense + expert]


def _held_at_exit(count: int, offloaded: int, B: int, fixed: int) -> int:
    """The meter's "checkpoint boundaries" figure: live bytes at the decoder's exit minus its
    entry, for one microbatch (the first microbatch of the stage).

    The first layer's input predates the entry and its caller keeps it, so it never counts,
    offloaded or not. SCO offloads boundaries in forward order until its host budget is
    spent (``offloaded`` of them, first layers first) and frees their device copies; the
    layer inputs past the budget stay: count − max(offloaded, 1) of them. The final norm's
    part (``fixed``) is never offloaded.
    """
    if not count:
        return 0
    return (count - max(min(offloaded, count), 1)) * B + fixed


def estimate(model: ModelSpec, layout: Layout, seq_len: int, flat: Optional[FlatConfig] = None,
             *, skew: float = DEFAULT_SKEW, stage: Optional[int] = None,
             baseline: str = "megatron", recipe=None) -> PeakReport:
    """Every peak term in bytes per device for ``seq_len`` tokens per sample.

    ``flat=None`` (or a FlatConfig with everything off) is the Megatron baseline; each
    enabled technique in ``flat`` replaces its term by the bounded one. ``skew``: max/mean
    routes received per EP rank under plain EP (see ``DEFAULT_SKEW``). The report is the
    pipeline stage with the largest step peak (first and last stages are evaluated: the
    first holds the most microbatches in flight and the embedding, the last the vocabulary
    transient; middle stages are dominated by the first). ``stage`` asks for one stage.
    ``baseline`` (with no technique on): which run without megatron-flat the terms describe
    (``plan.baselines``: ``megatron``, ``megatron-cpu-offload``, ``fsdp2-offload``,
    ``megatron-offload``, ``fsdp2-cp``). ``recipe``: ``fsdp2-cp``'s knobs
    (``plan.recipes.Fsdp2CP``; None: the planner's, ``recipes.FSDP2_CP``), e.g.
    ``recipes.TRL_LONG_CONTEXT`` for TRL's runs.
    """
    if recipe is not None and baseline != "fsdp2-cp":
        raise PlanError(f"a recipe describes the fsdp2-cp baseline, not {baseline!r}")
    baselines.check_name(baseline)
    why = baselines.allowed(baseline, layout)
    if why:
        raise PlanError(f"baseline {baseline}: {why}")
    check_layout(model, layout)
    _check_seq(model, layout, seq_len)
    if skew < 1:
        raise PlanError(f"skew is max/mean load and cannot be below 1, got {skew}")
    if stage is not None:
        if not 0 <= stage < layout.pp:
            raise PlanError(f"stage {stage} is not in 0..{layout.pp - 1}")
        return _stage_report(model, layout, seq_len, flat, skew, stage, baseline, recipe)
    stages = sorted({0, layout.pp - 1})
    reports = [_stage_report(model, layout, seq_len, flat, skew, s, baseline, recipe)
               for s in stages]
    return max(reports, key=lambda r: r.total)
