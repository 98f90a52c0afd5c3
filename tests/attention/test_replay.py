"""Attention replay at the kernel level (``attention.replay``): a plain-PyTorch stack of
attention layers under reentrant full recompute (``torch.utils.checkpoint``: the forward
without autograd, the re-run inside the backward, as Megatron's ``CheckpointFunction``),
stock against replay. Loss and every gradient bitwise equal in fp32 and bf16, the attention
kernel counted by the ledger (L forwards per step instead of 2L, L backwards both ways),
microbatches in flight served in order, a one-ulp change to a kept output caught."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron_flat.attention.replay import ReplayStore, flash_attention
from megatron_flat.runtime.ledger import CostLedger

LAYERS, B, S, H, HEADS = 3, 2, 24, 32, 4


class Layer(torch.nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.qkv = torch.nn.Linear(H, 3 * H)
        self.proj = torch.nn.Linear(H, H)
        self.store = None

    def forward(self, x):
        q, k, v = (t.view(B, S, HEADS, H // HEADS).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        o = flash_attention(q, k, v, store=self.store, key=self.index)
        return x + self.proj(o.transpose(1, 2).reshape(B, S, H))


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.ModuleList(Layer(i) for i in range(LAYERS)).to(dtype)


def _forward(layers, x):
    for layer in layers:
        x = checkpoint(layer, x, use_reentrant=True)
    return x.float().square().mean()


def _run(dtype, store, microbatches=1, perturb=False):
    """Forward all microbatches, then their backwards in order (1F1B's order per layer)."""
    layers = _model(dtype)
    for layer in layers:
        layer.store = store
    torch.manual_seed(1)
    inputs = [torch.randn(B, S, H, dtype=dtype, requires_grad=True)
              for _ in range(microbatches)]
    with CostLedger() as ledger:
        losses = [_forward(layers, x) for x in inputs]
        if perturb:  # one ulp on one element of the first layer's kept output
            out, _ = store.peek(0)
            out[0, 0, 5, 0] = torch.nextafter(out[0, 0, 5, 0],
                                              torch.tensor(float("inf"), dtype=dtype))
        for loss in losses:
            loss.backward()
    grads = [x.grad for x in inputs] + [p.grad for p in layers.parameters()]
    return [l.detach() for l in losses], grads, ledger


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_stock_bitwise_with_one_kernel_forward_per_layer(dtype):
    stock_losses, stock_grads, stock = _run(dtype, None)
    store = ReplayStore()
    losses, grads, replay = _run(dtype, store)
    assert all(torch.equal(a, b) for a, b in zip(losses, stock_losses))
    assert len(grads) == len(stock_grads) and all(g is not None for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    assert stock.attention_forward_calls == 2 * LAYERS
    assert replay.attention_forward_calls == LAYERS
    assert stock.attention_backward_calls == replay.attention_backward_calls == LAYERS
    assert (store.kernel_forwards, store.replays, len(store)) == (LAYERS, LAYERS, 0)


def test_microbatches_in_flight_get_their_own_outputs_back():
    stock_losses, stock_grads, _ = _run(torch.float32, None, microbatches=3)
    store = ReplayStore()
    losses, grads, ledger = _run(torch.float32, store, microbatches=3)
    assert all(torch.equal(a, b) for a, b in zip(losses, stock_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    assert ledger.attention_forward_calls == 3 * LAYERS and len(store) == 0


def test_a_one_ulp_change_to_a_kept_output_changes_the_gradients():
    _, stock_grads, _ = _run(torch.float32, None)
    _, grads, _ = _run(torch.float32, ReplayStore(), perturb=True)
    assert not all(torch.equal(a, b) for a, b in zip(grads, stock_grads))


def test_without_a_first_pass_the_call_is_stock():
    # No recompute: the forward runs with autograd, nothing was kept, the kernel runs.
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, HEADS, S, 8, requires_grad=True) for _ in range(3))
    store = ReplayStore()
    out = flash_attention(q, k, v, store=store, key="layer")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, ref) and store.kernel_forwards == 1 and store.replays == 0


def test_a_rerun_out_of_order_is_refused():
    store = ReplayStore()
    q = torch.randn(1, 2, 8, 4)
    with torch.no_grad():
        flash_attention(q, q, q, store=store, key=0)
    wrong = torch.randn(1, 2, 6, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="did not come in the first passes' order"):
        flash_attention(wrong, wrong, wrong, store=store, key=0)
    with pytest.raises(ValueError, match=r"\[b, heads, s, d\]"):
        flash_attention(torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4), store=store)
    store.clear()
    assert len(store) == 0 and store.kept_bytes() == 0


