"""One LLEP plan split over K chunks, with every count known on every rank (DESIGN.md §2.1).

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
* :func:`chunk_flows`: ``[P_src, P_dst, K, E]`` routes each source sends each destination per
  chunk and expert: every rank's all-to-all split sizes and the counts a receiver groups its
  rows by — so no counts are exchanged per chunk;
* :func:`chunk_route_destinations`: the compute rank of each of this rank's routes (on the
  routes' device; host loops only over spilled (chunk, expert) lists).

With K = 1 the ranges are the plan's own and the destinations those of
:func:`~megatron_flat.dispatch.plan.route_destinations`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_flat.dispatch.plan import LLEPPlan

__all__ = ["chunk_flows", "chunk_ranges", "chunk_route_destinations", "split_lists"]

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
    :func:`chunk_flows` and :func:`chunk_route_destinations` both need it: compute it once
    and pass it as their ``lists``."""
    k, e = len(ranges), plan.num_experts
    whole = torch.arange(e).div(e // plan.ep_size, rounding_mode="floor").expand(k, e).clone()
    split = []
    if plan.llep:  # a plain-EP plan splits nothing: every list on its owner
        for i in range(k):
            for ex in range(e):
                r = ranges[i][ex]
                if len(r) == 1:
                    whole[i, ex] = r[0][0]
                elif len(r) > 1:
                    whole[i, ex] = -1
                    split.append((i, ex))
    return whole, split


def chunk_flows(plan: LLEPPlan, ranges: list[list[list[Range]]], counts: torch.Tensor,
                lists: Optional[tuple] = None) -> torch.Tensor:
    """``[P_src, P_dst, K, E]`` int64 (host): routes source s sends destination d in chunk i
    for expert e, from every source's ``counts`` ``[P, K, E]`` (host) and the chunk ranges
    (``lists``: their :func:`split_lists`, when already made)."""
    counts = counts.to("cpu", torch.long)
    p, k, e = counts.shape
    whole, split = lists if lists is not None else split_lists(plan, ranges)
    flows = torch.zeros(p, p, k, e, dtype=torch.long)
    kept = counts.masked_fill(whole < 0, 0)      # split lists are filled range by range
    flows.scatter_(1, whole.clamp(min=0).view(1, 1, k, e).expand(p, 1, k, e),
                   kept.view(p, 1, k, e))
    for i, ex in split:
        c = counts[:, i, ex]
        first = torch.cumsum(c, 0) - c          # each source's first position in the list
        for g, start, end in ranges[i][ex]:
            take = (torch.minimum(first + c, torch.tensor(end))
                    - torch.maximum(first, torch.tensor(start))).clamp(min=0)
            flows[:, g, i, ex] += take
    return flows


def chunk_route_destinations(route_expert: torch.Tensor, route_chunk: torch.Tensor,
                             counts: torch.Tensor, plan: LLEPPlan,
                             ranges: list[list[list[Range]]], rank: int,
                             lists: Optional[tuple] = None) -> torch.Tensor:
    """``[R]`` int64 on the routes' device: the compute rank of each of this rank's routes
    (expert-major ``route_expert``, their chunks ``route_chunk``), given every source's
    ``counts`` ``[P, K, E]`` (host) and the chunk ranges. Only routes of (chunk, expert)
    lists the plan splits are looked up; the others go where their one range is."""
    device = route_expert.device
    p, k, e = counts.shape
    if not plan.llep:
        return route_expert.div(e // p, rounding_mode="floor")
    whole, split = lists if lists is not None else split_lists(plan, ranges)
    counts = counts.to("cpu", torch.long)
    lists = counts.sum(0).reshape(-1)                  # l_ei, (chunk, expert)-major
    base = torch.cumsum(lists, 0) - lists
    starts, ranks = [], []
    for i, ex in split:
        for g, start, _ in ranges[i][ex]:
            starts.append(int(base[i * e + ex]) + start)
            ranks.append(g)
    key = route_chunk * e + route_expert
    dest = whole.reshape(-1).to(device)[key]
    if not starts:
        return dest
    # Position of each route in its chunk's expert list: earlier sources' routes first, then
    # this rank's routes of that (chunk, expert) in their expert-major order.
    mine = counts[rank].reshape(-1)
    before = (counts[:rank].sum(0).reshape(-1) + base).to(device)
    order = torch.sort(key, stable=True).indices
    local = torch.empty_like(key)
    local[order] = torch.arange(key.numel(), device=device) \
        - (torch.cumsum(mine, 0) - mine).to(device)[key[order]]
    position = before[key] + local
    at = torch.searchsorted(torch.tensor(starts, device=device), position, right=True) - 1
    split_dest = torch.tensor(ranks, dtype=torch.long, device=device)[at.clamp(min=0)]
    return torch.where(dest < 0, split_dest, dest)
