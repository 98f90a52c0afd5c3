"""Per-step communication schedule of LLEP / PipelinedLLEP: pure index arithmetic.

Given this rank's routes, the plan (:mod:`megatron_flat.dispatch.plan`) and the chunking, these
functions say what goes where in every round, without touching a process group:

* :func:`routes_from_map` / :func:`routes_from_topk` — this rank's routes in *expert-major*
  order (by expert, then token): the order of Megatron's ``permute`` and of the expert's global
  token list restricted to this rank.
* :func:`send_schedule` — per chunk, the routes sent to each destination (expert-major within a
  destination), the all-to-all split sizes, the per-(destination, chunk, expert) counts the
  receivers need, and how to restore expert-major order for the combine.
* :func:`receive_schedule` — from the counts each source sent: per chunk, the receive split
  sizes and the permutation that groups the received routes by expert (expert, then source
  rank, then source order: each expert's global token list order, which is also the order of
  Megatron's alltoall dispatcher after ``sort_chunks_by_idxs``).
* :func:`weight_schedule` — which expert weights go from owners to helpers (and gradients back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_flat.dispatch.plan import MEMBERSHIPS, LLEPPlan
from megatron_flat.runtime.staging import upload_together

__all__ = ["ReceivePlan", "ReceiveSchedule", "SendSchedule", "WeightSchedule", "count_keys",
           "receive_plan", "receive_schedule",
           "routes_from_map", "routes_from_topk", "send_schedule", "token_chunks",
           "weight_schedule"]


def routes_from_map(routing_map: torch.Tensor,
                    routes: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token, expert)`` int64 of every ``True`` of a ``[N, E]`` routing map, expert-major.

    ``routes``: how many ``True`` the map holds when the caller knows it (top-k routing
    without token dropping: N·k); the routes are then found without reading the count on
    the host (``nonzero``'s output size depends on the data: a host sync on a GPU). A map
    with another count gives wrong routes then: pass None when unsure.
    """
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError("routing_map must be a [N, E] bool tensor")
    if routes is None:
        expert, token = routing_map.t().nonzero(as_tuple=True)
        return token, expert
    index = torch.nonzero_static(routing_map.t(), size=routes, fill_value=-1)
    return index[:, 1], index[:, 0]


