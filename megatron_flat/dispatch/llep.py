"""LLEP and PipelinedLLEP execution over an expert-parallel group (DESIGN.md §2.1).

:class:`PipelinedLLEP` runs one MoE layer's dispatch → expert compute → combine for routes
already chosen by a router. Per call (one layer, one micro-batch):

1. local validation of every input — a bad input raises ``ValueError`` before any collective;
2. one all-reduce of ``[P, E + 1]`` int64: every rank's per-expert route counts and token count
   (the global loads for the plan, the counts for route positions, max N for K);
3. the plan (:func:`~megatron_flat.dispatch.plan.plan_dispatch`: LLEP, or plain EP when the
   imbalance is below λ), the chunking (K agreed from max N; ``mode="llep"`` is K = 1) and the
   destination of every route — identical on every rank, computed without communicating;
4. one all-to-all of ``[K, E]`` counts per destination, so each rank knows what it will receive,
   checked against the receive bound ``P · k · c_eff`` (a violation is a bug: ``RuntimeError``);
5. :class:`PipelinedLLEPFunction` — weights to helpers, K rounds of dispatch / compute / combine.

The first call also checks, with one all-gather, that every rank of the group agrees on the
settings (experts, top-k, hidden size, knobs, dtype); a disagreement raises the same
``ValueError`` on every rank. Nothing here imports Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_flat.dispatch.exchange import Pending, all_to_all, columns, drain, group_geometry
from megatron_flat.dispatch.experts import ExpertBank, check_bank
from megatron_flat.dispatch.recompute import Verdict, current_region
from megatron_flat.dispatch.plan import (
    MEMBERSHIPS,
    LLEPPlan,
    num_chunks,
    plan_dispatch,
    receive_bound,
    route_destinations,
)
from megatron_flat.dispatch.schedule import (
    ReceiveSchedule,
    SendSchedule,
    WeightSchedule,
    receive_schedule,
    count_keys,
    send_schedule,
    token_chunks,
    weight_schedule,
)

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
    ``saved_chunks`` (``pipelined``): the first s chunks are kept from forward to backward
    instead of recomputed: with a bank that has ``run_keeping`` (Megatron's experts with a
    one-rank, bias-free fc1; :class:`~megatron_flat.dispatch.experts.GLUExperts`) each
    expert's first-layer output (``[R, F1]``) is kept and saves that GEMM in backward;
    otherwise each expert's whole graph is kept and the chunk's token dispatch in backward
    is saved too. 0 recomputes every chunk. ``debug_checks`` validates the routes' values
    (ranges, order, at most ``topk`` per token), the counts against the plan and the
    per-chunk receive bound on every call; each of these reads device data on the host (a
    host sync on a GPU), so they are off by default: a forward pass then waits for the
    device twice, for the global counts the plan needs and for the chunks' split sizes.
    ``graph_only_recompute``: on the re-run of a reentrant checkpoint's region, skip the
    dispatch and return zeros when the region's later saves do not depend on the output
    (verified on the first re-run; :mod:`megatron_flat.dispatch.recompute`).
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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"dispatch mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("debug_checks", "graph_only_recompute"):
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
                      graph_only_recompute=flat.dispatch_graph_only_recompute)
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
    saved_chunks: int = 0        # chunks kept for backward instead of recomputed
    graph_only: bool = False     # a re-run that skipped dispatch and experts (zeros out)
    llep: bool = field(init=False)

    def __post_init__(self) -> None:
        self.llep = self.plan.llep


def _main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient buffer of a parameter under Megatron-Core's DDP (``main_grad``, with the
    ``grad_added_to_main_grad`` flag of its fused-accumulation protocol), else None.

    The engine then adds each chunk's weight gradient straight into it and marks it added, as
    Megatron's fused linear layers do, so no full-size gradient per expert is held until the
    end of backward; without DDP the gradients are summed in accumulators and returned.
    A bank may hand out a view of a parameter (one expert's block of a grouped weight) with
    ``main_grad`` (the same view of the parameter's buffer) and ``main_grad_owner`` (the
    parameter, whose flag DDP reads) set: it takes the same path."""
    owner = getattr(param, "main_grad_owner", param)
    if not isinstance(owner, torch.nn.Parameter) or not hasattr(owner, "grad_added_to_main_grad"):
        return None
    return getattr(param, "main_grad", None)


