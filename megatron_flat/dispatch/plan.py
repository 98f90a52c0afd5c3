"""PipelinedLLEP planning (architecture.md §2.1): pure functions, ints and tensors in, plans out.

Nothing here touches a process group. Every function is deterministic, so each rank of an
expert-parallel (EP) group that calls it with the same inputs (the all-reduced global
per-expert counts) gets the same plan without communicating.

Vocabulary (P = EP size, E = experts, E_local = E // P, k = top-k):

* expert ``e`` is *native* to rank ``e // E_local`` (its owner);
* an expert's *global token list* is its routes from every source rank, concatenated in rank
  order, within a rank ordered by (token, slot); an :class:`LLEPPlan` cuts it into ranges;
* a *spill* is a range computed on a rank other than the owner (a *helper*), which needs the
  expert's weights for the step: a weight transfer ``(expert, owner, helper)``.

Chunking (``num_chunks``, ``chunk_indices``) splits a source rank's tokens into K rounds of
at most ``c_eff`` tokens; the plan is made once from the whole batch (with each chunk's
loads in mind, for the smallest piece per GEMM) and :mod:`.chunk_plan` splits its pieces
over the chunks.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

__all__ = [
    "MEMBERSHIPS",
    "LLEPPlan",
    "chunk_indices",
    "imbalance",
    "llep_capacity",
    "llep_plan",
    "native_rank_loads",
    "num_chunks",
    "plain_ep_plan",
    "plan_dispatch",
    "receive_bound",
    "route_destinations",
    "send_counts",
    "send_matrix",
    "use_llep",
]

MEMBERSHIPS = ("strided", "contiguous")
"""Chunk membership rules understood by :func:`chunk_indices`."""

Range = tuple[int, int, int]
LoadsLike = Union[torch.Tensor, Sequence[int]]


@dataclass
class LLEPPlan:
    """Where every route of every expert is computed for one MoE layer in one step.

    Contract:

    * ``assignments[e]`` lists ``(rank, start, end)`` ranges over expert ``e``'s global token
      list. The ranges are sorted by ``start`` and tile ``[0, l_e)`` exactly (no gap, no
      overlap, no empty range; ``[]`` for an expert with no tokens). Adjacent ranges on the same
      rank are merged, so a rank appears in several ranges of one expert only when other ranks'
      ranges lie between them.
    * ``rank_loads[g]`` is the number of routes rank ``g`` computes (sum of its range lengths).
    * ``weight_transfers`` lists each ``(expert, owner, helper)`` once, sorted: the helper needs
      the expert's weights for the step and returns their gradient to the owner.
    * ``cap`` is the LLEP capacity per rank, ``None`` for a plain-EP plan (``llep=False``).
    * ``forced`` lists ``(expert, rank, tokens)`` for every remainder that no rank could take
      within capacity (architecture.md §2.1 step 4, last sentence): the only way a rank ends above
      ``cap``. In fact ``rank_loads[g] <= cap + sum(tokens forced onto g)`` for every rank
      (for ``ep_size > 1``; a single rank has nowhere to spill and keeps everything).
    * ``llep`` is False for the plain-EP identity plan: each expert wholly on its owner.

    Plans compare equal field by field, so "same plan on every rank" is ``==``.
    """

    assignments: list[list[Range]]
    rank_loads: list[int]
    weight_transfers: list[tuple[int, int, int]]
    cap: Optional[int]
    forced: list[tuple[int, int, int]]
    llep: bool = True

    @property
    def num_experts(self) -> int:
        return len(self.assignments)

    @property
    def ep_size(self) -> int:
        return len(self.rank_loads)

    @property
    def experts_per_rank(self) -> int:
        """E_local: experts native to each rank."""
        return self.num_experts // self.ep_size

    @property
    def expert_loads(self) -> list[int]:
        """Global route count of each expert (the ``l_e`` the plan was made from)."""
        return [ranges[-1][2] if ranges else 0 for ranges in self.assignments]

    def owner(self, expert: int) -> int:
        """The rank expert ``expert`` is native to."""
        return expert // self.experts_per_rank


# ---------------------------------------------------------------------------- validation
def _loads_list(expert_loads: LoadsLike) -> list[int]:
    if isinstance(expert_loads, torch.Tensor):
        if expert_loads.dim() != 1:
            raise ValueError(f"expert_loads must be 1-D (one count per expert), "
                             f"got shape {tuple(expert_loads.shape)}")
        if expert_loads.is_floating_point() or expert_loads.is_complex() \
                or expert_loads.dtype == torch.bool:
            raise ValueError(f"expert_loads must be an integer tensor, got {expert_loads.dtype}")
        loads = [int(v) for v in expert_loads.tolist()]
    else:
        loads = []
        for v in expert_loads:
            if isinstance(v, bool):
                raise ValueError(f"expert_loads must hold integers, got {v!r}")
            try:
                loads.append(operator.index(v))
            except TypeError:
                raise ValueError(f"expert_loads must hold integers, got {v!r}") from None
    if not loads:
        raise ValueError("expert_loads is empty: need at least one expert")
    negative = [e for e, v in enumerate(loads) if v < 0]
    if negative:
        raise ValueError(f"expert_loads must be >= 0; expert {negative[0]} has "
                         f"{loads[negative[0]]}")
    return loads


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum`` (numpy and 0-d tensor integers accepted)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_ep(num_experts: int, ep_size: object) -> int:
    ep_size = check_int("ep_size", ep_size, 1)
    if num_experts % ep_size:
        raise ValueError(f"number of experts ({num_experts}) must be divisible by ep_size "
                         f"({ep_size})")
    return ep_size


# ---------------------------------------------------------------------------- load summary
def native_rank_loads(expert_loads: LoadsLike, ep_size: int) -> list[int]:
    """Routes each rank would compute under plain EP: the total load of its native experts."""
    loads = _loads_list(expert_loads)
    ep_size = _check_ep(len(loads), ep_size)
    per = len(loads) // ep_size
    return [sum(loads[g * per:(g + 1) * per]) for g in range(ep_size)]


def imbalance(expert_loads: LoadsLike, ep_size: int) -> float:
    """Imbalance ratio: max native rank load / mean native rank load (1.0 when all are zero)."""
    rank = native_rank_loads(expert_loads, ep_size)
    total = sum(rank)
    if total == 0:
        return 1.0
    return max(rank) * len(rank) / total


def use_llep(expert_loads: LoadsLike, ep_size: int, imbalance_threshold: float = 1.3) -> bool:
    """The adaptive switch: LLEP unless the imbalance ratio is below ``imbalance_threshold``.

    ``imbalance_threshold`` is λ; ``0`` means always LLEP (the ratio is never below 0).
    """
    if isinstance(imbalance_threshold, bool) or not isinstance(imbalance_threshold, (int, float)) \
            or not imbalance_threshold >= 0:
        raise ValueError(f"imbalance_threshold must be a number >= 0, got {imbalance_threshold!r}")
    return imbalance(expert_loads, ep_size) >= imbalance_threshold


def llep_capacity(expert_loads: LoadsLike, ep_size: int, alpha: float = 1.0) -> int:
    """Per-rank LLEP capacity ``cap = max(1, int(alpha * (sum(l) // P)))`` (§2.1 step 1)."""
    loads = _loads_list(expert_loads)
    ep_size = _check_ep(len(loads), ep_size)
    _check_alpha(alpha)
    return max(1, int(alpha * (sum(loads) // ep_size)))


def _check_alpha(alpha: object) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha (capacity factor) must be a finite number > 0, got {alpha!r}")


# ---------------------------------------------------------------------------- plans
def plain_ep_plan(expert_loads: LoadsLike, ep_size: int) -> LLEPPlan:
    """The identity plan: each expert's tokens all on its native rank, no weight transfers."""
    loads = _loads_list(expert_loads)
    ep_size = _check_ep(len(loads), ep_size)
    per = len(loads) // ep_size
    assignments = [[(e // per, 0, n)] if n else [] for e, n in enumerate(loads)]
    return LLEPPlan(assignments=assignments, rank_loads=native_rank_loads(loads, ep_size),
                    weight_transfers=[], cap=None, forced=[], llep=False)


def llep_plan(expert_loads: LoadsLike, ep_size: int, alpha: float = 1.0,
              min_tokens_per_gemm: int = 1024,
              chunk_loads: Optional[Sequence[Sequence[int]]] = None) -> LLEPPlan:
    """The least-loaded EP plan of architecture.md §2.1, steps 1-5.

    ``expert_loads`` holds the global route count ``l_e`` of each of the E experts (an integer
    tensor or sequence; E divisible by ``ep_size``). ``alpha`` is the capacity factor and
    ``min_tokens_per_gemm`` (m) the smallest spill piece worth a GEMM.

    1. ``cap = max(1, int(alpha * (sum(l) // P)))``.
    2. ``pending[g]`` = load of rank g's native experts, ``assigned[g] = 0``;
       ``eff(g) = assigned[g] + pending[g]``.
    3. Experts by load descending (ties: lower id first), zero loads skipped. For expert e with
       n tokens on owner g0: ``pending[g0] -= n``, ``avail = cap - eff(g0)``; g0 takes
       ``min(n, max(avail, 0))`` leading tokens, the rest spills.
    4. Spilling remainder r: list the other ranks by ``eff`` ascending (ties: lower rank);
       the first h with ``room = cap - eff(h) > 0`` whose piece ``p = min(r, room)`` is not small
       (small: ``share(p) < m and p < r``) takes the next p tokens; repeat until r = 0. When no
       rank qualifies the whole remainder goes to the first rank of that list (``forced``).
    5. Ranges are over the expert's global token list; every spill is a weight transfer.

    ``chunk_loads`` (``[K][E]``: each chunk's load of each expert, summing to
    ``expert_loads``): the routes are computed in K chunks and a piece is split over them in
    proportion to the expert's load per chunk (:func:`~megatron_flat.dispatch.chunk_plan.
    chunk_ranges`), so ``share(p)`` is the piece's smallest non-empty share,
    ``min_i floor(p · l_ei / l_e)`` over the chunks where the expert has routes: every helper
    GEMM of a chunk gets at least m rows (unless the piece is a whole remainder, as for
    K = 1). Without ``chunk_loads`` (or with K = 1) ``share(p) = p``.

    With ``ep_size == 1`` there is no other rank, so nothing spills (every expert stays home).
    """
    loads = _loads_list(expert_loads)
    num_experts = len(loads)
    ep_size = _check_ep(num_experts, ep_size)
    _check_alpha(alpha)
    m = check_int("min_tokens_per_gemm", min_tokens_per_gemm, 1)
    per = num_experts // ep_size
    cap = max(1, int(alpha * (sum(loads) // ep_size)))
    share = _smallest_share(loads, chunk_loads)

    pending = native_rank_loads(loads, ep_size)
    assigned = [0] * ep_size
    assignments: list[list[Range]] = [[] for _ in range(num_experts)]
    transfers: set[tuple[int, int, int]] = set()
    forced: list[tuple[int, int, int]] = []

    def eff(g: int) -> int:
        return assigned[g] + pending[g]

    def give(e: int, g: int, start: int, count: int) -> None:
        ranges = assignments[e]
        if ranges and ranges[-1][0] == g and ranges[-1][2] == start:
            ranges[-1] = (g, ranges[-1][1], start + count)
        else:
            ranges.append((g, start, start + count))
        assigned[g] += count
        if g != e // per:
            transfers.add((e, e // per, g))

    for e in sorted(range(num_experts), key=lambda x: (-loads[x], x)):
        n = loads[e]
        if n == 0:
            continue
        g0 = e // per
        pending[g0] -= n
        keep = n if ep_size == 1 else min(n, max(cap - eff(g0), 0))
        if keep:
            give(e, g0, 0, keep)
        done = keep
        while done < n:
            r = n - done
            others = sorted((g for g in range(ep_size) if g != g0), key=lambda g: (eff(g), g))
            for h in others:
                room = cap - eff(h)
                if room <= 0:
                    continue
                p = min(r, room)
                if p < r and share(e, p) < m:
                    continue
                give(e, h, done, p)
                done += p
                break
            else:
                give(e, others[0], done, r)
                forced.append((e, others[0], r))
                done = n

    return LLEPPlan(assignments=assignments, rank_loads=assigned,
                    weight_transfers=sorted(transfers), cap=cap, forced=forced, llep=True)


def _smallest_share(loads: list[int], chunk_loads: Optional[Sequence[Sequence[int]]]):
    """``share(e, p)``: the smallest non-empty per-chunk share of a piece of p of expert e's
    routes split over the chunks in proportion to its load in each (``p`` without chunks)."""
    if chunk_loads is None:
        return lambda e, p: p
    rows = [[operator.index(v) for v in row] for row in chunk_loads]
    if not rows or any(len(row) != len(loads) for row in rows) \
            or any(v < 0 for row in rows for v in row):
        raise ValueError(f"chunk_loads must be [K][E] counts >= 0 with E = {len(loads)}")
    if [sum(col) for col in zip(*rows)] != loads:
        raise ValueError("chunk_loads must sum over the chunks to expert_loads")
    # floor(p · l / l_e) grows with l, so the smallest share is the smallest load's.
    smallest = [min((row[e] for row in rows if row[e]), default=0) for e in range(len(loads))]
    return lambda e, p: p * smallest[e] // loads[e]


def plan_dispatch(expert_loads: LoadsLike, ep_size: int, *, alpha: float = 1.0,
                  min_tokens_per_gemm: int = 1024,
                  imbalance_threshold: float = 1.3,
                  chunk_loads: Optional[Sequence[Sequence[int]]] = None) -> LLEPPlan:
    """The adaptive switch (architecture.md §2.1 step 6): :func:`plain_ep_plan` when
    :func:`use_llep` says the load is balanced enough, else :func:`llep_plan` (with
    ``chunk_loads``, planned for chunked execution)."""
    if use_llep(expert_loads, ep_size, imbalance_threshold):
        return llep_plan(expert_loads, ep_size, alpha=alpha,
                         min_tokens_per_gemm=min_tokens_per_gemm, chunk_loads=chunk_loads)
    return plain_ep_plan(expert_loads, ep_size)


# ---------------------------------------------------------------------------- chunking
def num_chunks(n_tokens: int, cap: int, max_chunks: int = 10) -> tuple[int, int]:
    """Chunk count and effective chunk size for ``n_tokens`` with a per-chunk token cap.

    Returns ``(K, c_eff)`` with ``K = max(1, min(ceil(n / cap), max_chunks))`` and
    ``c_eff = ceil(n / K)`` (``(1, 0)`` for ``n = 0``). ``c_eff <= cap`` unless ``max_chunks``
    binds. The EP group must agree on K: call it with the largest N over the group's ranks.
    """
    n = check_int("n_tokens", n_tokens, 0)
    cap = check_int("cap", cap, 1)
    max_chunks = check_int("max_chunks", max_chunks, 1)
    k = max(1, min(-(-n // cap), max_chunks))
    return k, -(-n // k)


def chunk_indices(n_tokens: int, num_chunks: int,
                  membership: str = "strided") -> list[torch.Tensor]:
    """Token indices of each of ``num_chunks`` chunks of ``n_tokens`` tokens (int64, sorted).

    * ``"strided"``: token t belongs to chunk ``t mod K`` (each chunk's routing mix is the
      batch's; the robust default).
    * ``"contiguous"``: chunk i holds positions ``[i * c, (i + 1) * c)`` with ``c = ceil(n / K)``.

    The chunks partition ``range(n_tokens)``, each has at most ``ceil(n / K)`` tokens, and some
    may be empty (always when n < K; with "contiguous" also when K does not divide n evenly
    enough, e.g. n=21, K=10 leaves chunks 7-9 empty).
    """
    n = check_int("n_tokens", n_tokens, 0)
    k = check_int("num_chunks", num_chunks, 1)
    if membership == "strided":
        return [torch.arange(min(i, n), n, k, dtype=torch.long) for i in range(k)]
    if membership == "contiguous":
        c = -(-n // k)
        return [torch.arange(min(i * c, n), min((i + 1) * c, n), dtype=torch.long)
                for i in range(k)]
    raise ValueError(f"membership must be one of {', '.join(MEMBERSHIPS)}, got {membership!r}")


def receive_bound(*, ep_size: int, topk: int, c_eff: int) -> int:
    """Most routes any destination can receive in one chunk, whatever the routing and plan.

    Each of the ``ep_size`` source ranks sends at most ``c_eff`` tokens per chunk (``c_eff``
    from :func:`num_chunks` with the group's largest N), each with ``topk`` routes, so a
    destination receives at most ``ep_size * topk * c_eff`` (architecture.md §2.1 "E_p · k · c_eff",
    E_p being the EP size). Note ``E_local * topk * c_eff`` is *not* a bound when
    ``E_local < ep_size``: e.g. P=2, E=2, k=1, on both ranks even tokens route to expert 0, so
    strided chunk 0 delivers ``2 * c_eff`` routes to rank 0. Keyword-only on purpose.
    """
    return (check_int("ep_size", ep_size, 1) * check_int("topk", topk, 1)
            * check_int("c_eff", c_eff, 0))


# ---------------------------------------------------------------------------- routes
def _check_routes(expert_ids: torch.Tensor, num_experts: int) -> None:
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        raise ValueError("expert_ids must be a [N, k] tensor of expert ids")
    if expert_ids.is_floating_point() or expert_ids.is_complex() \
            or expert_ids.dtype == torch.bool:
        raise ValueError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise ValueError(f"expert_ids must lie in [0, {num_experts}), got range "
                         f"[{int(expert_ids.min())}, {int(expert_ids.max())}]")


def route_destinations(expert_ids: torch.Tensor, counts_by_rank: torch.Tensor,
                       plan: LLEPPlan, rank: int, *, check: bool = True) -> torch.Tensor:
    """Compute rank of each of this source rank's routes under ``plan``.

    ``expert_ids`` is this rank's ``[N, k]`` routes (expert id per token and slot);
    ``counts_by_rank`` the ``[P, E]`` route counts of every source rank (row ``rank`` must match
    ``expert_ids``; column sums must be the plan's expert loads). Within an expert this rank's
    routes are ordered by (token, slot) and follow those of ranks ``< rank`` in the expert's
    global token list; each route goes to the rank whose range holds its position.
    Returns an int64 ``[N, k]`` tensor on ``expert_ids``' device. ``check=False`` skips the
    checks that read device data (route ids in range, counts matching the routes and the
    plan): each is a host sync on a GPU.
    """
    num_experts, ep_size = plan.num_experts, plan.ep_size
    if check:
        _check_routes(expert_ids, num_experts)
    rank = check_int("rank", rank, 0)
    if rank >= ep_size:
        raise ValueError(f"rank must be < ep_size ({ep_size}), got {rank}")
    device = expert_ids.device
    if tuple(counts_by_rank.shape) != (ep_size, num_experts):
        raise ValueError(f"counts_by_rank must have shape [P, E] = [{ep_size}, {num_experts}], "
                         f"got {tuple(counts_by_rank.shape)}")
    counts = counts_by_rank.to(device=device, dtype=torch.long)
    flat = expert_ids.reshape(-1).to(torch.long)
    if check and not torch.equal(torch.bincount(flat, minlength=num_experts), counts[rank]):
        raise ValueError(f"counts_by_rank[{rank}] does not match the per-expert counts of "
                         f"expert_ids")
    loads = torch.tensor(plan.expert_loads, dtype=torch.long, device=device)
    if check and not torch.equal(counts.sum(0), loads):
        raise ValueError("counts_by_rank column sums differ from the plan's expert loads")

    # Position of each route in its expert's global list: routes of earlier ranks first, then
    # this rank's routes to the same expert in flat (token, slot) order.
    order = torch.sort(flat, stable=True).indices
    group_start = torch.cumsum(counts[rank], 0) - counts[rank]
    sorted_ids = flat[order]
    local = torch.empty_like(flat)
    local[order] = torch.arange(flat.numel(), device=device) - group_start[sorted_ids]
    position = counts[:rank].sum(0)[flat] + local

    # Ranges of all experts laid end to end: expert e's list starts at base[e].
    base = torch.cumsum(loads, 0) - loads
    starts, ranks = [], []
    for e, ranges in enumerate(plan.assignments):
        for g, start, _ in ranges:
            starts.append((e, start))
            ranks.append(g)
    if not starts:
        return torch.empty_like(expert_ids, dtype=torch.long)
    range_expert = torch.tensor([e for e, _ in starts], dtype=torch.long, device=device)
    range_start = torch.tensor([s for _, s in starts], dtype=torch.long, device=device)
    global_start = base[range_expert] + range_start
    which = torch.searchsorted(global_start, base[flat] + position, right=True) - 1
    dest = torch.tensor(ranks, dtype=torch.long, device=device)[which]
    return dest.view(expert_ids.shape)


def _rows(tensor: torch.Tensor, token_indices: Optional[torch.Tensor]) -> torch.Tensor:
    if token_indices is None:
        return tensor.reshape(-1)
    return tensor.index_select(0, token_indices.to(device=tensor.device,
                                                   dtype=torch.long)).reshape(-1)


def send_matrix(expert_ids: torch.Tensor, destinations: torch.Tensor, ep_size: int,
                num_experts: int, *, token_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[P, E]`` int64 matrix: entry ``[d, e]`` counts this rank's routes to expert e that
    are computed on rank d, over all tokens or only the rows ``token_indices`` (a chunk)."""
    ep_size = check_int("ep_size", ep_size, 1)
    num_experts = check_int("num_experts", num_experts, 1)
    _check_routes(expert_ids, num_experts)
    if destinations.shape != expert_ids.shape:
        raise ValueError(f"destinations shape {tuple(destinations.shape)} differs from "
                         f"expert_ids shape {tuple(expert_ids.shape)}")
    ids = _rows(expert_ids, token_indices).to(torch.long)
    dest = _rows(destinations, token_indices).to(torch.long)
    if dest.numel() and (int(dest.min()) < 0 or int(dest.max()) >= ep_size):
        raise ValueError(f"destinations must lie in [0, {ep_size})")
    flat = torch.bincount(dest * num_experts + ids, minlength=ep_size * num_experts)
    return flat.view(ep_size, num_experts)


def send_counts(destinations: torch.Tensor, ep_size: int, *,
                token_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[P]`` int64 routes this rank sends to each destination (the all_to_all_single input
    split sizes, in routes), over all tokens or only the rows ``token_indices``."""
    ep_size = check_int("ep_size", ep_size, 1)
    dest = _rows(destinations, token_indices).to(torch.long)
    if dest.numel() and (int(dest.min()) < 0 or int(dest.max()) >= ep_size):
        raise ValueError(f"destinations must lie in [0, {ep_size})")
    return torch.bincount(dest, minlength=ep_size)
