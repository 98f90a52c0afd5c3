"""A dense, single-process MoE to check the dispatch engine against (tests, benchmarks).

A test helper, not part of the dispatch engine: it lives with the other test support
(``megatron_flat.testing``) so that benchmarks run from an installed package can use it too.

:func:`dense_moe` computes what every dispatch must compute — each token's sum of its experts'
probability-weighted outputs — with all E experts in one process, one expert at a time, in
plain autograd. :class:`RankCase` builds one rank's synthetic inputs (tokens, routes, router
probabilities, output gradients) deterministically from a seed, so every rank of a test can
rebuild every other rank's inputs without communicating and compute the global reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from megatron_flat.dispatch.experts import ExpertBank
from megatron_flat.dispatch.profiles import routing_profile
from megatron_flat.dispatch.schedule import routes_from_topk

__all__ = ["RankCase", "dense_moe", "engine_mismatches", "global_reference", "local_bank_from"]


def dense_moe(bank: ExpertBank, tokens: torch.Tensor, route_token: torch.Tensor,
              route_expert: torch.Tensor, route_probs: torch.Tensor) -> torch.Tensor:
    """``[N, H]``: Σ over each token's routes of ``bank.run(W_e, x_t, p)``; ``bank`` holds
    every expert (``local_weights(e)`` for global e). Differentiable in every input."""
    out = torch.zeros_like(tokens)
    for e in range(bank.num_local_experts):
        mask = route_expert == e
        if not bool(mask.any()):
            continue
        tok = route_token[mask]
        y = bank.run(bank.local_weights(e), tokens.index_select(0, tok), route_probs[mask])
        out = out.index_add(0, tok, y)
    return out


def local_bank_from(full: torch.nn.Module, first: int, count: int) -> torch.nn.Module:
    """A copy of ``full`` (a bank module with ``fc1``/``fc2`` ParameterLists, e.g.
    :class:`~megatron_flat.dispatch.experts.GLUExperts`) keeping experts
    ``first .. first + count - 1``."""
    import copy

    local = copy.deepcopy(full)
    for name in ("fc1", "fc2"):
        params = getattr(full, name)
        setattr(local, name, torch.nn.ParameterList(
            torch.nn.Parameter(params[j].detach().clone()) for j in range(first, first + count)))
    return local


@dataclass
class RankCase:
    """One rank's synthetic MoE inputs: ``n_tokens`` tokens of width ``hidden``, routed by
    ``profile`` (see :func:`~megatron_flat.dispatch.profiles.routing_profile`) over
    ``num_experts`` experts with top-``topk``; router logits, tokens and output gradients drawn
    from ``seed``. ``shift`` rotates the expert ids (so ranks' routings can differ)."""

    n_tokens: int
    hidden: int
    num_experts: int
    topk: int
    profile: str = "balanced"
    seed: int = 0
    shift: int = 0

    def build(self, requires_grad: bool = True) -> dict:
        """``tokens``, ``logits`` (leaves), ``route_token``, ``route_expert``, ``route_probs``
        (softmax over the chosen logits, a function of ``logits``) and ``grad`` (``[N, H]``)."""
        gen = torch.Generator().manual_seed(self.seed)
        n, h, e, k = self.n_tokens, self.hidden, self.num_experts, self.topk
        tokens = torch.randn(n, h, generator=gen)
        logits = torch.randn(n, k, generator=gen)
        grad = torch.randn(n, h, generator=gen)
        ids = (routing_profile(self.profile, n, e, k) + self.shift) % e
        token, expert, flat = routes_from_topk(ids)
        tokens.requires_grad_(requires_grad)
        logits.requires_grad_(requires_grad)
        probs = torch.softmax(logits, dim=-1).reshape(-1).index_select(0, flat)
        return dict(tokens=tokens, logits=logits, route_token=token, route_expert=expert,
                    route_probs=probs, grad=grad)


def global_reference(full: ExpertBank, cases: Sequence[RankCase]) -> list[dict]:
    """Reference outputs and gradients of every rank's case with the full bank.

    Returns per rank ``{"out", "tokens_grad", "logits_grad"}`` and, in entry 0 only,
    ``"weight_grads"``: the list of every expert's weight gradients (bank order) of
    ``Σ_ranks <out_r, grad_r>``.
    """
    built = [c.build() for c in cases]
    total = 0.0
    outs = []
    for b in built:
        out = dense_moe(full, b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
        outs.append(out)
        total = total + (out * b["grad"]).sum()
    leaves = [x for b in built for x in (b["tokens"], b["logits"])]
    weights = [w for j in range(full.num_local_experts) for w in full.local_weights(j)]
    if isinstance(total, torch.Tensor) and total.requires_grad:
        grads = torch.autograd.grad(total, leaves + weights, allow_unused=True)
    else:  # no routes anywhere
        grads = (None,) * (len(leaves) + len(weights))
    result = []
    for r, (b, out) in enumerate(zip(built, outs)):
        result.append({"out": out.detach(), "tokens_grad": grads[2 * r],
                       "logits_grad": grads[2 * r + 1]})
    result[0]["weight_grads"] = list(grads[len(leaves):])
    return result



def engine_mismatches(full: torch.nn.Module, cases: Sequence[RankCase], rank: int, *,
                      options=None, group=None, rtol: float = 1e-5,
                      atol: float = 1e-7) -> tuple[list[str], object]:
    """Run :class:`~megatron_flat.dispatch.llep.PipelinedLLEP` on ``cases[rank]`` with this
    rank's share of ``full`` (a :class:`GLUExperts` of all E experts, identical on every rank)
    and compare output, token, logit and local expert-weight gradients with
    :func:`global_reference`. Collective over the group (every rank calls it with the same
    ``cases``). Returns ``(problems, engine.last)``; ``problems`` is empty when all agree.
    """
    from megatron_flat.dispatch.llep import PipelinedLLEP

    case = cases[rank]
    e_local = case.num_experts // len(cases)
    first = rank * e_local
    bank = local_bank_from(full, first, e_local)
    engine = PipelinedLLEP(bank, num_experts=case.num_experts, topk=case.topk, options=options,
                           group=group)
    b = case.build()
    out = engine(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
    out.backward(b["grad"])
    want = global_reference(full, cases)
    problems = []

    def close(name, got, expected):
        if expected is None:
            expected = torch.zeros_like(got)
        if got is None:
            got = torch.zeros_like(expected)
        if got.shape != expected.shape:
            problems.append(f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
        elif not torch.allclose(got, expected, rtol=rtol, atol=atol):
            err = (got - expected).abs().max().item()
            problems.append(f"{name}: max abs error {err:.3g}")

    mine = want[rank]
    close("output", out.detach(), mine["out"])
    close("tokens grad", b["tokens"].grad, mine["tokens_grad"])
    close("logits grad", b["logits"].grad, mine["logits_grad"])
    per = len(full.local_weights(0))
    all_w = want[0]["weight_grads"]
    for j in range(e_local):
        for n, w in enumerate(bank.local_weights(j)):
            close(f"expert {first + j} weight {n} grad", w.grad, all_w[(first + j) * per + n])
    return problems, engine.last


def engine_syncs(full: torch.nn.Module, case: RankCase, rank: int, ep_size: int, *,
                 options, topk: int, recompute: bool = False) -> tuple[dict, Any]:
    """Host syncs (the cost ledger's, CUDA semantics) of one engine forward and backward on
    this rank, after a warm-up step: ``({"forward": n, "backward": n}, StepStats)``. With
    ``recompute`` the layer runs inside a reentrant checkpoint (the region ``x + moe(x)``),
    whose re-run in backward is counted as a forward call."""
    from megatron_flat.dispatch.llep import PipelinedLLEP
    from megatron_flat.runtime.ledger import CostLedger
    from megatron_flat.testing.reentrant import Reentrant

    per = full.num_local_experts // ep_size
    bank = local_bank_from(full, rank * per, per)
    engine = PipelinedLLEP(bank, num_experts=full.num_local_experts, topk=topk,
                           options=options)
    b = case.build()
    calls = {"forward": 0, "backward": 0}

    def step(ledger=None):
        x = b["tokens"].detach().requires_grad_()
        p = b["route_probs"].detach().requires_grad_()
        phase = ["forward"]

        def region(x, p):
            if ledger is None:
                return x + engine(x, b["route_token"], b["route_expert"], p)
            with ledger.section(f"call-{phase[0]}"):
                return x + engine(x, b["route_token"], b["route_expert"], p)

        out = Reentrant.apply(region, x, p) if recompute else region(x, p)
        phase[0] = "backward"
        if ledger is None:
            out.backward(b["grad"])
            return
        with ledger.section("backward"):
            out.backward(b["grad"])

    with CostLedger():
        step()
    with CostLedger() as ledger:
        step(ledger)
    sec = ledger.sections
    rerun = sec["call-backward"].syncs if "call-backward" in sec else 0
    calls["forward"] = sec["call-forward"].syncs + rerun
    calls["backward"] = sec["backward"].syncs - rerun
    return calls, engine.last


def sync_case(profile: str, recompute: bool, *, experts: int, hidden: int,
              ffn: int) -> dict:
    """The multi-rank sync-count case of tests/dispatch (any world size): every rank runs the
    engine on ``24 - rank`` tokens of ``profile`` routing (K = 5 chunks on every rank; LLEP
    always on for a skewed profile) and reports ``{"forward", "backward"}`` host syncs
    (:func:`engine_syncs`), its chunk count and whether the plan spilled."""
    import torch.distributed as dist

    from megatron_flat.dispatch.experts import GLUExperts
    from megatron_flat.dispatch.llep import DispatchOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    full = GLUExperts(experts, hidden, ffn, generator=torch.Generator().manual_seed(5))
    case = RankCase(24 - rank, hidden, experts, 2, profile, seed=70 + rank, shift=rank)
    options = DispatchOptions(chunk_tokens=5, min_tokens_per_gemm=1,
                              imbalance_threshold=0.0 if profile != "balanced" else 1.3)
    syncs, stats = engine_syncs(full, case, rank, world, options=options, topk=2,
                                recompute=recompute)
    return {**syncs, "chunks": stats.num_chunks, "spills": bool(stats.plan.weight_transfers)}
