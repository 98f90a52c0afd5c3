"""Attention replay at 2 ranks: EP 2, TP 2 with sequence parallelism, PP 2 and CP 2 (the CPU
backend's context-parallel attention, which keeps both of its slots' (O, LSE)), each with
hidden dropout on. ``--flat-attn-replay`` with SCO against SCO alone, same weights: every
step's loss and every gradient bitwise equal, the ledger's attention kernels halved (CP:
two kernels per slot but the first, all skipped in the re-run), every kept output through
SCO's host pool."""

import pytest
import torch

pytestmark = pytest.mark.world(2)

STEPS = 2
SCO = dict(sco=True, sco_host_budget_gib=0.01)


def _train(tiny, layout, flat):
    from megatron_flat.runtime.ledger import CostLedger
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Trainer

    with megatron_layout(layout.tp, layout.ep, layout.pp, cp=layout.cp, seed=tiny.seed):
        trainer = Trainer(tiny, layout, flat=flat)
        losses, grads, calls = [], None, []
        for step in range(STEPS):
            with CostLedger() as ledger:
                losses.append(trainer.forward_backward(step))
            calls.append(ledger.attention_forward_calls)
            if grads is None:
                grads = [p.main_grad.clone() for p in trainer.model.parameters()]
            trainer.optimizer_step()
        trainer.sco.synchronize()
        stats = [s.host.stats for s in trainer.replay_stores[:1]]
        used = trainer.sco.pool.stats()["used_bytes"]
        modules = {type(m).__name__ for m in trainer.model.modules()}
    return losses, grads, calls, stats, used, modules


@pytest.mark.parametrize("layout", ["ep2", "tp2-sp", "pp2", "cp2"])
def test_replay_equals_stock_recompute_in_every_layout(megatron_cpu, layout):
    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron import attention_replay
    from megatron_flat.testing.tiny_gpt import TinyMoE
    from megatron_flat.testing.training import Layout

    split = {"ep2": dict(ep=2), "tp2-sp": dict(tp=2), "pp2": dict(pp=2),
             "cp2": dict(cp=2)}[layout]
    tiny = TinyMoE(attention="flash", global_batch_size=4, hidden_dropout=0.1,
                   **({"num_layers": 4} if layout == "pp2" else {}))
    run = Layout(recompute="full", **split)
    try:
        stock = _train(tiny, run, FlatConfig(**SCO))
        replay = _train(tiny, run, FlatConfig(attn_replay=True, **SCO))
    finally:
        attention_replay.disable()
    assert replay[0] == stock[0], layout  # losses, bitwise
    assert len(replay[1]) == len(stock[1])
    assert all(torch.equal(a, b) for a, b in zip(replay[1], stock[1])), layout
    assert stock[2][0] > 0 and all(2 * r == s for r, s in zip(replay[2], stock[2])), \
        (replay[2], stock[2])
    (stats,) = replay[3]
    assert stats.kept > 0 and stats.not_kept == 0 and stats.bytes_offloaded == \
        stats.bytes_reloaded
    assert replay[4] == 0  # the pool is empty after the steps


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
        without = _train(tiny, run, FlatConfig(**knobs))
        replay = _train(tiny, run, FlatConfig(attn_replay=True, **knobs))
    finally:
        attention_replay.disable()
        if not had_regions:
            regions.disable()
    assert replay[0] == without[0], layout
    assert all(torch.equal(a, b) for a, b in zip(replay[1], without[1])), layout
    assert all(2 * r == s for r, s in zip(replay[2], without[2])) and without[2][0] > 0
    (stats,) = replay[3]
    assert stats.kept > 0 and stats.not_kept == 0 and replay[4] == 0
    # the other techniques are in the model, not only in the config
    built = {"ep2-four": {"FlatMoELayer", "FlashCoreAttention"},
             "tp2-tiles": {"TiledColumnParallelLinear", "TiledRowParallelLinear"}}[layout]
    assert built <= replay[5], replay[5]
