"""Attention replay in transformer-engine's own fused attention (``megatron.te_replay``), on
a GPU with TE (skipped without both): a stack of layers (QKV projection, TE's
``DotProductAttention`` on its fused backend, output projection, a dropout after it) under
Megatron's reentrant ``tensor_parallel.checkpoint``, bf16, deterministic mode. Replay against
the same run without it: loss and every gradient bitwise, on the device and through a pinned
host pool, without and with attention dropout (the dropout after each layer draws from the
generator TE's kernel moves, so its masks stay stock's only if replay moves it as far); one
fused kernel per layer instead of two. The CPU tests run the same code on a stand-in
(``test_te_attention_replay.py``); this is the check on TE itself (``gpu_check.sh replay-te``)."""

from __future__ import annotations

import os

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS, B, S, HEADS, D = 4, 1, 8192, 16, 128
H = HEADS * D


@pytest.fixture(scope="module", autouse=True)
def megatron_rng():
    """One rank's Megatron: its process groups and RNG tracker (the checkpoint saves and
    restores the tracker's states; TE's dropout forks it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    os.environ["NVTE_FLASH_ATTN"], os.environ["NVTE_FUSED_ATTN"] = "0", "1"
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1,
                                rank=0)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous)
    parallel_state.destroy_model_parallel()


class Layer(torch.nn.Module):
    def __init__(self, dropout: float):
        from megatron.core import tensor_parallel

        super().__init__()
        self.dropout = dropout
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False)
        self.attention = te.DotProductAttention(
            HEADS, D, attention_dropout=dropout, attn_mask_type="causal", qkv_format="sbhd",
            get_rng_state_tracker=tensor_parallel.get_cuda_rng_tracker)
        self.proj = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):  # x: [s, b, h]
        q, k, v = (t.reshape(S, B, HEADS, D) for t in self.qkv(x).chunk(3, -1))
        out = self.proj(self.attention(q, k, v))
        return x + torch.nn.functional.dropout(out, self.dropout)


def _run(replay: str, dropout: float):
    from megatron.core import tensor_parallel

    from megatron_flat.attention.replay import ReplayStore
    from megatron_flat.megatron import attention_replay

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(dropout) for _ in range(LAYERS)).cuda().bfloat16()
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    stores = []
    if replay != "stock":
        host = None
        if replay == "host":
            from megatron_flat.attention.replay_host import ReplayHost
            from megatron_flat.checkpoint.transfer import SpanMover
            from megatron_flat.runtime import HostPool

            pair = B * S * (H * 2 + HEADS * 4) + 64
            host = ReplayHost(SpanMover(HostPool(LAYERS * pair + (1 << 20), pin_memory=True)))
        stores = [a.replay for a in attention_replay.attach(layers, host=host)]
        assert len(stores) == LAYERS
    torch.manual_seed(1)
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        h = x
        for layer in layers:
            h = tensor_parallel.checkpoint(layer, False, h)
        loss = h.float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
    finally:
        attention_replay.detach(layers)
        attention_replay.disable()
    kernels = sum(s.kernel_forwards for s in stores)
    replays = sum(s.replays for s in stores)
    return loss.detach(), [x.grad] + [p.grad for p in layers.parameters()], kernels, replays


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_te_replay_is_bitwise_stock(dropout):
    stock = _run("stock", dropout)
    control = _run("stock", dropout)  # TE's backward repeats bitwise here, or nothing can
    assert torch.equal(stock[0], control[0])
    assert all(torch.equal(a, b) for a, b in zip(stock[1], control[1])), \
        "TE's fused backward is not deterministic here: replay cannot be compared bitwise"
    for tier in ("device", "host"):
        got = _run(tier, dropout)
        assert torch.equal(got[0], stock[0]), tier
        assert all(torch.equal(a, b) for a, b in zip(got[1], stock[1])), tier
        assert got[2:] == (LAYERS, LAYERS), (tier, got[2:])  # kernels run, re-runs served
