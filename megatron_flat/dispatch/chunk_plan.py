"""One LLEP plan split over K chunks, with every count known on every rank (architecture.md §2.1).

The engine all-reduces every source rank's route counts per (chunk, expert), ``[P, K, E]``,
once per call. From those and the plan (made with the chunk loads in mind,
:func:`~megatron_flat.dispatch.plan.llep_plan`'s ``chunk_loads``) every rank derives the
whole schedule of every rank without communicating again:

* :func:`chunk_ranges`: per chunk i and expert e, ``(rank, start, end)`` ranges over the
  *chunk's expert list* (the routes of chunk i to expert e from every source rank, in rank
  order, within a rank in its expert-major order). Each helper range of length p in the
  plan gets ``floor(p · l_ei / l_e)`` of the chunk's routes, so a piece that clears the
  plan's smallest-share rule gives every chunk's helper GEMM at least m rows; the owner
  takes the rest (the rounding: fewer than one route per helper per chunk);
* :func:`rank_schedule`: this rank's share of it — its send split sizes ``[K][P]``, what it
  receives from every source per chunk for the experts it computes ``[P, K, E_c]``, and the
  tables its routes' destinations are looked up in on the device. Host work and memory are
  O(P·K·E) (the counts themselves) plus O(P) per spilled (chunk, expert) list: a rank never
  builds the other ranks' rows and columns;
* :func:`route_destinations_on_device`: the compute rank of each of this rank's routes from
  those tables (device ops only; the tables arrive in the call's one upload);
* :func:`chunk_flows` / :func:`chunk_route_destinations`: the whole ``[P_src, P_dst, K, E]``
  flow table and the destinations in one call — references for tests and tools (O(P²·K·E)).

With K = 1 the ranges are the plan's own and the destinations those of
:func:`~megatron_flat.dispatch.plan.route_destinations`.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from megatron_flat.dispatch.plan import LLEPPlan, plan_dispatch
from megatron_flat.runtime.staging import upload_together

__all__ = ["RankSchedule", "chunk_flows", "chunk_ranges", "chunk_route_destinations",
           "plan_rank", "rank_schedule", "route_destinations_on_device", "send_row",
           "split_lists"]

Range = tuple[int, int, int]


def chunk_ranges(plan: LLEPPlan, chunk_loads: Sequence[Sequence[int]]) -> list[list[list[Range]]]:
    """``[K][E]`` ranges over each chunk's expert list (see the module docstring). The ranges
    of one (chunk, expert) tile ``[0, l_ei)`` in the plan's order (owner first), without
    empty ranges; adjacent ranges of one rank are merged."""
    loads = plan.expert_loads
    if any(len(row) != plan.num_experts for row in chunk_loads) \
            or [sum(col) for col in zip(*chunk_loads)] != loads:
        raise ValueError("chunk_loads must be [K][E] and sum over the chunks to the plan's "
                         "expert loads")
    out = []
    for row in chunk_loads:
        per_chunk = []
        for e, l_ei in enumerate(row):
            l_ei = int(l_ei)
            ranges = plan.assignments[e]
            if l_ei == 0:
                per_chunk.append([])
                continue
            if len(ranges) == 1:
                per_chunk.append([(ranges[0][0], 0, l_ei)])
                continue
            owner, l_e = plan.owner(e), loads[e]
            helper = [(t - s) * l_ei // l_e for g, s, t in ranges if g != owner]
            rest = l_ei - sum(helper)
            sizes, found, shares = [], False, iter(helper)
            for g, _, _ in ranges:
                if g == owner:
                    sizes.append((g, 0 if found else rest))
                    found = True
                else:
                    sizes.append((g, next(shares)))
            if not found:
                sizes.insert(0, (owner, rest))
            merged: list[Range] = []
            cursor = 0
            for g, size in sizes:
                if size == 0:
                    continue
                if merged and merged[-1][0] == g:
                    merged[-1] = (g, merged[-1][1], cursor + size)
                else:
                    merged.append((g, cursor, cursor + size))
                cursor += size
            per_chunk.append(merged)
        out.append(per_chunk)
    return out


def split_lists(plan: LLEPPlan,
                ranges: list[list[list[Range]]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``([K, E] rank, split)``: the one rank of each (chunk, expert) list the plan does not
    split (its owner when empty), -1 for each it splits, and the split ones' ``(i, e)``.
    Everything below needs it: compute it once and pass it as their ``lists``."""
    k, e = len(ranges), plan.num_experts
    owners = [ex // (e // plan.ep_size) for ex in range(e)]
    if not plan.llep:  # a plain-EP plan splits nothing: every list on its owner
        return torch.tensor(owners, dtype=torch.long).expand(k, e).clone(), []
    # Python lists, one tensor at the end: element writes into a tensor cost microseconds
    # each, and there are K·E of them (3,840 at the paper's shape).
    rows, split = [], []
    for i, row in enumerate(ranges):
        out = owners.copy()
        for ex, r in enumerate(row):
            if len(r) == 1:
                out[ex] = r[0][0]
            elif r:
                out[ex] = -1
                split.append((i, ex))
        rows.append(out)
    return torch.tensor(rows, dtype=torch.long).view(k, e), split


def _pieces(c: list[int], ranges: Sequence[Range], source: int) -> Iterator[tuple[int, int]]:
    """``(rank, routes)`` of source ``source``'s part of one split list, whose per-source
    counts are ``c`` (sources' routes lie in rank order along the list)."""
    first = sum(c[:source])
    last = first + c[source]
    for g, start, end in ranges:
        take = min(last, end) - max(first, start)
        if take > 0:
            yield g, take


def _sources(prefix: list[int], start: int, end: int) -> Iterator[tuple[int, int]]:
    """``(source, routes)`` of every source with routes in positions ``[start, end)`` of a
    split list whose sources begin at ``prefix`` (``prefix[s]``: source s's first position,
    ``prefix[P]`` the list's length): only the sources the range overlaps are visited."""
    s = bisect.bisect_right(prefix, start) - 1
    while s < len(prefix) - 1 and prefix[s] < end:
        take = min(prefix[s + 1], end) - max(prefix[s], start)
        if take > 0:
            yield s, take
        s += 1


def send_row(counts: torch.Tensor, plan: LLEPPlan, ranges: list[list[list[Range]]], rank: int,
             lists: Optional[tuple] = None) -> torch.Tensor:
    """``[P_dst, K, E]`` int64 (host): the routes ``rank`` sends each destination per chunk and
    expert, from every source's ``counts`` ``[P, K, E]`` (host)."""
    counts = counts.to("cpu", torch.long)
    p, k, e = counts.shape
    whole, split = lists if lists is not None else split_lists(plan, ranges)
    row = torch.zeros(p, k, e, dtype=torch.long)
    kept = counts[rank].masked_fill(whole < 0, 0)   # split lists are filled range by range
    row.scatter_(0, whole.clamp(min=0).unsqueeze(0), kept.unsqueeze(0))
    for i, ex in split:
        for g, take in _pieces(counts[:, i, ex].tolist(), ranges[i][ex], rank):
            row[g, i, ex] += take
    return row


def chunk_flows(plan: LLEPPlan, ranges: list[list[list[Range]]], counts: torch.Tensor,
                lists: Optional[tuple] = None) -> torch.Tensor:
    """``[P_src, P_dst, K, E]`` int64 (host): routes source s sends destination d in chunk i
    for expert e (every rank's :func:`send_row`). O(P²·K·E): a reference for tests and tools;
    the engine builds only its own row and column (:func:`rank_schedule`)."""
    lists = lists if lists is not None else split_lists(plan, ranges)
    return torch.stack([send_row(counts, plan, ranges, s, lists)
                        for s in range(counts.shape[0])])


@dataclass
class RankSchedule:
    """One rank's share of a chunked plan, all on the host (see :func:`rank_schedule`).

    * ``send_splits[i][d]``: routes this rank sends destination d in chunk i;
    * ``experts``: the experts this rank computes in some chunk (its native ones and the
      spilled ones it helps with), ascending — ``E_c`` of them;
    * ``receive_counts``: ``[P_src, K, E_c]`` routes each source sends it per chunk and expert;
    * ``tables``: int64 host tensors the device needs to find each route's destination
      (:func:`route_destinations_on_device`); empty for a plain-EP plan;
    * ``ranges``: the chunk ranges it was made from (:func:`chunk_ranges`).
    """

    send_splits: list[list[int]]
    experts: list[int]
    receive_counts: torch.Tensor
    tables: dict[str, torch.Tensor]
    ranges: list[list[list[Range]]]


def rank_schedule(counts: torch.Tensor, plan: LLEPPlan, ranges: list[list[list[Range]]],
                  rank: int, lists: Optional[tuple] = None) -> RankSchedule:
    """This rank's :class:`RankSchedule`, from every source's ``counts`` ``[P, K, E]`` (host),
    the plan and its chunk ranges: its row of :func:`chunk_flows` summed over the experts,
    its column restricted to the experts it computes, and its destination tables — without
    building any other rank's row or column."""
    counts = counts.to("cpu", torch.long)
    p, k, e = counts.shape
    whole, split = lists if lists is not None else split_lists(plan, ranges)
    mine = counts[rank]                                                  # [K, E]
    sends = torch.zeros(k, p, dtype=torch.long)
    sends.scatter_add_(1, whole.clamp(min=0), mine.masked_fill(whole < 0, 0))
    e_local = e // p
    helped = {ex for ex in range(e) for g, _, _ in plan.assignments[ex] if g == rank}
    experts = sorted(set(range(rank * e_local, (rank + 1) * e_local)) | helped)
    column = {ex: j for j, ex in enumerate(experts)}
    index = torch.tensor(experts, dtype=torch.long)
    received = counts.index_select(2, index) * (whole.index_select(1, index) == rank)
    if split:
        # every split list's per-source counts in one read: [S][P]
        at = torch.tensor(split, dtype=torch.long)
        per_list = counts[:, at[:, 0], at[:, 1]].t().tolist()
        added: list[tuple[int, int, int, int]] = []    # (source, chunk, column, routes)
        pieces: list[tuple[int, int, int]] = []       # (chunk, destination, routes)
        for (i, ex), c in zip(split, per_list):
            pieces += [(i, g, take) for g, take in _pieces(c, ranges[i][ex], rank)]
            if ex in column:
                prefix = [0, *itertools.accumulate(c)]
                for g, start, end in ranges[i][ex]:
                    if g == rank:
                        added += [(s, i, column[ex], n) for s, n in _sources(prefix, start, end)]
        if added:
            s_, i_, j_, n_ = torch.tensor(added, dtype=torch.long).unbind(1)
            received.index_put_((s_, i_, j_), n_, accumulate=True)
        if pieces:  # one op, not one per piece
            i_, g_, n_ = torch.tensor(pieces, dtype=torch.long).unbind(1)
            sends.index_put_((i_, g_), n_, accumulate=True)
    return RankSchedule(send_splits=sends.tolist(), experts=experts, receive_counts=received,
                        tables=destination_tables(counts, plan, ranges, rank, (whole, split)),
                        ranges=ranges)


def destination_tables(counts: torch.Tensor, plan: LLEPPlan, ranges: list[list[list[Range]]],
                       rank: int, lists: tuple) -> dict[str, torch.Tensor]:
    """The host tables :func:`route_destinations_on_device` reads: ``whole`` (``[K·E]``: the
    one rank of each (chunk, expert) list, -1 where split) and, when some list is split,
    ``starts``/``ranks`` (each split range's start along the lists laid end to end, and its
    rank), ``before`` (``[K·E]``: where this rank's routes of each list begin there) and
    ``mine`` (``[K·E]``: where each list's routes begin among this rank's routes). A plain-EP
    plan needs none (each route goes to its expert's owner)."""
    if not plan.llep:
        return {}
    whole, split = lists
    tables = {"whole": whole.reshape(-1)}
    if not split:
        return tables
    k, e = whole.shape
    lengths = counts.sum(0).reshape(-1)                  # l_ei, (chunk, expert)-major
    base = torch.cumsum(lengths, 0) - lengths
    base_list = base.tolist()
    starts, ranks = [], []
    for i, ex in split:
        for g, start, _ in ranges[i][ex]:
            starts.append(base_list[i * e + ex] + start)
            ranks.append(g)
    mine = counts[rank].reshape(-1)
    tables.update(starts=torch.tensor(starts, dtype=torch.long),
                  ranks=torch.tensor(ranks, dtype=torch.long),
                  before=counts[:rank].sum(0).reshape(-1) + base,
                  mine=torch.cumsum(mine, 0) - mine)
    return tables


def route_destinations_on_device(route_expert: torch.Tensor, route_chunk: torch.Tensor,
                                 tables: dict[str, torch.Tensor], *, num_experts: int,
                                 ep_size: int) -> torch.Tensor:
    """``[R]`` int64 on the routes' device: the compute rank of each of this rank's
    expert-major routes (their chunks ``route_chunk``), from :func:`destination_tables`
    already on that device. Device ops only: nothing is read on the host."""
    e = num_experts
    if "whole" not in tables:  # plain EP: every route to its expert's owner
        return route_expert.div(e // ep_size, rounding_mode="floor")
    key = route_chunk * e + route_expert
    dest = tables["whole"][key]
    if "starts" not in tables:
        return dest
    # Position of each route in its chunk's expert list: earlier sources' routes first, then
    # this rank's routes of that (chunk, expert) in their expert-major order.
    order = torch.sort(key, stable=True).indices
    local = torch.empty_like(key)
    local[order] = torch.arange(key.numel(), device=key.device) - tables["mine"][key[order]]
    position = tables["before"][key] + local
    at = torch.searchsorted(tables["starts"], position, right=True) - 1
    return torch.where(dest < 0, tables["ranks"][at.clamp(min=0)], dest)


def chunk_route_destinations(route_expert: torch.Tensor, route_chunk: torch.Tensor,
                             counts: torch.Tensor, plan: LLEPPlan,
                             ranges: list[list[list[Range]]], rank: int,
                             lists: Optional[tuple] = None) -> torch.Tensor:
    """``[R]`` int64 on the routes' device: the compute rank of each of this rank's routes
    (expert-major ``route_expert``, their chunks ``route_chunk``), given every source's
    ``counts`` ``[P, K, E]`` (host) and the chunk ranges: :func:`destination_tables` uploaded
    in one copy, then :func:`route_destinations_on_device`."""
    counts = counts.to("cpu", torch.long)
    p, _, e = counts.shape
    lists = lists if lists is not None else split_lists(plan, ranges)
    tables = upload_together(destination_tables(counts, plan, ranges, rank, lists),
                             route_expert.device)
    return route_destinations_on_device(route_expert, route_chunk, tables, num_experts=e,
                                        ep_size=p)


def plan_rank(counts: torch.Tensor, rank: int, *, alpha: float = 1.0,
              min_tokens_per_gemm: int = 1024,
              imbalance_threshold: float = 1.3) -> tuple[LLEPPlan, RankSchedule]:
    """All of one call's host planning, from every source's route counts ``[P, K, E]``
    (host, as all-reduced): the plan (:func:`~megatron_flat.dispatch.plan.plan_dispatch`,
    made with each chunk's loads in mind when K > 1), its chunk ranges and this rank's
    :class:`RankSchedule`. Pure and deterministic: every rank gets the same plan."""
    counts = counts.to("cpu", torch.long)
    p, k, _ = counts.shape
    chunk_loads = counts.sum(0).tolist()                  # [K][E]
    plan = plan_dispatch(counts.sum((0, 1)), p, alpha=alpha,
                         min_tokens_per_gemm=min_tokens_per_gemm,
                         imbalance_threshold=imbalance_threshold,
                         chunk_loads=chunk_loads if k > 1 else None)
    ranges = chunk_ranges(plan, chunk_loads)
    return plan, rank_schedule(counts, plan, ranges, rank)
