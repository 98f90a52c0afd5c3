"""Attention replay in transformer-engine's fused attention (``megatron.te_replay``), on a CPU
stand-in for TE (``_te_standin``: TE's module layout, ``fused_attn_fwd``'s positional call and
``(out, [stats, rng_state])`` return, a kernel that draws its Philox pair on every call and a
backward that rebuilds probabilities and dropout mask from the kept stats and pair).

A tiny Megatron GPT with the stand-in as its core attention, full recompute, hidden dropout
on: replay against the same run without it, bitwise (losses, every gradient), half the
kernels; with attention dropout too; both TE layouts (2.3+ and 1.12–2.2). Negative controls:
a replay that does not move the generator, or returns a one-ulp different kept O, changes
the gradients. TE's context-parallel ring (its own module's global, once per step) replays
every step. Where it cannot replay (fp8 calls, TE's flash-attn backend, a release keeping the
kernel elsewhere) it runs stock and says so."""

import argparse
import importlib.util
import pathlib
import warnings

import pytest
import torch

STEPS = 2
SCO = dict(sco=True, sco_host_budget_gib=0.01)


def _sibling(name):
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(
        f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standin = _sibling("_te_standin")
replay_runs = _sibling("_replay")


@pytest.fixture
def te(monkeypatch):
    """The stand-in under TE's names, as the tiny model's core attention."""
    from megatron_flat.megatron import attention_replay
    from megatron_flat.cpu import flash_attention

    monkeypatch.setattr(flash_attention, "FlashCoreAttention", standin.CoreAttention)
    with standin.installed() as kernel:
        try:
            yield kernel
        finally:
            attention_replay.disable()


def _tiny(**over):
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE(attention="flash", global_batch_size=4, hidden_dropout=0.1, **over)


def _flat(replay):
    from megatron_flat.config import FlatConfig

    return FlatConfig(attn_replay=replay, **SCO)


def _kernels(run):
    standin.calls.update(forward=0, backward=0)
    result = run()
    return result, dict(standin.calls)


def _assert_bitwise(ours, theirs):
    assert ours.losses == theirs.losses
    assert len(ours.grads) == len(theirs.grads)
    assert all(torch.equal(a, b) for a, b in zip(ours.grads, theirs.grads))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_te_replay_equals_stock_with_half_the_kernels(megatron_cpu, te, dtype):
    """Through the Trainer's --flat-attn-replay path: SCO's host pool, the previous layer's
    pair prefetched; the stand-in kernel draws on every call, so hidden dropout after it
    would shift if the re-run did not move the generator."""
    from megatron_flat.testing.training import Layout

    tiny = _tiny()
    settings = replay_runs.bf16() if dtype == "bf16" else {}
    layout = Layout(recompute="full")
    stock, stock_calls = _kernels(lambda: replay_runs.train(tiny, layout, _flat(False),
                                                            STEPS, **settings))
    replay, replay_calls = _kernels(lambda: replay_runs.train(tiny, layout, _flat(True),
                                                              STEPS, **settings))
    _assert_bitwise(replay, stock)
    assert "CoreAttention" in replay.modules and "FlashCoreAttention" not in replay.modules
    microbatches = tiny.global_batch_size // tiny.micro_batch_size
    calls = tiny.num_layers * microbatches * STEPS
    assert stock_calls == {"forward": 2 * calls, "backward": calls}
    assert replay_calls == {"forward": calls, "backward": calls}
    stats = replay.stats
    assert stats.kept == calls and stats.not_kept == 0 and replay.pool_used == 0
    assert stats.prefetch_hits > 0  # one layer ahead, as for the CPU flash attention


def _train_attached(tiny, replay, *, perturb=None):
    """Steps with ``attention_replay.attach`` (device tier), optionally corrupting what the
    re-run gets back (negative controls)."""
    from megatron_flat.megatron import attention_replay
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout, Trainer

    with megatron_layout(seed=tiny.seed):
        trainer = Trainer(tiny, Layout(recompute="full"))
        stores = ([a.replay for a in attention_replay.attach(trainer.model)] if replay
                  else [])
        if perturb is not None:
            for store in stores:
                perturb(store)
        losses, grads = [], None
        for step in range(STEPS):
            losses.append(trainer.forward_backward(step))
            if grads is None:
                grads = [p.main_grad.clone() for p in trainer.model.parameters()]
            trainer.optimizer_step()
        attention_replay.detach(trainer.model)
    return replay_runs.Run(losses, grads, [], None, 0, set(), set())


def test_te_replay_with_attention_dropout(megatron_cpu, te):
    """TE keeps its dropout's [seed, offset] beside the stats: the re-run's backward draws
    the first pass's mask, and the generator moves as the kernel would have moved it."""
    tiny = _tiny(attention_dropout=0.1)
    stock, stock_calls = _kernels(lambda: _train_attached(tiny, replay=False))
    replay, replay_calls = _kernels(lambda: _train_attached(tiny, replay=True))
    _assert_bitwise(replay, stock)
    assert replay_calls["forward"] * 2 == stock_calls["forward"]


def _frozen_generator(monkeypatch):
    from megatron_flat.megatron import te_replay

    monkeypatch.setattr(te_replay, "_rng_advance", lambda device, drawn: None)


def _one_ulp_off(store):
    take = store.take_with_meta

    def perturbed(key):
        entry = take(key)
        if entry is not None:
            out, first = entry[0][0], (0,) * entry[0][0].dim()
            out[first] = torch.nextafter(out[first], torch.tensor(float("inf"), dtype=out.dtype))
        return entry

    store.take_with_meta = perturbed


@pytest.mark.parametrize("control", ["generator not moved", "kept O one ulp off"])
def test_negative_controls_break_equality(megatron_cpu, te, monkeypatch, control):
    tiny = _tiny(attention_dropout=0.1)
    stock = _train_attached(tiny, replay=False)
    if control == "generator not moved":
        _frozen_generator(monkeypatch)
        broken = _train_attached(tiny, replay=True)
    else:
        broken = _train_attached(tiny, replay=True, perturb=_one_ulp_off)
    assert not all(torch.equal(a, b) for a, b in zip(broken.grads, stock.grads)), control


@pytest.mark.parametrize("layout", list(standin.LAYOUTS))
def test_kernel_found_in_each_release_layout(megatron_cpu, monkeypatch, layout):
    from megatron_flat.megatron import attention_replay, replay_wiring, te_replay

    monkeypatch.setattr("megatron_flat.cpu.flash_attention.FlashCoreAttention",
                        standin.CoreAttention)
    with standin.installed(layout) as kernel:
        try:
            assert te_replay.kernel_module() is kernel and te_replay.unsupported() is None
            original = kernel.fused_attn_fwd
            te_replay.enable(replay_wiring.current_store, replay_wiring.warn_once)
            assert kernel.fused_attn_fwd is not original and te_replay.enabled()
            tiny = _tiny()
            stock, stock_calls = _kernels(lambda: _train_attached(tiny, replay=False))
            replay, replay_calls = _kernels(lambda: _train_attached(tiny, replay=True))
            _assert_bitwise(replay, stock)
            assert replay_calls["forward"] * 2 == stock_calls["forward"]
        finally:
            attention_replay.disable()
        assert kernel.fused_attn_fwd is original and not te_replay.enabled()


def test_a_release_keeping_the_kernel_elsewhere_falls_back(megatron_cpu):
    from megatron_flat.megatron import replay_wiring, te_replay

    with standin.installed(layout=None):
        assert te_replay.kernel_module() is None
        assert "keeps FusedAttnFunc's fused_attn_fwd in none of" in te_replay.unsupported()
        with pytest.raises(RuntimeError, match="in none of"):
            te_replay.enable(replay_wiring.current_store, replay_wiring.warn_once)
        args = argparse.Namespace(transformer_impl="transformer_engine",
                                  recompute_granularity="full")
        reasons = replay_wiring.fallback_reasons(_flat(True), args)
        assert len(reasons) == 1 and "in none of" in reasons[0]


def test_fallback_reasons_under_transformer_engine(megatron_cpu, te):
    from megatron_flat.megatron import replay_wiring

    def reasons(**settings):
        args = argparse.Namespace(transformer_impl="transformer_engine",
                                  recompute_granularity="full", **settings)
        return replay_wiring.fallback_reasons(_flat(True), args)

    assert reasons() == []
    assert reasons(attention_dropout=0.1) == []  # TE replays its dropout
    assert reasons(context_parallel_size=2) == []  # and its ring's steps
    local = argparse.Namespace(transformer_impl="local", attention_dropout=0.1)
    assert any("attention dropout" in r for r in
               replay_wiring.fallback_reasons(_flat(True), local))


def test_without_transformer_engine_the_te_line_falls_back(megatron_cpu):
    from megatron_flat.megatron import te_replay

    if te_replay.attention_class() is not None:
        pytest.skip("transformer-engine is importable here")
    assert "not importable" in te_replay.unsupported()


def test_te_context_parallel_ring_replays_every_step(megatron_cpu, monkeypatch):
    """TE's CP attention calls the kernel by its own module's global once per ring step and
    merges the partials by their log-sum-exps: every step's partial is kept under its call
    index and the re-run merges the kept ones; bitwise stock, half the kernels, the same
    backward kernels (one per step, on the merged output and statistics)."""
    from megatron_flat.megatron import attention_replay, te_replay
    from megatron_flat.testing.training import Layout

    monkeypatch.setattr("megatron_flat.cpu.flash_attention.FlashCoreAttention",
                        standin.CoreAttention)
    with standin.installed(cp=True):
        try:
            assert len(te_replay._cp_modules()) == 1
            tiny = _tiny()
            layout = Layout(recompute="full")
            stock, stock_calls = _kernels(lambda: replay_runs.train(tiny, layout, _flat(False),
                                                                    STEPS))
            replay, replay_calls = _kernels(lambda: replay_runs.train(tiny, layout, _flat(True),
                                                                      STEPS))
        finally:
            attention_replay.disable()
    _assert_bitwise(replay, stock)
    steps = 3 * tiny.num_layers * (tiny.global_batch_size // tiny.micro_batch_size) * STEPS
    assert stock_calls == {"forward": 2 * steps, "backward": steps}
    assert replay_calls == {"forward": steps, "backward": steps}
    assert replay.stats.kept == steps and replay.pool_used == 0


def test_te_flash_backend_runs_stock_and_says_so_once(megatron_cpu, monkeypatch):
    from megatron_flat.megatron import attention_replay

    monkeypatch.setattr("megatron_flat.cpu.flash_attention.FlashCoreAttention",
                        standin.CoreAttention)
    with standin.installed(backend="flash"):
        try:
            tiny = _tiny()
            stock = _train_attached(tiny, replay=False)
            with pytest.warns(UserWarning, match="ran no fused attention kernel") as caught:
                replay = _train_attached(tiny, replay=True)
        finally:
            attention_replay.disable()
    _assert_bitwise(replay, stock)
    assert len([w for w in caught if "no fused attention kernel" in str(w.message)]) == 1


def test_te_calls_with_a_softmax_offset_run_stock_say_so_once_and_are_counted(megatron_cpu, te,
                                                                               monkeypatch):
    """Attention sinks: TE returns the softmax offset among its auxiliary tensors (an input
    its backward needs, not a result). Those calls are not kept: the re-run runs the kernel
    as stock, counted in ``stock_reruns`` (what a rehearsal's report prints), and the run
    says so once; losses and gradients stay stock's."""
    import functools

    fwd, bwd = te.fused_attn_fwd, te.fused_attn_bwd

    @functools.wraps(fwd)  # TE's signature: replay binds the call's arguments by name
    def with_offset(*args, **kwargs):
        out, aux = fwd(*args, **kwargs)
        return out, [*aux, torch.zeros(1)]

    def without_offset(*args, **kwargs):
        args = list(args)
        args[11] = list(args[11])[:2]  # aux_ctx_tensors: the stand-in's backward takes two
        return bwd(*args, **kwargs)

    monkeypatch.setattr(te, "fused_attn_fwd", with_offset)
    monkeypatch.setattr(te, "fused_attn_bwd", without_offset)
    tiny = _tiny()
    stock, stock_calls = _kernels(lambda: _train_attached(tiny, replay=False))
    stores = []
    with pytest.warns(UserWarning, match="softmax offset") as caught:
        replay, replay_calls = _kernels(lambda: _train_attached(tiny, replay=True,
                                                               perturb=stores.append))
    _assert_bitwise(replay, stock)
    assert replay_calls == stock_calls  # every re-run ran its kernel
    assert len([w for w in caught if "softmax offset" in str(w.message)]) == 1
    microbatches = tiny.global_batch_size // tiny.micro_batch_size
    reruns = tiny.num_layers * microbatches * STEPS
    assert sum(s.stock_reruns for s in stores) == reruns
    assert sum(s.replays for s in stores) == 0 and all(len(s) == 0 for s in stores)


def test_fp8_calls_are_not_replayed(megatron_cpu):
    from megatron_flat.megatron import te_replay

    q = torch.zeros(2, 1, 1, 4)
    assert not te_replay._is_fp8({"q": q, "fused_attention_backend": "F16_arbitrary_seqlen"})
    assert te_replay._is_fp8({"q": q, "fused_attention_backend": "NVTE_Fused_Attn_Backend.FP8"})
    assert te_replay._is_fp8({"q": q.to(torch.uint8)})
    if hasattr(torch, "float8_e4m3fn"):
        assert te_replay._is_fp8({"q": q.to(torch.float8_e4m3fn)})


def test_outside_a_checkpoint_nothing_is_kept(megatron_cpu, te):
    """No recompute: every call runs its kernel and nothing is kept."""
    from megatron_flat.megatron import attention_replay
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout, Trainer

    tiny = _tiny()
    with megatron_layout(seed=tiny.seed):
        trainer = Trainer(tiny, Layout())
        stores = [a.replay for a in attention_replay.attach(trainer.model)]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            trainer.forward_backward(0)
        attention_replay.detach(trainer.model)
    assert stores and all(s.kernel_forwards == 0 and s.replays == 0 and len(s) == 0
                          for s in stores)


@pytest.mark.parametrize("cp", [1, 2])
def test_install_wires_te_replay(megatron_cpu, te, cp):
    """``--flat-attn-replay --transformer-impl transformer_engine``: TE's kernel swapped (and
    restored by the reset), with attention dropout, with and without CP."""
    import megatron_flat
    from megatron_flat.megatron import install as inst
    from megatron_flat.megatron import replay_wiring, te_replay
    from megatron_flat.testing.launch_args import megatron_args

    original = te.fused_attn_fwd
    args = megatron_args("--flat-attn-replay", "--flat-sco", "--flat-sco-host-budget-gib", "1",
                         recompute_granularity="full", transformer_impl="transformer_engine",
                         attention_dropout=0.1, context_parallel_size=cp)
    inst._reset_for_tests()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            megatron_flat.install(args)
        assert [w for w in caught if "attn-replay is off" in str(w.message)] == []
        assert replay_wiring.wired() and te_replay.enabled()
        assert te.fused_attn_fwd is not original
    finally:
        inst._reset_for_tests()
    assert te.fused_attn_fwd is original and not te_replay.enabled()
