"""One PipelinedLLEP call's state and data movement (architecture.md §2.1).

:class:`Step` is what one engine call knows once the plan and the chunk schedules exist:
this rank's share of the plan, the chunks' send and receive schedules, the bank and the
knobs. It gives the pieces the forward and backward passes (:mod:`.passes`) and the chunk
strategies (:mod:`.strategies`) are made of: expert weights (own, or a helper's copy of a
spilled expert), the rows of one expert within a received chunk, packing of several tensors
into one all-to-all, the chunk's all-to-all out and back, and the spilled experts' weight
transfer and gradient return. Nothing here decides what is kept from forward to backward.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_flat.dispatch.exchange import Pending, all_to_all, columns
from megatron_flat.dispatch.experts import ExpertBank
from megatron_flat.dispatch.schedule import ReceiveSchedule, SendSchedule, WeightSchedule
from megatron_flat.dispatch.grads import add_all, main_grad, mark_added

__all__ = ["Step"]


class Step:
    """Everything one call knows: schedules, plan, the bank, and each chunk's strategy.

    ``graph`` (``llep`` mode with autograd on): every chunk's graph is held from forward to
    backward as plain autograd would; else ``saved`` (``pipelined``): chunks ``[0, saved)``
    save per-expert state for backward, the rest are recomputed. ``values=False``: a
    graph-only re-run (recompute.py), whose forward returns zeros and saves nothing.
    ``strategies``: one per chunk (``strategies.strategy_for``), made by the engine for
    these settings; the step only holds them (so this module needs nothing from theirs).
    """

    def __init__(self, *, bank: ExpertBank, group, ep_size: int, rank: int, num_experts: int,
                 weights_per_expert: int, n_tokens: int, route_token: torch.Tensor,
                 send: SendSchedule, recv: ReceiveSchedule, wsched: WeightSchedule,
                 transfers: int, overlap: bool, graph: bool, strategies: Sequence,
                 saved: int = 0, values: bool = True, grouped_calls: bool = False):
        self.bank, self.group, self.p, self.rank = bank, group, ep_size, rank
        self.e_local = num_experts // ep_size
        self.first = rank * self.e_local
        self.w = weights_per_expert
        self.n, self.route_token = n_tokens, route_token
        self.send, self.recv, self.wsched = send, recv, wsched
        self.transfers = transfers  # weight transfers in the whole group (collective or not)
        self.overlap = overlap
        self.graph = graph
        self.saved = 0 if graph else saved
        self.values = values
        # One grouped call per chunk for this rank's own experts (strategies.units).
        self.native = grouped_calls and hasattr(bank, "run_native")
        if not values and (graph or saved):
            raise RuntimeError("PipelinedLLEP bug: a graph-only forward holds nothing")
        if len(strategies) != send.num_chunks:
            raise RuntimeError(f"PipelinedLLEP bug: {len(strategies)} chunk strategies for "
                               f"{send.num_chunks} chunks")
        self.strategies = list(strategies)
        self.helper: dict[int, tuple[torch.Tensor, ...]] = {}  # graph: held to backward
        self.templates: dict = {}  # zero-row tensors giving dtypes and widths (strategies)

    # -- weights ---------------------------------------------------------------------
    def own(self, e: int, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        j = e - self.first
        return tuple(weights[j * self.w:(j + 1) * self.w])

    def weights_of(self, e: int, weights: Sequence[torch.Tensor],
                    helper: dict) -> tuple[torch.Tensor, ...]:
        if self.first <= e < self.first + self.e_local:
            return self.own(e, weights)
        try:
            return helper[e]
        except KeyError:
            raise RuntimeError(f"PipelinedLLEP bug: rank {self.rank} received routes of expert {e} "
                               f"without its weights") from None

    def fetch_helper_weights(self, weights: Sequence[torch.Tensor]) -> Callable[[], dict]:
        """Owners send spilled experts' weights to their helpers (one all-to-all, in flight
        with ``overlap`` so it overlaps the first chunk's token dispatch); returns what
        gives the helper weights ``{expert: tensors}`` once they are needed."""
        if not self.transfers:  # the same on every rank (from the plan), unlike wsched.empty
            return dict
        template = self.own(self.first, weights)
        numel = sum(w.numel() for w in template)
        parts = [torch.cat([w.detach().reshape(-1) for w in self.own(e, weights)])
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

    # -- rows of a chunk --------------------------------------------------------------
    def put(self, dst: torch.Tensor, i: int, start: int, end: int, src: torch.Tensor) -> None:
        """Write one expert's rows (``start:end`` of chunk i's grouped order) into a
        received-order buffer."""
        index = self.recv.group[i]
        if index is None:
            dst[start:end].copy_(src)
        else:
            dst.index_copy_(0, index[start:end], src)

    def group_rows(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk i's received rows in grouped (expert-contiguous) order."""
        index = self.recv.group[i]
        return t if index is None else t.index_select(0, index)

    def ungroup(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """The inverse of ``group_rows``."""
        index = self.recv.group[i]
        if index is None:
            return t
        return torch.empty_like(t).index_copy_(0, index, t)

    def leaf(self, e: int, weights, helper) -> tuple[torch.Tensor, ...]:
        """Expert e's weights as autograd inputs: a native expert's own parameters
        (``autograd.grad`` w.r.t. them returns the gradient without accumulating it, so no
        gradient hook fires here), detached leaves of a helper copy."""
        if self.first <= e < self.first + self.e_local:
            return self.own(e, weights)
        return tuple(w.detach().requires_grad_() for w in helper[e])

    def leaves(self, i: int, weights, helper) -> dict:
        """``leaf`` of every expert computed in chunk i."""
        return {e: self.leaf(e, weights, helper) for e, _, _ in self.recv.segments[i]}

    def packable(self, tensors: Sequence[torch.Tensor]) -> bool:
        return self.p > 1 and len(tensors) > 1 and len({t.dtype for t in tensors}) == 1

    def pack(self, parts: Sequence[tuple[torch.Tensor, Optional[torch.Tensor]]],
              group: Optional[torch.Tensor] = None):
        """Rows of several tensors as what one all-to-all sends: ``(tensors, widths)``.

        ``parts`` are ``(source, index)``: with ``group=None`` the rows ``source[index]``
        (``index=None``: all rows); with ``group``, ``source`` scattered to rows ``group``
        (the inverse of ``group_rows``). Sources of one dtype are written straight into one
        ``[rows, Σ widths]`` buffer — one collective per round instead of one per tensor (the
        rounds are latency-bound at small chunks), and no temporary per tensor.
        """
        sources = [src for src, _ in parts]
        if not self.packable(sources):
            out = []
            for src, index in parts:
                if group is not None:
                    out.append(torch.empty_like(src).index_copy_(0, group, src))
                else:
                    out.append(src if index is None else src.index_select(0, index))
            return out, None
        rows = sources[0].shape[0] if parts[0][1] is None else parts[0][1].numel()
        views, packed = self.empty_packed(sources, rows)
        for (src, index), view in zip(parts, views):
            if group is not None:
                view.index_copy_(0, group, src)
            elif index is None:
                view.copy_(src)
            else:
                torch.index_select(src, 0, index, out=view)
        return packed

    def empty_packed(self, like: Sequence[torch.Tensor], rows: int):
        """Uninitialised ``rows``-row buffers shaped and typed like ``like``'s rows, in one
        packed buffer when ``packable``: ``(views to fill, what _a2a sends)``."""
        if not self.packable(like):
            views = [t.new_empty((rows,) + tuple(t.shape[1:])) for t in like]
            return views, (views, None)
        widths = [t.shape[1] if t.dim() == 2 else 0 for t in like]
        buf = like[0].new_empty((rows, sum(max(w, 1) for w in widths)))
        return columns(buf, widths), ([buf], widths)

    def a2a(self, packed, i: int, *, back: bool) -> Pending:
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

    def return_helper_grads(self, acc: dict, weights: Sequence[torch.Tensor]) -> None:
        """Helpers send spilled experts' weight gradients to the owners, who add them."""
        if not self.transfers:
            return
        template = self.own(self.first, weights)
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
                own = self.own(e, weights)
                if all(main_grad(w) is not None for w in own):
                    add_all([w.main_grad for w in own], pieces)
                    for w in own:
                        mark_added(w)
                elif e in acc:
                    add_all(acc[e], pieces)
                else:
                    acc[e] = [g.clone() for g in pieces]
