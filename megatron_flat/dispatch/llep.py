"""LLEP and PipelinedLLEP execution over an expert-parallel group (architecture.md §2.1).

:class:`PipelinedLLEP` runs one MoE layer's dispatch → expert compute → combine for routes
already chosen by a router. Per call (one layer, one micro-batch):

1. local validation of every input — a bad input raises ``ValueError`` before any collective;
2. one all-gather of every rank's ``[K_max · E + 1 + 7]`` int64 row: its route counts per
   (chunk, expert), its chunks from its own N, its token count and its flags (the
   graph-only wish and a recompute violation, :mod:`.recompute`: the group decides those
   together); copied to the host once (the call's only wait for the device). When some
   rank's N gives another K than the group's largest N, the counts are made again with the
   agreed K (a second all-gather and wait);
3. the host planning (:func:`~megatron_flat.dispatch.chunk_plan.plan_rank`): the plan
   (:func:`~megatron_flat.dispatch.plan.plan_dispatch`: LLEP, or plain EP when the
   imbalance is below λ; its smallest spill piece gives every chunk's helper GEMM at least
   m rows), its split over the chunks, and this rank's share — its send split sizes, what it
   receives per chunk and the tables its routes' destinations are found in — identical on
   every rank, computed without communicating, O(P·K·E); the tables reach the device in
   one non-blocking copy from pinned memory (no wait); the receive bound ``P · k · c_eff``
   is checked with ``debug_checks`` (a violation is a bug: ``RuntimeError``);
4. :class:`PipelinedLLEPFunction` — weights to helpers, K rounds of dispatch / compute / combine.

The first call also checks, with one all-gather, that every rank of the group agrees on the
settings (experts, top-k, hidden size, knobs, dtype); a disagreement raises the same
``ValueError`` on every rank. Nothing here imports Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_flat.dispatch.chunk_plan import plan_rank, route_destinations_on_device, send_row
from megatron_flat.dispatch.exchange import group_geometry
from megatron_flat.dispatch.experts import ExpertBank, check_bank
from megatron_flat.dispatch.passes import backward_pass, forward_pass
from megatron_flat.dispatch.recompute import (
    Verdict,
    Violation,
    current_region,
    take_violation,
    violation_message,
)
from megatron_flat.dispatch.step import Step
from megatron_flat.dispatch.strategies import strategy_for
from megatron_flat.dispatch.plan import MEMBERSHIPS, LLEPPlan, num_chunks, receive_bound
from megatron_flat.dispatch.schedule import (
    count_keys,
    receive_plan,
    send_schedule,
    token_chunks,
    weight_schedule,
)
from megatron_flat.runtime.staging import upload_together

__all__ = ["MODES", "DispatchOptions", "PipelinedLLEP", "PipelinedLLEPFunction", "StepStats"]

MODES = ("llep", "pipelined")
"""``llep``: unchunked LLEP (K = 1), intermediates saved for backward as plain autograd would.
``pipelined``: PipelinedLLEP, K chunks, each chunk recomputed in backward."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class DispatchOptions:
    """The knobs of one dispatch engine (FlatConfig's ``dispatch*`` / ``llep_*`` fields).

    ``chunk_tokens`` is the per-source token cap per chunk (c), ``max_chunks`` K_max,
    ``alpha`` the LLEP capacity factor, ``min_tokens_per_gemm`` m, ``imbalance_threshold`` λ
    (0: always LLEP). ``overlap`` runs the all-to-alls asynchronously (NCCL's own stream):
    the spilled-weight transfer during the first chunk's dispatch, chunk i+1's dispatch
    during chunk i's experts, chunk i's combine (in backward, its input-gradient return)
    during chunk i+1's experts; results are bitwise those of the serial order, at the cost
    of one more chunk's receive and return buffers. ``None`` means on for CUDA tensors only:
    on CPU nothing overlaps and the strict one-chunk-at-a-time order keeps the peak lower.
    ``saved_chunks`` (``pipelined``): the first s chunks are saved from forward to backward
    instead of recomputed: with a bank that has ``run_saving`` (Megatron's experts with a
    one-rank, bias-free fc1; :class:`~megatron_flat.dispatch.experts.GLUExperts`) each
    expert's first-layer output (``[R, F1]``) is saved and stands in for that GEMM in backward;
    otherwise each expert's whole graph is saved and the chunk's token dispatch in backward
    is skipped too. 0 recomputes every chunk. ``debug_checks`` validates the routes' values
    (ranges, order, at most ``topk`` per token), the counts against the plan and the
    per-chunk receive bound on every call; each of these reads device data on the host (a
    host sync on a GPU), so they are off by default: a forward pass then waits for the
    device once, for the route counts per chunk and expert the whole schedule comes from.
    ``graph_only_recompute``: on the re-run of a reentrant checkpoint's region, skip the
    dispatch and return zeros when the region's later saves do not depend on the output
    (verified on the first re-run; :mod:`megatron_flat.dispatch.recompute`).
    ``grouped_calls``: with a bank that runs its local experts in one grouped call
    (``run_native``: Megatron's grouped experts), each chunk's rows for this rank's own
    experts go through one call per pass instead of one per expert: fewer kernel launches,
    but backward then holds the chunk's own experts' graph and weight gradients at once.
    """

    mode: str = "pipelined"
    chunk_tokens: int = 4096
    max_chunks: int = 10
    membership: str = "strided"
    alpha: float = 1.0
    min_tokens_per_gemm: int = 1024
    imbalance_threshold: float = 1.3
    overlap: Optional[bool] = None
    saved_chunks: int = 0
    debug_checks: bool = False
    graph_only_recompute: bool = True
    grouped_calls: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"dispatch mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("debug_checks", "graph_only_recompute", "grouped_calls"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("chunk_tokens", "max_chunks", "min_tokens_per_gemm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.saved_chunks, bool) or not isinstance(self.saved_chunks, int) \
                or self.saved_chunks < 0:
            raise ValueError(f"saved_chunks must be an integer >= 0, got {self.saved_chunks!r}")
        if self.membership not in MEMBERSHIPS:
            raise ValueError(f"membership must be one of {', '.join(MEMBERSHIPS)}, "
                             f"got {self.membership!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.imbalance_threshold, bool) \
                or not isinstance(self.imbalance_threshold, (int, float)) \
                or not self.imbalance_threshold >= 0:
            raise ValueError(f"imbalance_threshold must be a number >= 0, "
                             f"got {self.imbalance_threshold!r}")

    @property
    def recompute(self) -> bool:
        """Whether backward recomputes each chunk (PipelinedLLEP) instead of saving it."""
        return self.mode == "pipelined"

    @classmethod
    def from_flat_config(cls, flat: Any, **overrides) -> "DispatchOptions":
        """From a ``FlatConfig`` whose ``dispatch`` is ``llep`` or ``pipelined``."""
        if flat.dispatch not in MODES:
            raise ValueError(f"FlatConfig.dispatch is {flat.dispatch!r}: no flat dispatch engine")
        values = dict(mode=flat.dispatch, chunk_tokens=flat.dispatch_chunk_tokens,
                      max_chunks=flat.dispatch_max_chunks, membership=flat.dispatch_membership,
                      alpha=flat.llep_alpha, min_tokens_per_gemm=flat.llep_min_tokens_per_gemm,
                      imbalance_threshold=flat.llep_imbalance_threshold,
                      saved_chunks=flat.dispatch_saved_chunks,
                      debug_checks=flat.debug_checks,
                      graph_only_recompute=flat.dispatch_graph_only_recompute,
                      grouped_calls=flat.dispatch_grouped_calls)
        values.update(overrides)
        return cls(**values)


@dataclass
class StepStats:
    """What the last call did on this rank (for tests, benchmarks and logs)."""

    plan: LLEPPlan
    num_chunks: int
    c_eff: int
    max_tokens: int
    receive_bound: int
    received: list[int]          # routes received in each chunk
    sent: list[int]              # routes sent in each chunk
    helper_experts: list[int]    # experts computed here for another owner
    send_splits: list[list[int]] = field(default_factory=list)  # per chunk, to each rank
    units: int = 0               # (expert, chunk) pairs this rank ran: its expert GEMM units
    helper_rows: list[list[int]] = field(default_factory=list)  # per chunk, each helper GEMM's rows
    saved_chunks: int = 0        # chunks saved for backward instead of recomputed
    graph_only: bool = False     # a re-run that skipped dispatch and experts (zeros out)
    llep: bool = field(init=False)

    def __post_init__(self) -> None:
        self.llep = self.plan.llep


class PipelinedLLEPFunction(torch.autograd.Function):
    """Dispatch → expert compute → combine of one MoE layer, in K chunks, over an EP group.

    ``apply(step, tokens, route_probs, *weights) -> out``: ``tokens`` ``[N, H]`` (this rank's
    tokens), ``route_probs`` ``[R]`` (router probability of each of this rank's R routes, in
    the step's expert-major order), ``weights`` the E_local experts' weights (each expert's
    tuple in bank order); ``out`` ``[N, H]`` is ``Σ_routes of token t expert(x_t) · p``.

    Communication (P = EP size, S = weight elements per expert; every ``all_to_all_single``
    has uneven, possibly zero splits; tensors of one dtype are packed into one collective),
    forward: when the plan spills, one all-to-all of the spilled experts' weights to their
      helpers (Σ spills · S elements); then per chunk one all-to-all of the chunk's routes
      (H values + 1 probability each) to their compute ranks and one of the expert outputs (H
      each) back.
    Backward, ``pipelined`` (recompute): the weights again, then per chunk one all-to-all of the
      routes with their probabilities and output gradients (2H + 1 per route) out and one of
      input and probability gradients (H + 1) back; each expert's graph is rebuilt from its
      rows (the last linear layer's forward GEMM skipped when the bank has ``run_for_grad``;
      the first layer's too for a saved chunk, whose output was saved) and differentiated
      before the next expert's; finally helpers return weight gradients to owners (fp32, one
      all-to-all) and the owners add them. A chunk saved whole (a bank without
      ``run_saving``) sends only its output gradients, as ``llep`` does.
    Backward, ``llep`` (whole graph held): per chunk only output gradients out and input/probability
      gradients back, then the weight-gradient return.

    Saved: ``tokens``, ``route_probs`` (saved tensors), the weights (held by the context:
    references, no copies, never packed by saved-tensor hooks) plus int64 route
    metadata (≈ 3 · 8 bytes per route). ``llep`` also keeps each chunk's expert graph (inputs,
    activations) and the helper weights from forward to backward, as plain autograd would.

    Memory: each destination receives at most ``P · k · c_eff`` routes per chunk
    (:func:`~megatron_flat.dispatch.plan.receive_bound`, checked at run time), so the dispatch
    working set is O(P · k · c_eff · (H + F)) per chunk instead of O(k · N · H) per layer:
    at most the chunk being computed plus, with ``overlap``, the next one's receive buffer and
    the previous one's return buffer.
    Within a chunk, ``pipelined`` runs one expert at a time in both passes: forward holds one
    expert's intermediates beside the chunk's combine buffer, backward one expert's recomputed
    graph and weight gradient, plus ``N · H`` for the input gradient.
    Weight gradients go straight into Megatron DDP's ``main_grad`` buffers when the weights
    have them (the fused-accumulation protocol; see ``grads.main_grad``); otherwise fp32
    accumulators of the E_local experts' size are held until the end of backward. Helpers hold
    fp32 accumulators for the experts they computed until those are returned.

    Exactness: per-token outputs are the unchunked computation (a token's routes stay in one
    chunk and are summed in expert order, as Megatron's ``unpermute``); rows of a GEMM may
    differ in the last bits when the GEMM's row count changes, so outputs are bitwise equal to
    Megatron's alltoall dispatcher when the experts see the same rows (K = 1, no spill), else
    equal to fp32 rounding. Weight gradients are sums over chunks and helpers: equal within fp32
    reduction-order tolerance.
    """

    @staticmethod
    def forward(ctx, step: Step, tokens: torch.Tensor, route_probs: torch.Tensor,
                *weights: torch.Tensor) -> torch.Tensor:
        out = forward_pass(step, tokens, route_probs, weights)
        ctx.step = step
        ctx.save_for_backward(tokens, route_probs)
        # The weights themselves, not saved tensors: saved-tensor hooks (activation
        # offloading, a recompute region) would pack module state, and an unpacked saved
        # tensor is a new tensor object without the parameter's attributes (main_grad).
        ctx.weights = weights
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        tokens, route_probs = ctx.saved_tensors
        weights, ctx.weights = ctx.weights, None
        step, ctx.step = ctx.step, None
        grad_tokens, grad_probs, grad_weights = backward_pass(step, grad_out, tokens,
                                                              route_probs, weights)
        return (None, grad_tokens, grad_probs, *grad_weights)


# ---------------------------------------------------------------------------- the engine
class PipelinedLLEP:
    """The dispatch engine of one MoE layer on one rank of an expert-parallel group.

    ``experts`` is this rank's :class:`~megatron_flat.dispatch.experts.ExpertBank` (expert
    ``e`` is native to rank ``e // E_local``); ``group`` the EP process group (``None``: the
    default group, or a group of one when torch.distributed is not initialized).

    Call with this rank's tokens ``[N, H]`` and routes in expert-major order
    (:func:`~megatron_flat.dispatch.schedule.routes_from_map` / ``routes_from_topk``): token
    index, expert id and router probability of each route (at most ``topk`` per token). Every
    rank of the group must call it together (it runs collectives); N may differ per rank.
    Returns ``[N, H]``: each token's sum of its experts' probability-weighted outputs.
    ``last`` holds the :class:`StepStats` of the latest call.
    """

    def __init__(self, experts: ExpertBank, *, num_experts: int, topk: int,
                 options: Optional[DispatchOptions] = None,
                 group: Optional[dist.ProcessGroup] = None):
        self.options = options if options is not None else DispatchOptions()
        for name, value in (("num_experts", num_experts), ("topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.ep_size, self.rank = group_geometry(group)
        if num_experts % self.ep_size:
            raise ValueError(f"number of experts ({num_experts}) must be divisible by the "
                             f"expert-parallel size ({self.ep_size})")
        if topk > num_experts:
            raise ValueError(f"topk ({topk}) > num_experts ({num_experts})")
        self.experts, self.group = experts, group
        self.num_experts, self.topk = num_experts, topk
        self.signature = check_bank(experts, num_experts // self.ep_size)
        self.last: Optional[StepStats] = None
        self.verdict = Verdict()  # graph-only recompute of this engine (recompute.py)
        self._violation = None    # the violation this rank sent in the latest exchange
        self._group_checked = False

    # -- validation --------------------------------------------------------------------
    def _validate(self, tokens, route_token, route_expert, route_probs) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 \
                or not tokens.is_floating_point():
            raise ValueError("tokens must be a floating-point [N, H] tensor")
        n = tokens.shape[0]
        for name, t in (("route_token", route_token), ("route_expert", route_expert)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.long:
                raise ValueError(f"{name} must be a 1-D int64 tensor")
        if not isinstance(route_probs, torch.Tensor) or route_probs.dim() != 1 \
                or not route_probs.is_floating_point():
            raise ValueError("route_probs must be a 1-D floating-point tensor")
        r = route_token.numel()
        if route_expert.numel() != r or route_probs.numel() != r:
            raise ValueError(f"route_token, route_expert and route_probs must have one entry per "
                             f"route; got {r}, {route_expert.numel()} and {route_probs.numel()}")
        if r and self.options.debug_checks:  # reads device data: host syncs
            if int(route_expert.min()) < 0 or int(route_expert.max()) >= self.num_experts:
                raise ValueError(f"route_expert must lie in [0, {self.num_experts}): inconsistent "
                                 f"expert count (got ids up to {int(route_expert.max())})")
            if int(route_token.min()) < 0 or int(route_token.max()) >= n:
                raise ValueError(f"route_token must lie in [0, N={n})")
            key = route_expert * max(n, 1) + route_token
            if r > 1 and not bool((key[1:] > key[:-1]).all()):
                raise ValueError("routes must be expert-major (sorted by expert, then token) and "
                                 "unique per (token, expert); build them with routes_from_map "
                                 "or routes_from_topk")
            per_token = int(torch.bincount(route_token, minlength=n).max())
            if per_token > self.topk:
                raise ValueError(f"a token has {per_token} routes, more than topk={self.topk}")
        devices = {t.device for t in (tokens, route_token, route_expert, route_probs)}
        if len(devices) != 1:
            raise ValueError(f"tokens and routes must be on one device, "
                             f"got {sorted(map(str, devices))}")

    def _check_group(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """Once per engine: every rank agrees on the settings (one all-gather)."""
        if self._group_checked or self.ep_size == 1:
            self._group_checked = True
            return
        o = self.options
        fields = ["num_experts", "topk", "hidden size", "chunk_tokens", "max_chunks",
                  "membership", "mode", "dtype", "alpha", "min_tokens_per_gemm",
                  "imbalance_threshold", "expert weight elements", "saved_chunks",
                  "graph_only_recompute", "grouped_calls"]
        mine = torch.tensor([
            self.num_experts, self.topk, hidden, o.chunk_tokens, o.max_chunks,
            MEMBERSHIPS.index(o.membership), MODES.index(o.mode),
            _DTYPES.index(dtype) if dtype in _DTYPES else 99, round(o.alpha * 1e6),
            o.min_tokens_per_gemm, round(o.imbalance_threshold * 1e6),
            sum(math.prod(s) for s, _ in self.signature), o.saved_chunks,
            int(o.graph_only_recompute), int(o.grouped_calls)], dtype=torch.long)
        mine = upload_together({"settings": mine}, device)["settings"]  # no wait
        every = mine.new_empty(self.ep_size * mine.numel())
        dist.all_gather_into_tensor(every, mine, group=self.group)
        every = every.cpu().view(self.ep_size, -1)
        bad = [name for c, name in enumerate(fields)
               if not bool((every[:, c] == every[0, c]).all())]
        if bad:
            raise ValueError("PipelinedLLEP: the ranks of the expert-parallel group disagree on "
                             + ", ".join(f"{name} ({every[:, fields.index(name)].tolist()})"
                                         for name in bad))
        self._group_checked = True

    def _check_receive_bound(self, totals: Sequence[int], bound: int, k_chunks: int,
                             c_eff: int, device: torch.device) -> None:
        """Raise on every rank if any rank would receive more than ``bound`` routes in a
        chunk (a bug, never bad input). Each rank knows only what it receives, so the worst
        chunk of every rank is gathered first (one small all-gather): a rank raising alone
        would leave the others waiting in the dispatch."""
        worst = max(range(len(totals)), key=lambda i: totals[i]) if totals else 0
        mine = torch.tensor([totals[worst] if totals else 0, worst], dtype=torch.long,
                            device=device)
        if self.ep_size > 1:
            every = mine.new_empty(self.ep_size * 2)
            dist.all_gather_into_tensor(every, mine, group=self.group)
            every = every.cpu().view(self.ep_size, 2).tolist()
        else:
            every = [mine.cpu().tolist()]
        over = [(r, total, chunk) for r, (total, chunk) in enumerate(every) if total > bound]
        if over:
            r, total, chunk = over[0]
            raise RuntimeError(
                f"PipelinedLLEP bug: rank {r} would receive {total} routes in chunk {chunk} "
                f"of {k_chunks}, above the receive bound P·k·c_eff = "
                f"{self.ep_size}·{self.topk}·{c_eff} = {bound}"
                + (f" ({len(over)} ranks over it)" if len(over) > 1 else ""))

    # -- counts, plan, schedules ---------------------------------------------------------
    def _exchange(self, n: int, route_expert: torch.Tensor, route_chunk: torch.Tensor,
                  k_chunks: int, slots: int, device: torch.device,
                  flags: Sequence[int] = ()) -> torch.Tensor:
        """Every rank's row, ``[P, slots · E + 1 + len(flags)]`` on the host: its routes per
        (chunk, expert), its token count, then ``flags`` (small integers the group must
        agree on). One all-gather of this rank's row and one copy to the host (the call's
        one wait for the device). Counted with ``index_add_`` (bincount's output size
        depends on the data: a host sync). N and the flags reach the row in one
        non-blocking upload: written one by one (``row[i] = n``), each would be a blocking
        copy of a 0-dim host value."""
        p, e = self.ep_size, self.num_experts
        row = torch.zeros(slots * e + 1 + len(flags), dtype=torch.long, device=device)
        row[:k_chunks * e] = count_keys(route_chunk * e + route_expert, k_chunks * e)
        tail = torch.tensor([n, *(int(flag) for flag in flags)], dtype=torch.long)
        row[slots * e:] = upload_together({"n and flags": tail}, device)["n and flags"]
        if p == 1:
            return row.cpu().view(1, -1)
        every = row.new_empty(p * row.numel())
        dist.all_gather_into_tensor(every, row, group=self.group)
        return every.cpu().view(p, -1)

    def _agree(self, flags: torch.Tensor, wants_graph_only: bool) -> bool:
        """The group's verdict from every rank's flags (``[P, 1 + 6]``: its graph-only wish,
        then a :class:`~megatron_flat.dispatch.recompute.Violation` it found): raise on every
        rank when some rank found a violation; graph-only when every rank wants it."""
        rows = flags.tolist()
        for r, row in enumerate(rows):
            shape = Violation.decode(row[1:])
            if shape is not None:
                op = self._violation.op if r == self.rank and self._violation else ""
                raise RuntimeError(violation_message(r, shape, op))
        wants = [bool(row[0]) for row in rows]
        if all(wants):
            return True
        if wants_graph_only:  # this rank wanted it, some other rank did not: values for good
            self.verdict.graph_only = False
            self.verdict.reason = (
                "the expert-parallel group disagrees: graph-only on ranks "
                f"{[r for r, w in enumerate(wants) if w]}, values on ranks "
                f"{[r for r, w in enumerate(wants) if not w]}")
        return False

    def plan_on_host(self, counts: torch.Tensor):
        """All of a call's host planning (between the counts' copy and the one upload), from
        every rank's route counts ``[P, K, E]`` on the host: ``(plan, this rank's share
        (chunk_plan.RankSchedule), its ReceivePlan, the host tables to upload)``."""
        o = self.options
        plan, share = plan_rank(counts, self.rank, alpha=o.alpha,
                                min_tokens_per_gemm=o.min_tokens_per_gemm,
                                imbalance_threshold=o.imbalance_threshold)
        incoming = receive_plan(share.receive_counts, share.experts)
        return plan, share, incoming, {**share.tables, **incoming.tables()}

    def _schedules(self, n: int, route_token: torch.Tensor, route_expert: torch.Tensor,
                   device: torch.device, wants_graph_only: bool = False):
        """The plan, this rank's send and receive schedules and the group's graph-only
        verdict, identical on every rank and made from one all-gather of each rank's route
        counts per (chunk, expert) and flags (:meth:`_exchange`, :meth:`_agree`): each rank
        counts its routes into the chunks its own N gives; when every rank's N gives the
        group's K (the usual case: one micro-batch shape) those counts are the schedule's,
        else they are counted again with the agreed K (a second all-gather and wait)."""
        o, p, rank, e = self.options, self.ep_size, self.rank, self.num_experts
        pipelined = o.mode == "pipelined"
        slots = o.max_chunks if pipelined else 1

        def chunks_of(tokens: int) -> tuple[int, int]:
            return num_chunks(tokens, o.chunk_tokens, o.max_chunks) if pipelined \
                else (1, tokens)

        k_mine = chunks_of(n)[0]
        token_chunk = token_chunks(n, k_mine, o.membership, device)
        route_chunk = token_chunk[route_token]
        self._violation = take_violation()
        violation = self._violation.encode() if self._violation else Violation.NO_VIOLATION
        counts = self._exchange(n, route_expert, route_chunk, k_mine, slots, device,
                                [int(wants_graph_only)] + violation)
        graph_only = self._agree(counts[:, slots * e + 1:], wants_graph_only)
        ns = counts[:, slots * e].tolist()
        max_n = max(ns)
        k_chunks, c_eff = chunks_of(max_n)
        if any(chunks_of(m)[0] != k_chunks for m in ns):  # ragged N across the group
            token_chunk = token_chunks(n, k_chunks, o.membership, device)
            route_chunk = token_chunk[route_token]
            counts = self._exchange(n, route_expert, route_chunk, k_chunks, k_chunks, device)
        by_chunk = counts[:, :k_chunks * e].view(p, k_chunks, e)
        plan, share, incoming, host_tables = self.plan_on_host(by_chunk)
        # Everything the host planned reaches the device in one non-blocking copy.
        tables = upload_together(host_tables, device)
        dest = route_destinations_on_device(route_expert, route_chunk, tables,
                                            num_experts=e, ep_size=p)
        send = send_schedule(route_token, route_expert, dest, token_chunk,
                             num_chunks=k_chunks, ep_size=p, num_experts=e, finalize=False,
                             with_counts=o.debug_checks)
        if o.debug_checks and not torch.equal(send.counts.cpu(),
                                              send_row(by_chunk, plan, share.ranges, rank)):
            raise RuntimeError(f"PipelinedLLEP bug: rank {rank}'s routes do not match the "
                               "counts its schedule was planned from")
        send.finalize_splits(share.send_splits)
        recv = incoming.on_device(tables)
        return plan, k_chunks, c_eff, max_n, send, recv, graph_only

    # -- the call ----------------------------------------------------------------------
    def __call__(self, tokens: torch.Tensor, route_token: torch.Tensor,
                 route_expert: torch.Tensor, route_probs: torch.Tensor) -> torch.Tensor:
        self._validate(tokens, route_token, route_expert, route_probs)
        o, p, rank, e = self.options, self.ep_size, self.rank, self.num_experts
        device, n = tokens.device, tokens.shape[0]
        bank = self.experts
        weights = [w for j in range(bank.num_local_experts) for w in bank.local_weights(j)]
        self._check_group(tokens.shape[1], tokens.dtype, device)

        needs_grad = torch.is_grad_enabled() and (
            tokens.requires_grad or route_probs.requires_grad
            or any(w.requires_grad for w in weights))
        # A checkpoint's re-run (recompute.py): verified first, then graph-only when every
        # rank of the group wants it (agreed in the counts exchange).
        region = current_region() if needs_grad and o.graph_only_recompute else None
        if region is not None and (self.verdict.graph_only is False or not region.on_top()):
            region = None
        wants = region is not None and self.verdict.graph_only is True
        plan, k_chunks, c_eff, max_n, send, recv, graph_only = self._schedules(
            n, route_token, route_expert, device, wants)
        bound = receive_bound(ep_size=p, topk=self.topk, c_eff=c_eff)
        if o.debug_checks:
            self._check_receive_bound(recv.totals, bound, k_chunks, c_eff, device)
        wsched = weight_schedule(plan, rank)
        foreign = recv.experts - set(range(rank * (e // p), (rank + 1) * (e // p))) \
            - set(wsched.helper_experts)
        if foreign:
            raise RuntimeError(f"PipelinedLLEP bug: rank {rank} receives routes of experts "
                               f"{sorted(foreign)} that are neither native nor spilled to it")

        overlap = o.overlap if o.overlap is not None else device.type == "cuda"
        graph = needs_grad and not o.recompute and not graph_only
        saved = 0 if graph or not needs_grad or graph_only else min(o.saved_chunks, k_chunks)
        step = Step(bank=bank, group=self.group, ep_size=p, rank=rank, num_experts=e,
                    weights_per_expert=len(self.signature), n_tokens=n,
                    route_token=route_token, send=send, recv=recv, wsched=wsched,
                    transfers=len(plan.weight_transfers), overlap=overlap, graph=graph,
                    strategies=[strategy_for(bank, graph=graph, saved=i < saved)
                                for i in range(k_chunks)],
                    saved=saved, values=not graph_only, grouped_calls=o.grouped_calls)
        self.last = StepStats(plan=plan, num_chunks=k_chunks, c_eff=c_eff, max_tokens=max_n,
                              receive_bound=bound, received=recv.totals,
                              sent=[sum(s) for s in send.splits], send_splits=send.splits,
                              units=sum(len(seg) for seg in recv.segments),
                              helper_experts=wsched.helper_experts,
                              helper_rows=[[end - start for ex, start, end in seg
                                            if ex in wsched.helper_experts]
                                           for seg in recv.segments],
                              saved_chunks=step.saved, graph_only=graph_only)
        out = PipelinedLLEPFunction.apply(step, tokens, route_probs, *weights)
        if region is not None:
            region.watch(out, self.verdict, graph_only, alone=p == 1)
        return out
