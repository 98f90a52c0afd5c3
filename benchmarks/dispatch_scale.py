"""PipelinedLLEP at the scale it exists for: one rank of a large EP group, on CPU (issue 25).

The paper runs PipelinedLLEP at EP = 64 with 384 experts, top-8, K = 10 chunks and 65,536
tokens per rank. What grows with that scale is this rank's own work: the host planning
(O(P·K·E)), the size of every buffer, the syncs and ops it issues, what it receives per
chunk. Those are measured here in one process, as one rank of the group, with a reduced
hidden size (the GEMMs' width changes nothing of the above).

**The stand-in.** The group is torch's fake process group
(:mod:`megatron_flat.testing.standin_group`): its collectives run through the same ``c10d``
ops as a real group's, so the ledger counts them, and its all-gather gives every peer's slot
this rank's row. The engine's one exchange is an all-gather of each rank's route counts, so
the plan is exactly the one a real group makes when every rank routes like this one (the
routing profiles below are per-rank profiles: with a hot set, every rank sends its hot
tokens to the same experts, the worst case for their owners). Received rows carry stand-in
values, so outputs and gradients are not checked here (the equivalence tests do that at EP
2 and 4); sizes, counts, syncs, host work and memory are this rank's at this scale.

Per variant (routing profile) one record, for this rank's MoE layer forward + backward:

* ``syncs_forward`` / ``syncs_backward``: host syncs with CUDA semantics (the ledger: reads
  of device data and blocking uploads) in the engine's forward calls (two under
  ``--recompute``: the forward and the checkpoint's re-run) and in the rest of backward;
* ``host_plan_ms``: CPU time of the host planning (``PipelinedLLEP.plan_on_host``,
  everything between the counts copy and the upload), median of ``--reps`` calls;
  ``host_plan_bytes``: the peak of the memory it allocates, the counts' host copy included;
* ``ops`` / ``ops_predicted``: aten ops of the step (a launch proxy) and
  :func:`megatron_flat.plan.costs.moe_layer_counts`' prediction for the ``units`` (expert,
  chunk) pairs this rank ran (its native experts' and the spilled ones it helps with);
* ``max_received`` / ``receive_bound``: the largest chunk this rank receives and Eq. 1's
  bound ``P·k·c_eff``;
* ``peak_bytes``: the memory meter's peak of the step above its start.

Run::

    python benchmarks/dispatch_scale.py --json results/dispatch_scale.json
    python benchmarks/dispatch_scale.py --recompute --json results/dispatch_scale_recompute.json

Defaults: ``--ep 64 --experts 384 --topk 8 --tokens 65536 --chunk-tokens 6554 --hidden 128``
(K = 10), ``--ffn 64``, profiles ``balanced`` (plain EP) and ``0.3/16`` (30 % of each
rank's tokens to 16 hot experts: LLEP spills them). About a minute per profile here.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
import json
import os
import statistics
import sys
import time

import torch

from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.dispatch.profiles import routing_profile
from megatron_flat.dispatch.schedule import routes_from_topk, token_chunks
from megatron_flat.plan.costs import moe_layer_counts
from megatron_flat.runtime.ledger import CostLedger, sync_mismatches
from megatron_flat.runtime.memory import MemoryMeter, format_bytes
from megatron_flat.testing.reentrant import Reentrant
from megatron_flat.testing.standin_group import init_standin_group

KEYS = ("ep", "experts", "topk", "tokens", "chunks", "hidden", "recompute", "syncs_forward",
        "syncs_backward", "host_plan_ms", "host_plan_bytes", "ops", "ops_predicted",
        "max_received", "receive_bound", "peak_bytes")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--rank", type=int, default=0, help="the rank whose view is measured")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per rank")
    ap.add_argument("--chunk-tokens", type=int, default=6554)
    ap.add_argument("--max-chunks", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--min-tokens-per-gemm", type=int, default=1024)
    ap.add_argument("--profiles", nargs="+", default=["balanced", "0.3/16"])
    ap.add_argument("--recompute", action="store_true",
                    help="the layer inside a reentrant checkpoint (full recompute): the "
                         "forward runs again in backward, graph-only once verified")
    ap.add_argument("--reps", type=int, default=5, help="host-planning timings (median)")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda: the layer on the GPU, its steady-state backward under "
                         "torch.cuda.set_sync_debug_mode('error') (any sync raises) and the "
                         "forward's syncs cross-checked with the 'warn' mode's warnings")
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-syncs", action="store_true",
                    help="on CUDA, exit 1 unless the ledger's flagged syncs equal "
                         "set_sync_debug_mode's warnings for every profile")
    return ap.parse_args(argv)


class Layer:
    """One MoE layer's engine on this rank and its inputs under one routing profile."""

    def __init__(self, args, profile: str):
        self.args = args
        e_local = args.experts // args.ep
        device = torch.device(args.device)
        self.bank = GLUExperts(e_local, args.hidden, args.ffn,
                               generator=torch.Generator().manual_seed(1)).to(device)
        self.options = DispatchOptions(chunk_tokens=args.chunk_tokens, max_chunks=args.max_chunks,
                                       min_tokens_per_gemm=args.min_tokens_per_gemm)
        self.engine = PipelinedLLEP(self.bank, num_experts=args.experts, topk=args.topk,
                                    options=self.options)
        ids = routing_profile(profile, args.tokens, args.experts, args.topk).to(device)
        self.route_token, self.route_expert, order = routes_from_topk(ids)
        g = torch.Generator().manual_seed(2)
        self.probs = torch.rand(ids.numel(), generator=g).to(device)[order]
        self.tokens = torch.randn(args.tokens, args.hidden, generator=g).to(device)
        self.grad = torch.randn(args.tokens, args.hidden, generator=g).to(device)
        self.phase = "forward"

    def step(self, ledger=None) -> None:
        """Forward + backward of the layer (inside a reentrant checkpoint with --recompute:
        the region ``x + moe(x)``, as a transformer layer's residual add)."""
        x = self.tokens.detach().requires_grad_()
        p = self.probs.detach().requires_grad_()

        def moe(x, p):
            if ledger is None:
                return self.engine(x, self.route_token, self.route_expert, p)
            with ledger.section(f"engine-{self.phase}"):
                return self.engine(x, self.route_token, self.route_expert, p)

        def region(x, p):
            return x + moe(x, p)

        self.phase = "forward"
        with (ledger.section("forward") if ledger else contextlib.nullcontext()):
            out = Reentrant.apply(region, x, p) if self.args.recompute else region(x, p)
        self.phase = "backward"
        with (ledger.section("backward") if ledger else contextlib.nullcontext()):
            if self.args.device == "cuda" and not self.args.recompute:
                # steady state: backward may not wait for the device even once
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out.backward(self.grad)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            else:
                out.backward(self.grad)

    def host_counts(self) -> torch.Tensor:
        """``[P, K, E]``: every rank's route counts per (chunk, expert) as the exchange
        gives them under the stand-in (every rank routes like this one)."""
        a = self.args
        k = self.engine.last.num_chunks
        token, expert = self.route_token.cpu(), self.route_expert.cpu()
        chunk = token_chunks(a.tokens, k, self.options.membership)[token]
        mine = torch.zeros(k * a.experts, dtype=torch.long)
        mine.index_add_(0, chunk * a.experts + expert, torch.ones_like(chunk))
        return mine.view(1, k, a.experts).expand(a.ep, k, a.experts).contiguous()