def _mark_added(param: torch.Tensor) -> None:
    """Set DDP's ``grad_added_to_main_grad`` on the parameter (or the view's owner)."""
    param.grad_added_to_main_grad = True
    owner = getattr(param, "main_grad_owner", None)
    if owner is not None:
        owner.grad_added_to_main_grad = True


# ---------------------------------------------------------------------------- one step
class _Step:
    """Everything one call knows: schedules, plan, the bank; runs forward and backward."""

    def __init__(self, *, bank: ExpertBank, group, ep_size: int, rank: int, num_experts: int,
                 weights_per_expert: int, n_tokens: int, route_token: torch.Tensor,
                 send: SendSchedule, recv: ReceiveSchedule, wsched: WeightSchedule,
                 transfers: int, overlap: bool, save: bool, keep: int = 0,
                 values: bool = True):
        self.bank, self.group, self.p, self.rank = bank, group, ep_size, rank
        self.e_local = num_experts // ep_size
        self.first = rank * self.e_local
        self.w = weights_per_expert
        self.n, self.route_token = n_tokens, route_token
        self.send, self.recv, self.wsched = send, recv, wsched
        self.transfers = transfers  # weight transfers in the whole group (collective or not)
        self.overlap, self.save = overlap, save
        self.keep = 0 if save else keep  # pipelined: chunks [0, keep) are kept for backward
        self.values = values  # False: graph-only, forward returns zeros (backward recomputes)
        assert values or not (save or keep), "a graph-only forward saves and keeps nothing"
        # A bank that can hand back its first layer's output keeps only that per expert
        # (its input rows come again with the backward dispatch, as for recompute); any
        # other keeps each expert's whole graph.
        self.keep_first = hasattr(bank, "run_keeping") and hasattr(bank, "run_for_grad")
        self.saved: list[Optional[tuple]] = []
        self.kept: dict[int, list] = {}
        self.helper: dict[int, tuple[torch.Tensor, ...]] = {}

    # -- weights ---------------------------------------------------------------------
    def _own(self, e: int, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        j = e - self.first
        return tuple(weights[j * self.w:(j + 1) * self.w])

    def _weights_of(self, e: int, weights: Sequence[torch.Tensor],
                    helper: dict) -> tuple[torch.Tensor, ...]:
        if self.first <= e < self.first + self.e_local:
            return self._own(e, weights)
        try:
            return helper[e]
        except KeyError:
            raise RuntimeError(f"PipelinedLLEP bug: rank {self.rank} received routes of expert {e} "
                               f"without its weights") from None

    def _fetch_helper_weights(self, weights: Sequence[torch.Tensor]) -> Callable[[], dict]:
        """Owners send spilled experts' weights to their helpers (one all-to-all, in flight
        with ``overlap`` so it overlaps the first chunk's token dispatch); returns what
        gives the helper weights ``{expert: tensors}`` once they are needed."""
        if not self.transfers:  # the same on every rank (from the plan), unlike wsched.empty
            return dict
        template = self._own(self.first, weights)
        numel = sum(w.numel() for w in template)
        parts = [torch.cat([w.detach().reshape(-1) for w in self._own(e, weights)])
                 for experts in self.wsched.send for e in experts]
        buf = torch.cat(parts) if parts else template[0].new_empty(0)
        pending = all_to_all([buf], [len(x) * numel for x in self.wsched.recv],
                             [len(x) * numel for x in self.wsched.send], self.group, self.p,
                             async_op=self.overlap)
        del buf, parts

        def arrived() -> dict:
            (got,) = pending.wait()
            helper, offset = {}, 0
            for e in self.wsched.helper_experts:
                views = []
                for w in template:
                    views.append(got[offset:offset + w.numel()].view(w.shape))
                    offset += w.numel()
                helper[e] = tuple(views)
            return helper

        return arrived

    # -- per-chunk pieces --------------------------------------------------------------
    def _rows(self, t: torch.Tensor, i: int, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` of chunk i's grouped order (one expert's routes), taken from the
        received buffer ``t`` (a view when the received order is already grouped)."""
        index = self.recv.group[i]
        return t[start:end] if index is None else t.index_select(0, index[start:end])

    def _put(self, dst: torch.Tensor, i: int, start: int, end: int, src: torch.Tensor) -> None:
        """The inverse of ``_rows``: write one expert's rows into a received-order buffer."""
        index = self.recv.group[i]
        if index is None:
            dst[start:end].copy_(src)
        else:
            dst.index_copy_(0, index[start:end], src)

    def _run(self, for_grad: bool) -> Callable:
        if for_grad and hasattr(self.bank, "run_for_grad"):
            return self.bank.run_for_grad  # recompute: the output's values are not needed
        return self.bank.run

    def _group(self, t: torch.Tensor, i: int) -> torch.Tensor:
        index = self.recv.group[i]
        return t if index is None else t.index_select(0, index)

    def _ungroup(self, t: torch.Tensor, i: int) -> torch.Tensor:
        index = self.recv.group[i]
        if index is None:
            return t
        return torch.empty_like(t).index_copy_(0, index, t)

    def _compute(self, i: int, xg: torch.Tensor, pg: torch.Tensor,
                 weight_of: Callable[[int], tuple]) -> torch.Tensor:
        """Chunk i's grouped rows through their experts as one graph (``llep`` mode)."""
        run = self.bank.run
        segments = self.recv.segments[i]
        if not segments:
            return xg.new_empty((0,) + tuple(xg.shape[1:]))
        if len(segments) == 1:
            return run(weight_of(segments[0][0]), xg, pg)
        # torch.split, not slicing: split's backward is one cat, a slice's a full-size zeros.
        sizes = [t - s for _, s, t in segments]
        outs = [run(weight_of(e), x, p) for (e, _, _), x, p in
                zip(segments, torch.split(xg, sizes), torch.split(pg, sizes))]
        return torch.cat(outs)

    def _leaf(self, e: int, weights, helper) -> tuple[torch.Tensor, ...]:
        """Expert e's weights as autograd inputs: a native expert's own parameters
        (``autograd.grad`` w.r.t. them returns the gradient without accumulating it, so no
        gradient hook fires here), detached leaves of a helper copy."""
        if self.first <= e < self.first + self.e_local:
            return self._own(e, weights)
        return tuple(w.detach().requires_grad_() for w in helper[e])

    def _leaves(self, i: int, weights, helper) -> dict:
        """``_leaf`` of every expert computed in chunk i."""
        return {e: self._leaf(e, weights, helper) for e, _, _ in self.recv.segments[i]}

    def _packable(self, tensors: Sequence[torch.Tensor]) -> bool:
        return self.p > 1 and len(tensors) > 1 and len({t.dtype for t in tensors}) == 1

    def _pack(self, parts: Sequence[tuple[torch.Tensor, Optional[torch.Tensor]]],
              group: Optional[torch.Tensor] = None):
        """Rows of several tensors as what one all-to-all sends: ``(tensors, widths)``.

        ``parts`` are ``(source, index)``: with ``group=None`` the rows ``source[index]``
        (``index=None``: all rows); with ``group``, ``source`` scattered to rows ``group``
        (the inverse of ``_group``). Sources of one dtype are written straight into one
        ``[rows, Σ widths]`` buffer — one collective per round instead of one per tensor (the
        rounds are latency-bound at small chunks), and no temporary per tensor.
        """
        sources = [src for src, _ in parts]
        if not self._packable(sources):
            out = []
            for src, index in parts:
                if group is not None:
                    out.append(torch.empty_like(src).index_copy_(0, group, src))
                else:
                    out.append(src if index is None else src.index_select(0, index))
            return out, None
        rows = sources[0].shape[0] if parts[0][1] is None else parts[0][1].numel()
        views, packed = self._empty_packed(sources, rows)
        for (src, index), view in zip(parts, views):
            if group is not None:
                view.index_copy_(0, group, src)
            elif index is None:
                view.copy_(src)
            else:
                torch.index_select(src, 0, index, out=view)
        return packed

    def _empty_packed(self, like: Sequence[torch.Tensor], rows: int):
        """Uninitialised ``rows``-row buffers shaped and typed like ``like``'s rows, in one
        packed buffer when ``_packable``: ``(views to fill, what _a2a sends)``."""
        if not self._packable(like):
            views = [t.new_empty((rows,) + tuple(t.shape[1:])) for t in like]
            return views, (views, None)
        widths = [t.shape[1] if t.dim() == 2 else 0 for t in like]
        buf = like[0].new_empty((rows, sum(max(w, 1) for w in widths)))
        return columns(buf, widths), ([buf], widths)

    def _a2a(self, packed, i: int, *, back: bool) -> Pending:
        """Chunk i's all-to-all: out to the computing ranks, or ``back`` to the sources. With
        ``overlap`` it is in flight until waited: a dispatch while the previous chunk
        computes, a return (combine, or the backward's input gradients) while the next
        chunk computes. Every rank issues them in one order: D0 D1 C0 D2 C1 ... (dispatch
        Di, return Ci)."""
        tensors, widths = packed
        recv, send = self.recv.splits[i], self.send.splits[i]
        out_splits, in_splits = (send, recv) if back else (recv, send)
        return all_to_all(tensors, out_splits, in_splits, self.group, self.p,
                         async_op=self.overlap, widths=widths)

    # -- forward -------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, probs: torch.Tensor,
                weights: Sequence[torch.Tensor]) -> torch.Tensor:
        k = self.send.num_chunks
        hidden = tokens.shape[1]
        out = tokens.new_zeros((self.n, hidden))
        if not self.values:
            return out
        arrived = self._fetch_helper_weights(weights)

        def dispatch(i: int) -> Pending:
            idx = self.send.chunk(i)
            tok = self.route_token.index_select(0, idx)
            return self._a2a(self._pack([(tokens, tok), (probs, idx)]), i, back=False)

        def combine(i: int, returning: Pending) -> None:
            (y_send,) = returning.wait()
            restore = self.send.restore[i]
            y_em = y_send.index_select(0, restore)
            del y_send
            tok = self.route_token.index_select(0, self.send.chunk(i).index_select(0, restore))
            out.scatter_add_(0, tok.unsqueeze(1).expand(-1, hidden), y_em)

        pending = dispatch(0)
        helper = arrived()
        returning: Optional[tuple[int, Pending]] = None  # the previous chunk's, in flight
        for i in range(k):
            x_recv, p_recv = pending.wait()
            pending = dispatch(i + 1) if self.overlap and i + 1 < k else None
            if self.save:
                xg, pg = self._group(x_recv, i), self._group(p_recv, i)
                del x_recv, p_recv
                xg, pg = xg.detach().requires_grad_(), pg.detach().requires_grad_()
                leaves = self._leaves(i, weights, helper)
                with torch.enable_grad():
                    yg = self._compute(i, xg, pg, leaves.__getitem__)
                self.saved.append((xg, pg, leaves, yg))
                y_recv = self._ungroup(yg.detach(), i)
                del xg, pg, leaves, yg
            else:
                y_recv = self._forward_chunk(i, x_recv, p_recv, weights, helper,
                                             keep=i < self.keep)
                del x_recv, p_recv
            if returning is not None:  # chunk i-1's combine ran while chunk i computed
                combine(*returning)
            returning = (i, self._a2a(([y_recv], None), i, back=True))
            del y_recv
            if not self.overlap:
                combine(*returning)
                returning = None
                if i + 1 < k:
                    pending = dispatch(i + 1)
        if returning is not None:
            combine(*returning)
        if self.save:
            self.helper = helper
        return out

    def _forward_chunk(self, i: int, x_recv: torch.Tensor, p_recv: torch.Tensor,
                       weights: Sequence[torch.Tensor], helper: dict,
                       keep: bool = False) -> torch.Tensor:
        """Chunk i's expert outputs in received order, one expert at a time: each expert's
        rows are gathered, run and written into one output buffer, so the working set is
        one expert's intermediates rather than the whole chunk's. With ``keep`` the chunk
        is kept for backward (``self.kept[i]``): each expert's first-layer output
        (``keep_first``), else each expert run with autograd and its whole graph."""
        y_recv, kept = None, []
        for e, start, end in self.recv.segments[i]:
            x, p = self._rows(x_recv, i, start, end), self._rows(p_recv, i, start, end)
            if keep and self.keep_first:
                y, first = self.bank.run_keeping(self._weights_of(e, weights, helper), x, p)
                kept.append(first)
                del first
            elif keep:
                x, p = x.detach().requires_grad_(), p.detach().requires_grad_()
                leaves = self._leaf(e, weights, helper)
                with torch.enable_grad():
                    y = self.bank.run(leaves, x, p)
                kept.append((e, start, end, x, p, leaves, y))
                y = y.detach()
                del leaves
            else:
                y = self.bank.run(self._weights_of(e, weights, helper), x, p)
            del x, p
            if y_recv is None:
                y_recv = y.new_empty((x_recv.shape[0],) + tuple(y.shape[1:]))
            self._put(y_recv, i, start, end, y)
            del y
        if keep and self.keep_first:
            self.kept[i] = kept
        elif keep:  # dtype and width of the input and probability gradients sent back
            like = (x_recv.new_empty((0,) + tuple(x_recv.shape[1:])), p_recv.new_empty(0))
            self.kept[i] = [like, kept]
        return x_recv.new_empty(x_recv.shape) if y_recv is None else y_recv

    # -- backward ------------------------------------------------------------------------
    def backward(self, grad_out: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor,
                 weights: Sequence[torch.Tensor]):
        k = self.send.num_chunks
        grad_out = grad_out.contiguous()
        arrived = (lambda: self.helper) if self.save else self._fetch_helper_weights(weights)
        acc: dict[int, list[torch.Tensor]] = {}
        grad_tokens = torch.zeros_like(tokens)
        grad_probs = torch.zeros_like(probs)

        def dispatch(i: int) -> Pending:
            idx = self.send.chunk(i)
            tok = self.route_token.index_select(0, idx)
            if self.save or (i < self.keep and not self.keep_first):
                return self._a2a(self._pack([(grad_out, tok)]), i, back=False)
            return self._a2a(self._pack([(tokens, tok), (probs, idx), (grad_out, tok)]), i,
                             back=False)

        def add_back(i: int, returning: Pending) -> None:
            dx_send, dp_send = returning.wait()
            idx = self.send.chunk(i)
            restore = self.send.restore[i]
            tok = self.route_token.index_select(0, idx.index_select(0, restore))
            grad_tokens.index_add_(0, tok, dx_send.index_select(0, restore))
            grad_probs.index_copy_(0, idx, dp_send.to(grad_probs.dtype))

        pending = dispatch(0)
        helper = arrived()
        self.helper = {}
        returning: Optional[tuple[int, Pending]] = None  # the previous chunk's, in flight
        for i in range(k):
            received = pending.wait()
            pending = dispatch(i + 1) if self.overlap and i + 1 < k else None
            if self.save:
                back = self._backward_saved(i, received[-1], acc)
            elif i < self.keep and not self.keep_first:
                like, kept = self.kept.pop(i)
                back = self._backward_experts(i, received[-1], like, drain(kept), acc)
                del kept
            else:
                x_recv, p_recv, g_recv = received
                back = self._backward_experts(
                    i, g_recv, (x_recv, p_recv),
                    self._recomputed(i, x_recv, p_recv, weights, helper, self.kept.pop(i, None)),
                    acc)
                del x_recv, p_recv, g_recv
            del received
            if returning is not None:  # chunk i-1's return ran while chunk i computed
                add_back(*returning)
            returning = (i, self._a2a(back, i, back=True))
            del back
            if not self.overlap:
                add_back(*returning)
                returning = None
                if i + 1 < k:
                    pending = dispatch(i + 1)
        if returning is not None:
            add_back(*returning)
        del helper
        self._return_helper_grads(acc, weights)
        grad_weights = []
        for j in range(self.e_local):
            e = self.first + j
            own = self._own(e, weights)
            got = acc.pop(e, None)
            for n, w in enumerate(own):
                if _main_grad(w) is not None:
                    # Already in main_grad: a placeholder keeps DDP's per-parameter hooks
                    # firing (they skip the add: grad_added_to_main_grad), one element of
                    # memory instead of a full gradient per parameter.
                    _mark_added(w)
                    grad_weights.append(w.new_empty(1).expand_as(w))
                else:
                    grad_weights.append(torch.zeros_like(w) if got is None
                                        else got[n].to(w.dtype))
        return grad_tokens, grad_probs, grad_weights

    def _backward_saved(self, i: int, g_recv: torch.Tensor, acc: dict):
        """``llep`` mode: differentiate chunk i's saved graph (all its experts at once, as
        plain autograd would); returns what ``_a2a`` sends back (input, probability grads)."""
        gg = self._group(g_recv, i)
        xg, pg, leaves, yg = self.saved[i]
        self.saved[i] = None
        if self.recv.segments[i]:
            experts = [e for e, _, _ in self.recv.segments[i]]
            wanted = [w for e in experts for w in leaves[e] if w.requires_grad]
            grads = list(torch.autograd.grad(yg, [xg, pg] + wanted, gg, allow_unused=True))
            dxg = grads[0] if grads[0] is not None else torch.zeros_like(xg)
            dpg = grads[1] if grads[1] is not None else torch.zeros_like(pg)
            found = iter(grads[2:])
            for e in experts:
                self._accumulate(acc, e, [next(found) if w.requires_grad else None
                                          for w in leaves[e]], leaves[e])
            del grads, found
        else:
            dxg, dpg = xg.detach(), pg.detach()  # empty
        del xg, pg, yg, gg, leaves
        index = self.recv.group[i]
        return self._pack([(dxg, None), (dpg, None)], group=index)

    def _recomputed(self, i: int, x_recv: torch.Tensor, p_recv: torch.Tensor,
                    weights: Sequence[torch.Tensor], helper: dict,
                    kept: Optional[list] = None) -> Iterator[tuple]:
        """``pipelined`` backward of a chunk: each expert's graph rebuilt from its received
        rows, one at a time, as ``(expert, start, end, x, p, weights, y)``; ``kept``: the
        experts' first-layer outputs from forward, which stand in for that layer's GEMM."""
        run = self._run(for_grad=True)
        for n, (e, start, end) in enumerate(self.recv.segments[i]):
            x = self._rows(x_recv, i, start, end).detach().requires_grad_()
            p = self._rows(p_recv, i, start, end).detach().requires_grad_()
            leaves = self._leaf(e, weights, helper)
            first = None
            if kept is not None:
                first, kept[n] = kept[n], None
            with torch.enable_grad():
                y = run(leaves, x, p) if first is None else run(leaves, x, p, kept=first)
            del first
            yield e, start, end, x, p, leaves, y
            del x, p, leaves, y

    def _backward_experts(self, i: int, g_recv: torch.Tensor, like: Sequence[torch.Tensor],
                          experts: Iterator[tuple], acc: dict):
        """``pipelined`` backward of chunk i, one expert's graph at a time (recomputed, or
        kept from forward): differentiated, and its weight gradient added (into
        ``main_grad`` or the accumulators) before the next expert's graph exists, so
        backward holds one expert's graph and weight gradient, never the chunk's. Input and
        probability gradients are written straight into the buffer sent back (``like``:
        their dtypes and widths), in received order. Per-expert graphs are independent, so
        every value is what one ``autograd.grad`` over the whole chunk would give."""
        (dx_recv, dp_recv), back = self._empty_packed(like, g_recv.shape[0])
        for e, start, end, x, p, leaves, y in experts:
            wanted = [w for w in leaves if w.requires_grad]
            grads = torch.autograd.grad(y, [x, p] + wanted, self._rows(g_recv, i, start, end),
                                        allow_unused=True)
            del y
            self._put(dx_recv, i, start, end,
                      grads[0] if grads[0] is not None else torch.zeros_like(x))
            self._put(dp_recv, i, start, end,
                      grads[1] if grads[1] is not None else torch.zeros_like(p))
            found = iter(grads[2:])
            self._accumulate(acc, e, [next(found) if w.requires_grad else None for w in leaves],
                             leaves)
            del grads, found, x, p, leaves
        return back

    @staticmethod
    def _accumulate(acc: dict, e: int, grads: Sequence[Optional[torch.Tensor]],
                    leaves: Sequence[torch.Tensor]) -> None:
        """Sum an expert's weight gradients over chunks: straight into ``main_grad`` for a
        parameter under Megatron's DDP (see ``_main_grad``), else into fp32 accumulators."""
        if all(_main_grad(w) is not None for w in leaves):
            for w, g in zip(leaves, grads):
                if g is not None:
                    w.main_grad.add_(g)
                _mark_added(w)
            return
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, leaves)]
        if e not in acc:
            acc[e] = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads]
        else:
            for a, g in zip(acc[e], grads):
                a.add_(g)

    def _return_helper_grads(self, acc: dict, weights: Sequence[torch.Tensor]) -> None:
        """Helpers send spilled experts' weight gradients to the owners, who add them."""
        if not self.transfers:
            return
        template = self._own(self.first, weights)
        numel = sum(w.numel() for w in template)
        dtype = template[0].dtype
        gdtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        parts = []
        for e in self.wsched.helper_experts:
            got = acc.pop(e, None)
            if got is None:
                parts.append(template[0].new_zeros(numel, dtype=gdtype))
            else:
                parts.append(torch.cat([g.reshape(-1) for g in got]))
        buf = torch.cat(parts) if parts else template[0].new_empty(0, dtype=gdtype)
        (got,) = all_to_all([buf], [len(x) * numel for x in self.wsched.send],
                           [len(x) * numel for x in self.wsched.recv], self.group, self.p).wait()
        del buf, parts
        offset = 0
        for helper_experts in self.wsched.send:  # helpers in rank order, experts sorted
            for e in helper_experts:
                pieces = []
                for w in template:
                    pieces.append(got[offset:offset + w.numel()].view(w.shape))
                    offset += w.numel()
                own = self._own(e, weights)
                if all(_main_grad(w) is not None for w in own):
                    for w, g in zip(own, pieces):
                        w.main_grad.add_(g)
                        _mark_added(w)
                elif e in acc:
                    for a, g in zip(acc[e], pieces):
                        a.add_(g)
                else:
                    acc[e] = [g.clone() for g in pieces]


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
      the first layer's too for a kept chunk, whose output was kept) and differentiated
      before the next expert's; finally helpers return weight gradients to owners (fp32, one
      all-to-all) and the owners add them. A chunk kept whole (a bank without
      ``run_keeping``) sends only its output gradients, as ``llep`` does.
    Backward, ``llep`` (saved): per chunk only output gradients out and input/probability
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
    have them (the fused-accumulation protocol; see ``_main_grad``); otherwise fp32
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
    def forward(ctx, step: _Step, tokens: torch.Tensor, route_probs: torch.Tensor,
                *weights: torch.Tensor) -> torch.Tensor:
        out = step.forward(tokens, route_probs, weights)
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
        grad_tokens, grad_probs, grad_weights = step.backward(grad_out, tokens, route_probs,
                                                              weights)
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
                  "graph_only_recompute"]
        mine = torch.tensor([
            self.num_experts, self.topk, hidden, o.chunk_tokens, o.max_chunks,
            MEMBERSHIPS.index(o.membership), MODES.index(o.mode),
            _DTYPES.index(dtype) if dtype in _DTYPES else 99, round(o.alpha * 1e6),
            o.min_tokens_per_gemm, round(o.imbalance_threshold * 1e6),
            sum(math.prod(s) for s, _ in self.signature), o.saved_chunks,
            int(o.graph_only_recompute)],
            dtype=torch.long, device=device)
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

    # -- the call ----------------------------------------------------------------------
    def __call__(self, tokens: torch.Tensor, route_token: torch.Tensor,
                 route_expert: torch.Tensor, route_probs: torch.Tensor) -> torch.Tensor:
        self._validate(tokens, route_token, route_expert, route_probs)
        o, p, rank, e = self.options, self.ep_size, self.rank, self.num_experts
        device, n = tokens.device, tokens.shape[0]
        bank = self.experts
        weights = [w for j in range(bank.num_local_experts) for w in bank.local_weights(j)]
        self._check_group(tokens.shape[1], tokens.dtype, device)

        # Global counts: every rank's per-expert route counts and token count. Counted with
        # index_add_ (bincount's output size depends on the data: a host sync on a GPU).
        counts = torch.zeros((p, e + 1), dtype=torch.long, device=device)
        counts[rank, :e] = count_keys(route_expert, e)
        counts[rank, e] = n
        if p > 1:
            dist.all_reduce(counts, group=self.group)
        counts = counts.cpu()  # wait 1 of 2: the plan needs the global loads on the host
        by_rank, max_n = counts[:, :e], int(counts[:, e].max())
        plan = plan_dispatch(by_rank.sum(0), p, alpha=o.alpha,
                             min_tokens_per_gemm=o.min_tokens_per_gemm,
                             imbalance_threshold=o.imbalance_threshold)
        if o.mode == "pipelined":
            k_chunks, c_eff = num_chunks(max_n, o.chunk_tokens, o.max_chunks)
        else:
            k_chunks, c_eff = 1, max_n
        dest = route_destinations(route_expert.view(-1, 1), by_rank.to(device), plan,
                                  rank, check=o.debug_checks).view(-1)
        send = send_schedule(route_token, route_expert, dest,
                             token_chunks(n, k_chunks, o.membership, device),
                             num_chunks=k_chunks, ep_size=p, num_experts=e, finalize=False)
        del dest
        (got,) = all_to_all([send.counts.reshape(-1)], [k_chunks * e] * p, [k_chunks * e] * p,
                           self.group, p).wait()
        # Wait 2 of 2: what this rank sends and receives per chunk, in one copy to the host.
        both = torch.cat([send.counts.reshape(-1), got]).cpu()
        send.finalize(both[: p * k_chunks * e].view(p, k_chunks, e))
        recv = receive_schedule(both[p * k_chunks * e:].view(p, k_chunks, e))
        recv.group = [None if g is None else g.to(device) for g in recv.group]
        bound = receive_bound(ep_size=p, topk=self.topk, c_eff=c_eff)
        if o.debug_checks:
            self._check_receive_bound(recv.totals, bound, k_chunks, c_eff, device)
        wsched = weight_schedule(plan, rank)
        foreign = recv.experts - set(range(rank * (e // p), (rank + 1) * (e // p))) \
            - set(wsched.helper_experts)
        if foreign:
            raise RuntimeError(f"PipelinedLLEP bug: rank {rank} receives routes of experts "
                               f"{sorted(foreign)} that are neither native nor spilled to it")

        needs_grad = torch.is_grad_enabled() and (
            tokens.requires_grad or route_probs.requires_grad
            or any(w.requires_grad for w in weights))
        overlap = o.overlap if o.overlap is not None else device.type == "cuda"
        # A checkpoint's re-run (recompute.py): verified first, then graph-only. Every rank
        # of the group takes the same branch: same region structure, same verdict history.
        region = current_region() if needs_grad and o.graph_only_recompute else None
        if region is not None and (self.verdict.graph_only is False or not region.on_top()):
            region = None
        graph_only = region is not None and self.verdict.graph_only is True
        step = _Step(bank=bank, group=self.group, ep_size=p, rank=rank, num_experts=e,
                     weights_per_expert=len(self.signature), n_tokens=n,
                     route_token=route_token, send=send, recv=recv, wsched=wsched,
                     transfers=len(plan.weight_transfers),
                     overlap=overlap,
                     save=needs_grad and not o.recompute and not graph_only,
                     keep=min(o.saved_chunks, k_chunks) if needs_grad and not graph_only else 0,
                     values=not graph_only)
        self.last = StepStats(plan=plan, num_chunks=k_chunks, c_eff=c_eff, max_tokens=max_n,
                              receive_bound=bound, received=recv.totals,
                              sent=[sum(s) for s in send.splits],
                              helper_experts=wsched.helper_experts,
                              saved_chunks=step.keep, graph_only=graph_only)
        out = PipelinedLLEPFunction.apply(step, tokens, route_probs, *weights)
        if region is not None:
            region.watch(out, self.verdict, graph_only)
        return out
