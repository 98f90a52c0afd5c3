"""Attention replay in a Megatron GPT under full recompute (world of one, CPU flash core
attention): ``megatron.attention_replay.attach`` against the same run without it, from the
same weights. Every step's loss, every gradient and the parameters after the last step
bitwise equal; the ledger counts one attention forward per layer and microbatch instead of
two, the same backwards; nothing left kept between steps; a forward without a checkpoint
(no recompute, or evaluation) keeps nothing."""


import pytest
import torch

STEPS = 2
from tests.megatron import _replay as replay_runs


def _tiny(**over):
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE(attention="flash", **{"global_batch_size": 4, **over})


def _train(tiny, replay: bool, recompute="full", bf16=False):
    from megatron_flat.megatron import attention_replay
    from megatron_flat.runtime.ledger import CostLedger
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout, Trainer

    with megatron_layout(seed=tiny.seed):
        trainer = Trainer(tiny, Layout(recompute=recompute), **(replay_runs.bf16() if bf16 else {}))
        stores = [a.replay for a in attention_replay.attach(trainer.model)] if replay else []
        losses, grads, counts = [], None, []
        try:
            for step in range(STEPS):
                with CostLedger() as ledger:
                    losses.append(trainer.forward_backward(step))
                counts.append((ledger.attention_forward_calls, ledger.attention_backward_calls))
                assert all(len(s) == 0 for s in stores), "outputs left kept after a step"
                if grads is None:
                    grads = [p.main_grad.clone() for p in trainer.model.parameters()]
                trainer.optimizer_step()
        finally:
            attention_replay.detach(trainer.model)
            attention_replay.disable()  # process-wide: leave later tests Megatron's own
        params = [p.detach().clone() for p in trainer.model.parameters()]
    return losses, grads, params, counts, stores


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_replay_equals_stock_with_one_attention_forward_per_layer(megatron_cpu, bf16):
    tiny = _tiny()
    stock = _train(tiny, replay=False, bf16=bf16)
    replay = _train(tiny, replay=True, bf16=bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert {p.dtype for p in replay[2]} == {dtype}  # the run is in the dtype it claims
    assert replay[0] == stock[0]  # losses, bitwise
    for name, ours, theirs in (("gradient", replay[1], stock[1]),
                               ("parameter", replay[2], stock[2])):
        assert len(ours) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), name
    microbatches = tiny.global_batch_size // tiny.micro_batch_size
    calls = tiny.num_layers * microbatches
    assert stock[3] == [(2 * calls, calls)] * STEPS
    assert replay[3] == [(calls, calls)] * STEPS
    assert sum(s.replays for s in replay[4]) == calls * STEPS


def test_without_recompute_nothing_is_kept(megatron_cpu):
    tiny = _tiny()
    stock = _train(tiny, replay=False, recompute=None)
    replay = _train(tiny, replay=True, recompute=None)
    assert replay[0] == stock[0]
    assert replay[3] == stock[3]
    assert all(s.kernel_forwards == 0 and s.replays == 0 for s in replay[4])


def test_a_model_without_a_replayable_attention_is_refused(megatron_cpu):
    from megatron_flat.megatron import attention_replay
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout, Trainer
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE()  # Megatron's local DotProductAttention
    with megatron_layout(seed=tiny.seed):
        trainer = Trainer(tiny, Layout(recompute="full"))
        with pytest.raises(ValueError, match="has none"):
            attention_replay.attach(trainer.model)


def test_phase_marks_compose_with_the_recompute_regions(megatron_cpu):
    """``megatron.regions`` (graph-only recompute) hooks ``CheckpointFunction.backward`` too,
    through the same single wrapper (``megatron.checkpoint_hooks``): either order of enabling,
    both hooks run, each disable removes only its own, and with both gone Megatron's
    functions are its own again."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from megatron_flat.megatron import attention_replay, regions

    had_regions = regions.enabled()  # other tests in this process may have left either on
    regions.disable()
    attention_replay.disable()
    stock_forward, stock_backward = CheckpointFunction.forward, CheckpointFunction.backward
    assert getattr(stock_backward, "__wrapped__", None) is None
    try:
        for first, second in ((attention_replay, regions), (regions, attention_replay)):
            first.enable()
            second.enable()
            assert attention_replay.enabled() and regions.enabled()
            wrapped = CheckpointFunction.backward
            assert CheckpointFunction.forward is not stock_forward
            assert wrapped is not stock_backward
            attention_replay.disable()
            assert not attention_replay.enabled() and regions.enabled()
            assert CheckpointFunction.backward is wrapped  # one wrapper; its hooks changed
            regions.disable()
            attention_replay.disable()
            assert CheckpointFunction.forward is stock_forward
            assert CheckpointFunction.backward is stock_backward
    finally:
        if had_regions:
            regions.enable()


# -- --flat-attn-replay: the Trainer's flat path, in SCO's host pool -----------------------

def _train_flat(tiny, flat):
    from megatron_flat.testing.training import Layout

    return replay_runs.train(tiny, Layout(recompute="full"), flat, STEPS)


def test_the_flag_keeps_outputs_in_scos_pool_bitwise(megatron_cpu):
    """SCO with and without ``attn_replay``: the same losses and gradients bitwise, one
    attention forward per layer and microbatch, every kept pair through SCO's pool (the
    previous layer's prefetched), the pool empty after each step."""
    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron import attention_replay

    tiny = _tiny()
    sco = dict(sco=True, sco_host_budget_gib=0.01)
    try:
        stock = _train_flat(tiny, FlatConfig(**sco))
        replay = _train_flat(tiny, FlatConfig(attn_replay=True, **sco))
    finally:
        attention_replay.disable()
    assert replay.losses == stock.losses
    assert all(torch.equal(a, b) for a, b in zip(replay.grads, stock.grads))
    microbatches = tiny.global_batch_size // tiny.micro_batch_size
    calls = tiny.num_layers * microbatches
    assert stock.calls == [2 * calls] * STEPS and replay.calls == [calls] * STEPS
    stats = replay.stats
    assert stats.kept == calls * STEPS and stats.not_kept == 0
    # one on-demand reload per microbatch (its last layer's re-run comes first)
    assert stats.reloads_on_demand == microbatches * STEPS
    assert stats.prefetch_hits == stats.prefetched == (calls - microbatches) * STEPS
    assert replay.pool_used == 0


@pytest.mark.parametrize("settings, reason", [
    (dict(sco=False), "no host budget"),
    (dict(sco=True, sco_host_budget_gib=0.0), "no host budget"),
])
def test_no_host_budget_falls_back_to_the_stock_recompute_with_one_warning(
        megatron_cpu, settings, reason):
    from megatron_flat.config import FlatConfig

    tiny = _tiny()
    with pytest.warns(UserWarning, match=reason) as caught:
        from megatron_flat.testing.distributed import megatron_layout
        from megatron_flat.testing.training import Layout, Trainer

        with megatron_layout(seed=tiny.seed):
            trainer = Trainer(tiny, Layout(recompute="full"),
                              flat=FlatConfig(attn_replay=True, **settings))
    assert len([w for w in caught if "attn-replay" in str(w.message)]) == 1
    assert trainer.replay_stores == []
