"""Attention replay at 2 ranks: EP 2, TP 2 with sequence parallelism, PP 2 and CP 2 (the CPU
backend's context-parallel attention, which keeps both of its slots' (O, LSE)), each with
hidden dropout on. ``--flat-attn-replay`` with SCO against SCO alone, same weights: every
step's loss and every gradient bitwise equal, the ledger's attention kernels halved (CP:
two kernels per slot but the first, all skipped in the re-run), every kept output through
SCO's host pool; in fp32 and in Megatron's bf16 training. transformer-engine's fused
attention (its CPU stand-in) replays the same way at EP 2, TP 2 + SP and PP 2."""

import importlib.util
import pathlib

import pytest
import torch

pytestmark = pytest.mark.world(2)

from tests.megatron import _replay as replay_runs

STEPS = 2
SCO = dict(sco=True, sco_host_budget_gib=0.01)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["ep2", "tp2-sp", "pp2", "cp2"])
def test_replay_equals_stock_recompute_in_every_layout(megatron_cpu, layout, dtype):
    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron import attention_replay
    from megatron_flat.testing.tiny_gpt import TinyMoE
    from megatron_flat.testing.training import Layout

    split = {"ep2": dict(ep=2), "tp2-sp": dict(tp=2), "pp2": dict(pp=2),
             "cp2": dict(cp=2)}[layout]
    tiny = TinyMoE(attention="flash", global_batch_size=4, hidden_dropout=0.1,
                   **({"num_layers": 4} if layout == "pp2" else {}))
    run = Layout(recompute="full", **split)
    settings = replay_runs.bf16() if dtype == "bf16" else {}
    try:
        stock = replay_runs.train(tiny, run, FlatConfig(**SCO), **settings)
        replay = replay_runs.train(tiny, run, FlatConfig(attn_replay=True, **SCO), **settings)
    finally:
        attention_replay.disable()
    assert replay.dtypes == {getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])}
    assert replay.losses == stock.losses, layout  # bitwise
    assert len(replay.grads) == len(stock.grads)
    assert all(torch.equal(a, b) for a, b in zip(replay.grads, stock.grads)), layout
    assert stock.calls[0] > 0 and all(2 * r == s for r, s in zip(replay.calls, stock.calls)), \
        (replay.calls, stock.calls)
    stats = replay.stats
    assert stats.kept > 0 and stats.not_kept == 0 and stats.bytes_offloaded == \
        stats.bytes_reloaded
    assert replay.pool_used == 0  # the pool is empty after the steps


@pytest.mark.parametrize("layout", ["ep2-four", "tp2-tiles"])
def test_replay_composes_with_the_other_techniques(megatron_cpu, layout):
    """With PipelinedLLEP (graph-only re-run: its own wrapper on the checkpoint's backward),
    Ring-DTP, SCO and OffloadStreamAdamW at EP 2; with the attention tiles, Ring-DTP and SCO
    at TP 2 + SP: the same run without replay, bitwise, with half the attention kernels."""
    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron import attention_replay, regions
    from megatron_flat.testing.tiny_gpt import TinyMoE
    from megatron_flat.testing.training import Layout

    if layout == "ep2-four":
        run = Layout(ep=2, recompute="full", distributed_optimizer=True)
        knobs = dict(dispatch="pipelined", dispatch_chunk_tokens=16, dispatch_max_chunks=8,
                     vocab=True, vocab_block_size=64, optimizer_offload=True,
                     optimizer_bucket_numel=4096, **SCO)
    else:
        run = Layout(tp=2, recompute="full")
        knobs = dict(attn_tiles=16, vocab=True, vocab_block_size=64, **SCO)
    tiny = TinyMoE(attention="flash", global_batch_size=4, hidden_dropout=0.1)
    had_regions = regions.enabled()
    try:
        without = replay_runs.train(tiny, run, FlatConfig(**knobs))
        replay = replay_runs.train(tiny, run, FlatConfig(attn_replay=True, **knobs))
    finally:
        attention_replay.disable()
        if not had_regions:
            regions.disable()
    assert replay.losses == without.losses, layout
    assert all(torch.equal(a, b) for a, b in zip(replay.grads, without.grads)), layout
    assert all(2 * r == s for r, s in zip(replay.calls, without.calls)) and without.calls[0] > 0
    assert replay.stats.kept > 0 and replay.stats.not_kept == 0 and replay.pool_used == 0
    # the other techniques are in the model, not only in the config
    built = {"ep2-four": {"FlatMoELayer", "FlashCoreAttention"},
             "tp2-tiles": {"TiledColumnParallelLinear", "TiledRowParallelLinear"}}[layout]
    assert built <= replay.modules, replay.modules


@pytest.mark.parametrize("layout", ["ep2", "tp2-sp", "pp2"])
def test_te_replay_in_every_layout(megatron_cpu, monkeypatch, layout):
    """transformer-engine's fused attention (``megatron.te_replay``, on the CPU stand-in of
    ``_te_standin``) in the same layouts: bitwise the same run without replay, half the
    stand-in's forward kernels, the same backward kernels."""
    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron import attention_replay
    from megatron_flat.cpu import flash_attention
    from megatron_flat.testing.tiny_gpt import TinyMoE
    from megatron_flat.testing.training import Layout

    spec = importlib.util.spec_from_file_location(
        "_te_standin", pathlib.Path(__file__).with_name("_te_standin.py"))
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    monkeypatch.setattr(flash_attention, "FlashCoreAttention", standin.CoreAttention)
    split = {"ep2": dict(ep=2), "tp2-sp": dict(tp=2), "pp2": dict(pp=2)}[layout]
    tiny = TinyMoE(attention="flash", global_batch_size=4, hidden_dropout=0.1,
                   **({"num_layers": 4} if layout == "pp2" else {}))
    run = Layout(recompute="full", **split)
    calls = []
    with standin.installed():
        try:
            for replay in (False, True):
                standin.calls.update(forward=0, backward=0)
                calls.append((replay_runs.train(tiny, run, FlatConfig(attn_replay=replay, **SCO)),
                              dict(standin.calls)))
        finally:
            attention_replay.disable()
    (stock, stock_calls), (replay, replay_calls) = calls
    assert "CoreAttention" in replay.modules
    assert replay.losses == stock.losses, layout
    assert all(torch.equal(a, b) for a, b in zip(replay.grads, stock.grads)), layout
    assert stock_calls["forward"] > 0 and replay_calls == {
        "forward": stock_calls["forward"] // 2, "backward": stock_calls["backward"]}
    assert replay.stats.kept > 0 and replay.stats.not_kept == 0 and replay.pool_used == 0