def measure(args, profile: str) -> dict:
    layer = Layer(args, profile)
    with CostLedger():          # warm-up: verifies graph-only; marks state by origin
        layer.step()
    with MemoryMeter() as meter:
        layer.step()
    with CostLedger(cuda_sync_check=args.device == "cuda") as ledger:
        layer.step(ledger)
    stats = layer.engine.last
    sec = ledger.sections
    syncs_engine = sum(sec[n].syncs for n in ("engine-forward", "engine-backward") if n in sec)
    rerun = sec["engine-backward"].syncs if "engine-backward" in sec else 0

    counts = layer.host_counts()
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        layer.engine.plan_on_host(counts)
        times.append((time.perf_counter() - start) * 1e3)
    with MemoryMeter() as plan_meter:
        copy = counts.clone()   # the exchange's host copy, [P, K, E] of the [P, K_max·E + 8]
        layer.engine.plan_on_host(copy)
        del copy

    received = sum(stats.received)
    sent_off = sum(n for row in stats.send_splits for d, n in enumerate(row) if d != args.rank)
    predicted = moe_layer_counts(
        hidden=args.hidden, ffn=args.ffn, experts=args.experts, tokens=args.tokens, ep=args.ep,
        routes_computed=received, routes_sent=sent_off, bytes_per_value=4, flat=True,
        chunks=stats.num_chunks, recompute=args.recompute, graph_only=True,
        max_chunks=args.max_chunks, units=stats.units)
    return {
        "profile": profile, "ep": args.ep, "rank": args.rank, "experts": args.experts,
        "topk": args.topk, "tokens": args.tokens, "chunks": stats.num_chunks,
        "hidden": args.hidden, "ffn": args.ffn, "recompute": args.recompute,
        "llep": stats.llep, "spills": len(stats.plan.weight_transfers),
        "syncs_forward": syncs_engine,
        "syncs_backward": sec["backward"].syncs - rerun,
        "sync_kinds": dict(ledger.sync_kinds),
        "host_plan_ms": statistics.median(times), "host_plan_ms_all": times,
        "host_plan_bytes": plan_meter.peak_device_bytes,
        "ops": ledger.ops, "ops_predicted": predicted["ops"], "units": stats.units,
        "max_received": max(stats.received), "receive_bound": stats.receive_bound,
        "peak_bytes": meter.peak_device_bytes,
        "h2d_bytes": ledger.h2d_bytes, "a2a_bytes": ledger.all_to_all_bytes,
        "device": args.device,
        "cuda_sync_warnings": ledger.cuda_sync_warnings if args.device == "cuda" else None,
    }


