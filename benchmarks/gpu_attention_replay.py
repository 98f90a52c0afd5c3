"""Attention replay's step time: a stack of attention layers under full (reentrant) recompute,
stock against replay with the kept (O, LSE) in a pinned host pool, prefetched one layer ahead.

    python benchmarks/gpu_attention_replay.py                 # CUDA, bf16, 8 x 16K tokens
    python benchmarks/gpu_attention_replay.py --device cpu --tiny   # a CPU smoke run

Each layer is a QKV projection, causal flash attention and an output projection with a
residual (the attention block without its norms), so the attention kernel's share of the
step is what it is at that sequence length. Per variant: a warm-up pass, then ``--reps``
timed forward + backward passes (median; CUDA events on a GPU), the ledger's counts of one
pass (attention forwards, FLOPs, host copies), and the bitwise comparison of loss and every
gradient with stock. The predicted saving is the FLOP share of the attention forwards replay
skips, (stock FLOPs - replay FLOPs) / stock FLOPs: the step-time model's assumption that the
step is matmul-bound and the copies hide under attention; the measured saving says whether
they do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from megatron_flat.attention.replay import ReplayStore, flash_attention
from megatron_flat.attention.replay_host import ReplayHost
from megatron_flat.checkpoint.transfer import SpanMover
from megatron_flat.runtime import HostPool
from megatron_flat.runtime.ledger import CostLedger


class Layer(torch.nn.Module):
    def __init__(self, index: int, heads: int, head_dim: int, seq: int):
        super().__init__()
        hidden = heads * head_dim
        self.index, self.heads, self.head_dim, self.seq = index, heads, head_dim, seq
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.store = None

    def forward(self, x):
        b = x.shape[0]
        q, k, v = (t.view(b, self.seq, self.heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        o = flash_attention(q, k, v, store=self.store, key=self.index)
        return x + self.proj(o.transpose(1, 2).reshape(b, self.seq, -1))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(args, variant: str) -> dict:
    device, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(i, args.heads, args.head_dim, args.seq)
                                 for i in range(args.layers)).to(device, dtype)
    hidden = args.heads * args.head_dim
    store = None
    if variant == "replay":
        pair = args.batch * args.seq * (hidden * torch.finfo(dtype).bits // 8 + args.heads * 4)
        pool = HostPool(args.layers * pair + (1 << 20), pin_memory=device == "cuda")
        store = ReplayStore(ReplayHost(SpanMover(pool)))
    for layer in layers:
        layer.store = store
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, hidden, device=device, dtype=dtype, requires_grad=True)

    def step():
        x.grad = None
        for p in layers.parameters():
            p.grad = None
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=True)
        loss = h.float().square().mean()
        loss.backward()
        return loss.detach()

    step()  # warm-up
    _sync(device)
    times = []
    for _ in range(args.reps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    with CostLedger() as ledger:
        loss = step()
        _sync(device)
    grads = [x.grad] + [p.grad for p in layers.parameters()]
    record = dict(variant=variant, step_s=statistics.median(times), times_s=times,
                  attention_forward_calls=ledger.attention_forward_calls,
                  attention_backward_calls=ledger.attention_backward_calls,
                  flops=ledger.flops, h2d_bytes=ledger.h2d_bytes, d2h_bytes=ledger.d2h_bytes)
    if store is not None:
        stats = store.host.stats
        record.update(prefetched=stats.prefetched, prefetch_hits=stats.prefetch_hits,
                      reloads_on_demand=stats.reloads_on_demand, not_kept=stats.not_kept)
    return record, loss, grads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="2 layers, 256 tokens, 4 x 16 heads")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.seq, args.heads, args.head_dim, args.reps = 2, 256, 4, 16, 1
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("no CUDA device (use --device cpu for a smoke run)")
        torch.use_deterministic_algorithms(True, warn_only=True)
    stock, stock_loss, stock_grads = run_variant(args, "stock")
    replay, loss, grads = run_variant(args, "replay")
    bitwise = torch.equal(loss, stock_loss) and all(
        torch.equal(a, b) for a, b in zip(grads, stock_grads))
    predicted = (stock["flops"] - replay["flops"]) / stock["flops"]
    measured = 1 - replay["step_s"] / stock["step_s"]
    summary = dict(device=args.device, layers=args.layers, seq=args.seq, batch=args.batch,
                   heads=args.heads, head_dim=args.head_dim, bitwise=bitwise,
                   predicted_saving=predicted, measured_saving=measured,
                   records=[stock, replay])
    print(f"attention replay, {args.layers} layers x {args.seq} tokens, {args.heads} heads x "
          f"{args.head_dim} ({args.device}):")
    for r in (stock, replay):
        print(f"  {r['variant']:7s} step {r['step_s'] * 1e3:9.2f} ms  attention forwards "
              f"{r['attention_forward_calls']:3d}  FLOPs {r['flops'] / 1e12:8.3f} T  "
              f"h2d {r['h2d_bytes'] / 2**20:9.1f} MiB  d2h {r['d2h_bytes'] / 2**20:9.1f} MiB")
    print(f"  saving: predicted {predicted:.1%} (FLOPs), measured {measured:.1%}; loss and "
          f"gradients {'bitwise equal' if bitwise else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if bitwise and replay["attention_forward_calls"] * 2 == \
        stock["attention_forward_calls"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
