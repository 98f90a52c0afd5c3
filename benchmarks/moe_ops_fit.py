"""Fit of PipelinedLLEP's op counts per MoE layer (the launch proxy of ``plan.costs``).

Run under torchrun with 2 ranks (EP 2, megatron-core's tiny MoE layer as
``benchmarks/ledger.py`` builds it, balanced routing)::

    torchrun --nproc-per-node 2 benchmarks/moe_ops_fit.py --json results/moe_ops_fit.json

For E_l ∈ {2, 4, 8} and K ∈ {1, 4, 10} it counts, with the cost ledger, the flat layer's
forward alone (F), forward + backward (F + B) and the same under Megatron's full recompute
(F + G + B, G the graph-only re-run), and fits by least squares::

    F = a_f + b_f·K + c_f·U            a valued forward: the call, per chunk, per unit
    B = a_b + b_b·K + c_b·U            backward
    G = a_g + b_g·K                    a graph-only re-run: the call and its schedules

(a unit is one expert's rows of one chunk; the routing reaches every local expert in every
chunk, so there are U = K·E_l of them, as at real scale). It prints
the constants for ``megatron_flat/plan/costs.py`` and each point's error against the fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ledger as bench  # noqa: E402  (benchmarks/ledger.py)

POINTS = [(el, k) for el in (2, 4, 8) for k in (1, 4, 10)]
TOKENS = 240
# 30 % of the tokens on 2 hot experts, the rest spread: every chunk reaches every expert of
# this rank (units = K·E_l, as at real scale); LLEP off (λ = 1e9): plain EP.
PROFILE = "0.3/2"


def count(el: int, k: int, tokens: int = TOKENS) -> dict:
    """The flat layer's ops at E_l = ``el`` (EP = the world) and K = ``k``: forward alone,
    forward + backward, and the same under Megatron's full recompute; with the units (expert,
    chunk) this rank ran."""
    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.megatron.moe import replay_routing
    from megatron_flat.testing.distributed import megatron_layout

    world = dist.get_world_size()
    args = bench.parse_args(["--experts", str(el * world), "--topk", "2", "--tokens",
                             str(tokens), "--hidden", "16", "--ffn", "16", "--chunk",
                             str(-(-tokens // k)), "--max-chunks", "10",
                             "--profile", PROFILE, "--imbalance-threshold", "1e9"])
    with megatron_layout(ep=world):
        _, flat = bench._moe_layers(args)
        gen = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(args.tokens, 1, args.hidden, generator=gen)
        grad = torch.randn(args.tokens, 1, args.hidden, generator=gen)
        ids = routing_profile(args.profile, args.tokens, args.experts, args.topk)

        def forward():
            with torch.no_grad(), replay_routing(flat.module, ids):
                flat(x)

        out = {}
        for name, run in (("forward", forward),
                          ("step", lambda: bench._moe_pass(flat, x, grad, ids, False)),
                          ("recompute", lambda: bench._moe_pass(flat, x, grad, ids, True))):
            bench.warm(run)
            out[name] = bench.count(run)["ops"]
        last = flat.module.flat_dispatch.last
        del flat
    assert last.num_chunks == k and not last.llep, (last.num_chunks, k, last.llep)
    return {"e_local": el, "chunks": k, "units": last.units, **out}


def fit(rows: list[dict]) -> dict:
    def lsq(columns, target):
        a = torch.tensor(columns, dtype=torch.float64).t()
        b = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
        return [round(v) for v in torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()]

    ones = [1] * len(rows)
    ks = [r["chunks"] for r in rows]
    units = [r["units"] for r in rows]
    f = lsq([ones, ks, units], [r["forward"] for r in rows])
    b = lsq([ones, ks, units], [r["step"] - r["forward"] for r in rows])
    g = lsq([ones, ks], [r["recompute"] - r["step"] for r in rows])
    return {"forward": f, "backward": b, "graph_only": g}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from megatron_flat.cpu.backend import enable_cpu_backend
    from megatron_flat.testing.distributed import init_distributed

    init_distributed()
    enable_cpu_backend()
    rows = [count(el, k) for el, k in POINTS]
    if dist.get_rank():
        return
    c = fit(rows)
    print("F = %d + %d·K + %d·U;  B = %d + %d·K + %d·U;  G = %d + %d·K"
          % (*c["forward"], *c["backward"], *c["graph_only"]))
    print(f"{'E_l':>4s} {'K':>3s} {'U':>4s} {'fwd':>6s} {'step':>6s} {'recomp':>7s} {'pred step':>10s} "
          f"{'err':>6s} {'pred rc':>8s} {'err':>6s}")
    for r in rows:
        el, k = r["e_local"], r["chunks"]
        u = r["units"]
        f = c["forward"][0] + c["forward"][1] * k + c["forward"][2] * u
        b = c["backward"][0] + c["backward"][1] * k + c["backward"][2] * u
        g = c["graph_only"][0] + c["graph_only"][1] * k
        r["predicted_step"], r["predicted_recompute"] = f + b, f + g + b
        print(f"{el:>4d} {k:>3d} {u:>4d} {r['forward']:>6d} {r['step']:>6d} {r['recompute']:>7d} "
              f"{f + b:>10d} {(f + b) / r['step'] - 1:>+6.1%} {f + g + b:>8d} "
              f"{(f + g + b) / r['recompute'] - 1:>+6.1%}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"fit": c, "points": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