def test_the_ledger_counts_attention_flops():
    # causal 24 x 24: 300 pairs per (batch, head); d = d_v = 8
    q, k, v = (torch.randn(B, HEADS, S, 8, requires_grad=True) for _ in range(3))
    with CostLedger() as ledger:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    pairs = B * HEADS * S * (S + 1) // 2
    assert ledger.flops == 2 * pairs * (8 + 8)
    with CostLedger() as ledger:
        out.sum().backward()
    assert ledger.flops == 2 * pairs * (3 * 8 + 2 * 8)


# -- the host tier ----------------------------------------------------------------------------

def _host_store(budget_bytes=1 << 20):
    from megatron_flat.attention.replay_host import ReplayHost
    from megatron_flat.checkpoint.transfer import SpanMover
    from megatron_flat.runtime import HostPool

    mover = SpanMover(HostPool(budget_bytes, pin_memory=False))
    return ReplayStore(ReplayHost(mover)), mover


PAIR_BYTES = {torch.float32: B * S * H * 4 + B * HEADS * S * 4,  # O, and the fp32 LSE
              torch.bfloat16: B * S * H * 2 + B * HEADS * S * 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_tier_is_bitwise_stock_and_prefetches_one_layer_ahead(dtype):
    stock_losses, stock_grads, _ = _run(dtype, None)
    store, mover = _host_store()
    losses, grads, ledger = _run(dtype, store)
    assert all(torch.equal(a, b) for a, b in zip(losses, stock_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    assert ledger.attention_forward_calls == LAYERS
    stats = store.host.stats
    # the last layer's re-run comes first and reloads on demand; each re-run starts the
    # reload of the layer below it, which finds it ready
    assert (stats.kept, stats.not_kept) == (LAYERS, 0)
    assert (stats.reloads_on_demand, stats.prefetched, stats.prefetch_hits) == \
        (1, LAYERS - 1, LAYERS - 1)
    assert stats.bytes_offloaded == stats.bytes_reloaded == LAYERS * PAIR_BYTES[dtype]
    assert ledger.d2h_bytes == ledger.h2d_bytes == LAYERS * PAIR_BYTES[dtype]
    mover.synchronize()
    assert mover.pool.stats()["used_bytes"] == 0 and len(store) == 0


def test_the_host_tier_serves_microbatches_in_flight():
    stock_losses, stock_grads, _ = _run(torch.float32, None, microbatches=3)
    store, mover = _host_store()
    losses, grads, ledger = _run(torch.float32, store, microbatches=3)
    assert all(torch.equal(a, b) for a, b in zip(losses, stock_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    assert ledger.attention_forward_calls == 3 * LAYERS
    stats = store.host.stats
    # each microbatch's first re-run reloads on demand (the pair kept before it, the last
    # layer of the microbatch before, was taken already)
    assert (stats.reloads_on_demand, stats.prefetched) == (3, 3 * (LAYERS - 1))
    mover.synchronize()
    assert mover.pool.stats()["used_bytes"] == 0


def test_a_full_pool_keeps_what_fits_and_the_rest_recomputes_with_one_warning():
    stock_losses, stock_grads, _ = _run(torch.float32, None)
    store, _ = _host_store(budget_bytes=PAIR_BYTES[torch.float32] + 512)  # one pair
    with pytest.warns(UserWarning, match="no room for a kept output") as caught:
        losses, grads, ledger = _run(torch.float32, store)
    assert len([w for w in caught if "no room" in str(w.message)]) == 1
    assert all(torch.equal(a, b) for a, b in zip(losses, stock_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    assert (store.host.stats.kept, store.host.stats.not_kept) == (1, LAYERS - 1)
    assert ledger.attention_forward_calls == LAYERS + (LAYERS - 1)


def test_the_host_tier_holds_no_kept_output_on_the_device():
    """Between the forwards and the backward the device holds L·(O + LSE) more with the
    device tier and nothing more with the host tier once its copies have landed (the
    meter's device figure; the pool is host memory; until a copy lands its source stays
    allocated, as the caching allocator keeps a block a side stream still reads)."""
    from megatron_flat.runtime.memory import MemoryMeter

    def held(store, mover=None):
        layers = _model(torch.float32)
        for layer in layers:
            layer.store = store
        x = torch.randn(B, S, H, requires_grad=True)
        with MemoryMeter("cpu") as meter:
            loss = _forward(layers, x)
            if mover is not None:
                mover.synchronize()
            after_forward = meter.current_device_bytes()
        loss.backward()
        return after_forward

    stock = held(None)
    device_tier = held(ReplayStore())
    host_tier = held(*_host_store())
    assert device_tier - stock == LAYERS * PAIR_BYTES[torch.float32]
    assert host_tier == stock


def test_the_host_tier_is_bitwise_under_delayed_copies():
    """Side-stream copies land late (``delayed_copies``: as a GPU's copy engine may): the
    re-run must wait for its reload before it uses the kept pair."""
    from megatron_flat.runtime.streams import delayed_copies

    stock_losses, stock_grads, _ = _run(torch.float32, None, microbatches=2)
    store, _ = _host_store()
    with delayed_copies():
        losses, grads, _ = _run(torch.float32, store, microbatches=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, stock_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))


def test_the_ledger_counts_the_cuda_flash_kernel_like_the_cpu_one():
    """The CUDA kernel's ops take the sequence bounds before ``is_causal`` in their backward;
    their counts equal the CPU kernel's for the same shapes (checked on meta tensors)."""
    from megatron_flat.runtime import ledger

    q, k, v, o = (torch.empty(B, HEADS, S, 8, device="meta") for _ in range(4))
    lse = torch.empty(B, HEADS, S, device="meta")
    aten = torch.ops.aten
    count = {op: ledger._FLOPS[getattr(aten, op).default] for op in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward")}
    assert count["_scaled_dot_product_flash_attention"](q, k, v, 0.0, True) == \
        count["_scaled_dot_product_flash_attention_for_cpu"](q, k, v, 0.0, True)
    assert count["_scaled_dot_product_flash_attention_backward"](
        o, q, k, v, o, lse, None, None, S, S, 0.0, True) == \
        count["_scaled_dot_product_flash_attention_for_cpu_backward"](o, q, k, v, o, lse, 0.0,
                                                                      True)


def test_the_gpu_step_time_benchmark_runs_on_cpu(benchmark_script, tmp_path):
    """benchmarks/gpu_attention_replay.py at its CPU smoke shape: bitwise, half the attention
    forwards, the FLOP-predicted saving positive (the GPU check runs it at 8 x 16K on CUDA)."""
    import json

    bench = benchmark_script("gpu_attention_replay")
    out = tmp_path / "replay.json"
    assert bench.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    stock, replay = data["records"]
    assert data["bitwise"] and 2 * replay["attention_forward_calls"] == \
        stock["attention_forward_calls"]
    assert 0 < data["predicted_saving"] < 0.5 and replay["d2h_bytes"] == replay["h2d_bytes"] > 0


def test_the_cuda_kernels_arguments_line_up_with_torchs_schemas():
    """The CUDA flash kernel's forward outputs, kept as ``meta``, feed its backward in the
    order the schema wants (checked on meta tensors, which run the ops' shape functions)."""
    from megatron_flat.attention.replay import _KERNELS

    q, k, v = (torch.empty(B, HEADS, S, 8, device="meta", dtype=torch.bfloat16)
               for _ in range(3))
    (out, lse, cum_q, cum_k, max_q, max_k, seed, offset,
     _) = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.1, True, False)
    meta = (cum_q, cum_k, max_q, max_k, seed, offset, 0)
    dq, dk, dv = _KERNELS["cuda"].backward(torch.empty_like(out), q, k, v, out, lse, meta,
                                           None, 0.1)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert lse.dtype == torch.float32 and out.shape == q.shape