def report(rows: list) -> None:
    print(f"{'profile':>9s} {'EP':>3s} {'E':>4s} {'k':>2s} {'N':>6s} {'K':>3s} {'rc':>2s} "
          f"{'spills':>6s} {'syncs f/b':>9s} {'plan ms':>8s} {'plan mem':>10s} {'ops':>7s} "
          f"{'pred':>7s} {'recv max':>9s} {'bound':>8s} {'peak':>10s}")
    for r in rows:
        print(f"{r['profile']:>9s} {r['ep']:>3d} {r['experts']:>4d} {r['topk']:>2d} "
              f"{r['tokens']:>6d} {r['chunks']:>3d} {'y' if r['recompute'] else 'n':>2s} "
              f"{r['spills']:>6d} {r['syncs_forward']:>4d}/{r['syncs_backward']:<4d} "
              f"{r['host_plan_ms']:>8.2f} {format_bytes(r['host_plan_bytes']):>10s} "
              f"{r['ops']:>7d} {r['ops_predicted']:>7d} {r['max_received']:>9d} "
              f"{r['receive_bound']:>8d} {format_bytes(r['peak_bytes']):>10s}")


def main(argv=None) -> list:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    init_standin_group(args.ep, args.rank)
    rows = [measure(args, profile) for profile in args.profiles]
    report(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.check_syncs:
        bad = sync_mismatches({r["profile"]: r for r in rows})
        for line in bad:
            print(f"SYNC MISMATCH {line}")
        if args.device != "cuda":
            print("--check-syncs: no CUDA counts on this device; nothing compared")
        elif bad:
            sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
