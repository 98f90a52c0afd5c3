"""Attention replay on CUDA (torch's flash kernel, bf16; skipped without CUDA): the kept O and
LSE equal a second run of the kernel bitwise, and a checkpointed attention stack's loss and
every gradient are bitwise stock's with the pairs on the device and in a pinned host pool
(side streams, prefetch one layer ahead), in deterministic mode, without and with attention
dropout (plus a dropout after each layer's projection, whose masks stay stock's only if the
replayed kernel's RNG draw is advanced). Shapes are large enough that
each device-to-host copy is still running when the next layer starts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron_flat.attention.replay import ReplayStore, _KERNELS, flash_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS, B, S, HEADS, D = 4, 1, 8192, 16, 128
H = HEADS * D


class Layer(torch.nn.Module):
    def __init__(self, index: int, dropout: float):
        super().__init__()
        self.index, self.dropout = index, dropout  # attention dropout, and after the projection
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False)
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.store = None

    def forward(self, x):
        q, k, v = (t.view(B, S, HEADS, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = flash_attention(q, k, v, store=self.store, key=self.index, dropout_p=self.dropout)
        # a dropout after the attention draws from the generator the replayed kernel no
        # longer draws from: its mask is unchanged only if replay advanced it as far
        out = self.proj(o.transpose(1, 2).reshape(B, S, H))
        return x + torch.nn.functional.dropout(out, self.dropout)


def _run(store, dropout=0.0):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(i, dropout) for i in range(LAYERS)).cuda().bfloat16()
    for layer in layers:
        layer.store = store
    torch.manual_seed(1)
    x = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = x
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=True)
    loss = h.float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [x.grad] + [p.grad for p in layers.parameters()]


@pytest.fixture(autouse=True)
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous)


def test_the_kept_pair_is_what_a_second_kernel_run_gives():
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(B, HEADS, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    kernel = _KERNELS["cuda"]
    first, again = kernel.forward(q, k, v, None), kernel.forward(q, k, v, None)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert torch.equal(first[0], kernel.stock(q, k, v, None))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_replay_is_bitwise_stock_on_the_device_and_through_a_pinned_pool(dropout):
    from megatron_flat.attention.replay_host import ReplayHost
    from megatron_flat.checkpoint.transfer import SpanMover
    from megatron_flat.runtime import HostPool

    stock = _run(None, dropout)
    control = _run(None, dropout)  # the stock backward itself repeats bitwise (deterministic mode)
    assert torch.equal(stock[0], control[0])
    assert all(torch.equal(a, b) for a, b in zip(stock[1], control[1])), \
        "the flash backward is not deterministic here: replay cannot be compared bitwise"
    device_tier = _run(ReplayStore(), dropout)
    mover = SpanMover(HostPool(LAYERS * B * S * (H * 2 + HEADS * 4) + (1 << 20), pin_memory=True))
    host = ReplayStore(ReplayHost(mover))
    host_tier = _run(host, dropout)
    for got in (device_tier, host_tier):
        assert torch.equal(got[0], stock[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], stock[1]))
    assert host.host.stats.kept == LAYERS and host.host.stats.prefetched == LAYERS - 1