def routes_from_topk(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token, expert, flat_index)`` of ``[N, k]`` expert ids, expert-major.

    ``flat_index`` is each route's position in ``expert_ids.reshape(-1)`` (to reorder per-slot
    tensors such as router probabilities). Raises ``ValueError`` if a token names one expert
    twice (a route must be unique per (token, expert), as Megatron's top-k guarantees).
    """
    if expert_ids.dim() != 2:
        raise ValueError("expert_ids must be a [N, k] tensor")
    n, k = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.long)
    token = torch.arange(n, device=flat.device).repeat_interleave(k)
    key = flat * max(n, 1) + token
    order = torch.argsort(key, stable=True)
    if order.numel() > 1 and bool((key[order][1:] == key[order][:-1]).any()):
        raise ValueError("expert_ids routes a token to the same expert twice")
    return token[order], flat[order], order


def token_chunks(n_tokens: int, num_chunks: int, membership: str,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """``[N]`` int64 on ``device``: the chunk of each token under
    :func:`~megatron_flat.dispatch.plan.chunk_indices`' membership rule (strided: ``t mod
    K``; contiguous: ``t // ceil(N / K)``), made there from an ``arange`` (no host data to
    upload)."""
    if membership not in MEMBERSHIPS:
        raise ValueError(f"membership must be one of {', '.join(MEMBERSHIPS)}, "
                         f"got {membership!r}")
    position = torch.arange(n_tokens, dtype=torch.long, device=device)
    if membership == "strided":
        return position.remainder(num_chunks)
    return position.div(max(-(-n_tokens // num_chunks), 1), rounding_mode="floor")


@dataclass
class SendSchedule:
    """What this source rank sends in each of K rounds.

    * ``order``: expert-major route indices grouped by (chunk, destination); within a
      (chunk, destination) block still expert-major. Block of chunk i is
      ``order[bounds[i]:bounds[i + 1]]``.
    * ``splits[i][d]``: routes sent to destination d in chunk i (all_to_all input splits).
    * ``restore[i]``: positions within chunk i's block, in expert-major order (the combine adds a
      token's routes in this order, as Megatron's ``unpermute`` does).
    * ``counts``: ``[P, K, E]`` routes per (destination, chunk, expert) on the device (None
      when not asked for): what the plan says the receivers get, for checks.
    """

    order: torch.Tensor
    counts: Optional[torch.Tensor]
    bounds: list[int] = field(default_factory=list)
    splits: list[list[int]] = field(default_factory=list)
    restore: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_chunks(self) -> int:
        return len(self.splits)

    def chunk(self, i: int) -> torch.Tensor:
        return self.order[self.bounds[i]:self.bounds[i + 1]]

    def finalize(self, host_counts: torch.Tensor) -> "SendSchedule":
        """Fill ``bounds``, ``splits`` and ``restore`` from ``counts`` copied to the host."""
        host = host_counts.to("cpu", torch.long)
        if self.counts is not None and tuple(host.shape) != tuple(self.counts.shape):
            raise ValueError(f"host counts of shape {tuple(host.shape)} for a schedule of "
                             f"{tuple(self.counts.shape)}")
        return self.finalize_splits(host.sum(2).t().tolist())

    def finalize_splits(self, splits: list[list[int]]) -> "SendSchedule":
        """Fill ``bounds``, ``splits`` and ``restore`` from the split sizes ``[K][P]`` the
        host already knows (the plan gives every rank's), so building the schedule reads
        nothing from the device."""
        self.splits = [list(row) for row in splits]
        self.bounds = [0]
        for row in self.splits:
            self.bounds.append(self.bounds[-1] + sum(row))
        self.restore = [torch.argsort(self.chunk(i)) for i in range(len(self.splits))]
        return self


def count_keys(key: torch.Tensor, size: int) -> torch.Tensor:
    """``bincount(key, minlength=size)`` for keys known to lie in [0, size), without
    reading the data on the host (bincount's output size depends on it)."""
    out = torch.zeros(size, dtype=torch.long, device=key.device)
    return out.index_add_(0, key, torch.ones_like(key))


def send_schedule(route_token: torch.Tensor, route_expert: torch.Tensor,
                  destinations: torch.Tensor, token_chunk: torch.Tensor, *, num_chunks: int,
                  ep_size: int, num_experts: int, finalize: bool = True,
                  with_counts: bool = True) -> SendSchedule:
    """The :class:`SendSchedule` of expert-major routes ``(route_token, route_expert)`` whose
    compute ranks are ``destinations``, tokens chunked by ``token_chunk``.

    ``finalize=False`` leaves the host-side fields empty: call
    :meth:`SendSchedule.finalize_splits` with the split sizes the plan gives (no host sync
    here); True copies ``counts`` to the host now. ``with_counts=False`` (only with
    ``finalize=False``) skips the ``[P, K, E]`` device counts, which only checks need.
    """
    if finalize and not with_counts:
        raise ValueError("finalize=True reads the counts: with_counts must be True")
    k, p, e = num_chunks, ep_size, num_experts
    chunk = token_chunk[route_token] if route_token.numel() else route_token
    key = chunk * p + destinations
    order = torch.argsort(key, stable=True)
    counts = None
    if with_counts:
        counts = count_keys(key * e + route_expert, k * p * e).view(k, p, e) \
            .permute(1, 0, 2).contiguous()
    schedule = SendSchedule(order=order, counts=counts)
    if finalize:
        schedule.finalize(schedule.counts.cpu())
    return schedule


@dataclass
class ReceiveSchedule:
    """What this destination rank receives in each of K rounds.

    * ``splits[i][s]``: routes received from source s in chunk i (all_to_all output splits).
    * ``group[i]``: for each grouped row (expert, then source, then source order), the row of
      the received buffer it comes from (on the device); ``None`` when that is the identity.
    * ``segments[i]``: ``(expert, start, end)`` of each expert with routes, in the grouped buffer.
    * ``counts``: ``[P, K, E_c]`` as received (routes from each source, per chunk and expert),
      for the experts ``experts`` this rank computes (``E_c``; all E when not given).
    """

    splits: list[list[int]]
    group: list[Optional[torch.Tensor]]
    segments: list[list[tuple[int, int, int]]]
    counts: torch.Tensor
    experts_computed: list[int] = field(default_factory=list)

    @property
    def totals(self) -> list[int]:
        """Routes received in each chunk."""
        return [sum(s) for s in self.splits]

    @property
    def experts(self) -> set[int]:
        """Every expert this rank computes in some chunk."""
        return {e for seg in self.segments for e, _, _ in seg}


@dataclass
class ReceivePlan:
    """The host half of a :class:`ReceiveSchedule`: splits and segments, and per chunk the
    recipe of its grouping permutation — ``(delta, lens, total)``: grouped row j comes from
    received row ``j + delta[run]`` of its (expert, source) run of ``lens[run]`` rows — or
    None where the received order is already grouped. :meth:`tables` are what the device
    needs (int64, for one upload); :meth:`on_device` builds the permutations there from
    them (no host data read: the sizes are known here)."""

    splits: list[list[int]]
    segments: list[list[tuple[int, int, int]]]
    recipes: list[Optional[tuple[torch.Tensor, torch.Tensor, int]]]
    counts: torch.Tensor
    experts: list[int]

    def tables(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, recipe in enumerate(self.recipes):
            if recipe is not None:
                out[f"recv_delta{i}"], out[f"recv_lens{i}"] = recipe[0], recipe[1]
        return out

    def on_device(self, uploaded: dict[str, torch.Tensor]) -> ReceiveSchedule:
        """The schedule, its grouping permutations made on the device from ``uploaded``
        (:meth:`tables` after the upload): three ops per chunk that needs one."""
        group: list[Optional[torch.Tensor]] = []
        for i, recipe in enumerate(self.recipes):
            if recipe is None:
                group.append(None)
                continue
            delta, lens = uploaded[f"recv_delta{i}"], uploaded[f"recv_lens{i}"]
            total = recipe[2]
            group.append(torch.repeat_interleave(delta, lens, output_size=total)
                         + torch.arange(total, device=delta.device))
        return ReceiveSchedule(splits=self.splits, group=group, segments=self.segments,
                               counts=self.counts, experts_computed=self.experts)


def receive_plan(counts: torch.Tensor, experts: Optional[Sequence[int]] = None) -> ReceivePlan:
    """The :class:`ReceivePlan` from ``[P_src, K, E_c]`` host counts (what each source sends
    this rank per chunk and expert) for the experts ``experts`` (ascending; ``range(E_c)``
    when None). Host work O(K · P · E_c): only the experts this rank computes."""
    counts = counts.to("cpu", torch.long)
    p, k, ec = counts.shape
    experts = list(range(ec)) if experts is None else list(experts)
    if len(experts) != ec:
        raise ValueError(f"{len(experts)} experts for counts of {ec}")
    splits, segments, recipes = [], [], []
    per_source = counts.sum(2).t().tolist()                # [K][P]
    per_expert = counts.sum(0).tolist()                    # [K][E_c]
    for i in range(k):
        block = counts[:, i, :]                      # [P, E_c], received order: source-major
        splits.append(per_source[i])
        seg, cursor = [], 0
        for j, n in enumerate(per_expert[i]):
            if n:
                seg.append((experts[j], cursor, cursor + n))
                cursor += n
        segments.append(seg)
        flat = block.reshape(-1)
        offsets = (torch.cumsum(flat, 0) - flat).view(p, ec)
        starts, lens = offsets.t().reshape(-1), block.t().reshape(-1)  # grouped: expert-major
        delta = starts - (torch.cumsum(lens, 0) - lens)
        if bool((delta[lens > 0] == 0).all()):
            recipes.append(None)
        else:
            recipes.append((delta, lens, cursor))
    return ReceivePlan(splits=splits, segments=segments, recipes=recipes, counts=counts,
                       experts=experts)


def receive_schedule(counts: torch.Tensor, experts: Optional[Sequence[int]] = None,
                     device: Optional[torch.device] = None) -> ReceiveSchedule:
    """The :class:`ReceiveSchedule` from ``[P_src, K, E_c]`` counts (each source's
    ``counts[me]``), its permutations on ``device`` (the host when None), uploaded in one
    copy."""
    plan = receive_plan(counts, experts)
    return plan.on_device(upload_together(plan.tables(), device or torch.device("cpu")))


@dataclass
class WeightSchedule:
    """Expert weights moved for one step: ``send[h]`` the experts this rank (their owner)
    sends to helper h, ``recv[o]`` the experts this rank (a helper) receives from owner o;
    both sorted by expert id. Gradients travel the reverse way."""

    send: list[list[int]]
    recv: list[list[int]]

    @property
    def empty(self) -> bool:
        """Nothing moves to or from *this* rank (other ranks may still exchange weights:
        whether to run the collective is decided from the plan, the same on every rank)."""
        return not any(self.send) and not any(self.recv)

    @property
    def helper_experts(self) -> list[int]:
        """Experts this rank computes for their owners, in receive-buffer order."""
        return [e for experts in self.recv for e in experts]


def weight_schedule(plan: LLEPPlan, rank: int) -> WeightSchedule:
    """Which spilled experts' weights ``rank`` sends and receives under ``plan``."""
    p = plan.ep_size
    send: list[list[int]] = [[] for _ in range(p)]
    recv: list[list[int]] = [[] for _ in range(p)]
    for expert, owner, helper in plan.weight_transfers:  # sorted by expert
        if owner == rank:
            send[helper].append(expert)
        if helper == rank:
            recv[owner].append(expert)
    return WeightSchedule(send=send, recv=recv)
