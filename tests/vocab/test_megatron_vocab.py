"""Ring-DTP as GPTModel's output layer + loss, on one rank (TP = 1: the blocked version).

Loss and every gradient against the stock model (untied and tied embeddings); how the
plugin turns it on (per model, or for every model once installed); what it refuses; and
that the peak meter's "vocabulary projection + loss" section measures the Ring-DTP path.
Multi-rank checks against Megatron's vocab-parallel cross-entropy and whole training
steps: ``test_megatron_vocab_worlds.py``.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_flat.config import FlatConfig


def _pair(tiny, *, block_size=48, debug_checks=False):
    """(stock model, Ring-DTP model) with the same weights, built at TP = 1."""
    from megatron_flat.megatron.vocab import enable_ring_dtp
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, transformer_config

    stock = build_tiny_gpt(tiny, transformer_config(tiny))
    flat = build_tiny_gpt(tiny, transformer_config(tiny))
    flat.load_state_dict(stock.state_dict())
    enable_ring_dtp(flat, FlatConfig(vocab=True, vocab_block_size=block_size,
                                     debug_checks=debug_checks))
    return stock, flat


def _step(model, mb, loss_mask=None):
    kwargs = {} if loss_mask is None else {"loss_mask": loss_mask}
    loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels, **kwargs)
    total = loss.float() if loss_mask is None else loss.float() * loss_mask
    total.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_grads_match_the_stock_model(megatron_cpu, tied):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, global_batch

    tiny = TinyMoE(share_embeddings=tied)
    with megatron_layout(seed=tiny.seed):
        stock, flat = _pair(tiny)
        mb = global_batch(tiny)[0]
        mask = torch.ones(mb.labels.shape)
        mask[:, ::5] = 0
        want_loss, want = _step(stock, mb, mask)
        got_loss, got = _step(flat, mb, mask)
    assert got_loss.shape == want_loss.shape == (tiny.micro_batch_size, tiny.seq_length)
    assert got_loss.dtype == torch.float32
    # fp32: the vocabulary blocks reorder the log-sum-exp's and the weight gradient's sums
    torch.testing.assert_close(got_loss * mask, want_loss * mask, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(got_loss[mask == 0]) == 0  # masked: no loss at all
    assert set(got) == set(want)
    assert ("output_layer.weight" in got) == (not tied)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def _mtp_tracker():
    """Megatron's MTP loss tracker values (the logged per-head losses), then cleared."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    out = {k: v.clone() for k, v in tracker.items() if isinstance(v, torch.Tensor)}
    tracker.clear()
    return out


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mtp_heads_match_the_stock_model(megatron_cpu, tied, heads):
    """Every MTP head's projection + loss through Ring-DTP: the main loss, the heads' logged
    losses and every gradient (MTP layers, embedding, output weight) as stock Megatron."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_flat.megatron.vocab import RingDTPHeads
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, global_batch

    tiny = TinyMoE(share_embeddings=tied, mtp_num_layers=heads)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    _mtp_tracker()
    calls = []
    original = RingDTPHeads.loss
    with megatron_layout(seed=tiny.seed):
        stock, flat = _pair(tiny)
        stock.train(), flat.train()
        mb = global_batch(tiny)[0]
        mask = torch.ones(mb.labels.shape)
        mask[:, ::5] = 0
        want_loss, want = _step(stock, mb, mask)
        want_logged = _mtp_tracker()
        try:
            RingDTPHeads.loss = lambda self, *a: calls.append(1) or original(self, *a)
            got_loss, got = _step(flat, mb, mask)
        finally:
            RingDTPHeads.loss = original
        got_logged = _mtp_tracker()
    # Ring-DTP ran every head (0.16 routes the main head through the same stand-in).
    assert len(calls) in (heads, heads + 1)
    # fp32: the vocabulary blocks reorder the log-sum-exp's and the weight gradient's sums
    torch.testing.assert_close(got_loss * mask, want_loss * mask, rtol=1e-5, atol=1e-6)
    assert want_logged and set(got_logged) >= set(want_logged)
    for key, value in want_logged.items():
        torch.testing.assert_close(got_logged[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert set(got) == set(want) and any(name.startswith("mtp.") for name in want)
    for name in want:
        assert want[name].any() or not got[name].any(), name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_install_wiring_turns_every_gpt_model_on(megatron_cpu, monkeypatch):
    """``wire_vocab`` (install's hook) + an installed FlatConfig with vocab on: a GPTModel
    built afterwards computes its loss through Ring-DTP with the installed knobs."""
    from megatron_flat.megatron import state
    from megatron_flat.megatron.vocab import ring_dtp_output, wire_vocab
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import (
        TinyMoE,
        build_tiny_gpt,
        global_batch,
        transformer_config,
    )

    tiny = TinyMoE()
    flat = FlatConfig(vocab=True, vocab_mode="weights", vocab_block_size=40)
    with megatron_layout(seed=tiny.seed):
        model = build_tiny_gpt(tiny, transformer_config(tiny))
        assert ring_dtp_output(model) is None  # nothing installed: stock
        wire_vocab(flat, transformer_config(tiny))
        monkeypatch.setattr(state, "_INSTALLED", flat)
        calls = []
        model.output_layer.register_forward_pre_hook(lambda *_: calls.append("stock"))
        mb = global_batch(tiny)[0]
        loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels)
        ring = ring_dtp_output(model)
        assert ring is not None and (ring.mode, ring.block_size, ring.tp) == ("weights", 40, 1)
        assert calls == [] and loss.shape == (tiny.micro_batch_size, tiny.seq_length)
        monkeypatch.setattr(state, "_INSTALLED", FlatConfig())  # vocab off: stock again
        other = build_tiny_gpt(tiny, transformer_config(tiny))
        assert ring_dtp_output(other) is None


def test_unsupported_settings_are_refused(megatron_cpu):
    from megatron_flat.megatron.vocab import unsupported_settings, wire_vocab

    assert unsupported_settings(SimpleNamespace()) == []
    assert unsupported_settings(SimpleNamespace(mtp_num_layers=2)) == []  # MTP heads: supported
    args = SimpleNamespace(mtp_num_layers=1, defer_embedding_wgrad_compute=True)
    assert len(unsupported_settings(args)) == 1
    with pytest.raises(ValueError, match="defer-embedding-wgrad-compute"):
        wire_vocab(FlatConfig(vocab=True), args)


def test_enable_refuses_a_model_that_is_not_a_gpt_model(megatron_cpu):
    from megatron_flat.megatron.vocab import enable_ring_dtp

    with pytest.raises(TypeError, match="GPTModel"):
        enable_ring_dtp(torch.nn.Linear(2, 2))


def test_labels_in_no_vocab_row_raise(megatron_cpu):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, global_batch

    tiny = TinyMoE()
    with megatron_layout(seed=tiny.seed):
        _, flat = _pair(tiny)
        mb = global_batch(tiny)[0]
        labels = mb.labels.clone()
        labels[0, 3] = tiny.vocab_size
        loss = flat(mb.tokens, mb.position_ids, None, labels=labels)
        assert torch.isnan(loss[0, 3]) and int(torch.isnan(loss).sum()) == 1  # on the device
        checked = _pair(tiny, debug_checks=True)[1]  # --flat-debug-checks: a clear error
        with pytest.raises(ValueError, match="label"):
            checked(mb.tokens, mb.position_ids, None, labels=labels)


def test_a_callers_output_processor_wins(megatron_cpu):
    """0.19: Ring-DTP enters through Megatron's ``output_processor`` hook only when the caller
    passed none."""
    from megatron_flat.megatron import compat
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, global_batch

    if not compat.postprocess_has_output_processor():
        pytest.skip("megatron-core < 0.19 has no output_processor hook")
    tiny = TinyMoE()
    with megatron_layout(seed=tiny.seed):
        _, flat = _pair(tiny)
        mb = global_batch(tiny)[0]
        out = flat(mb.tokens, mb.position_ids, None, labels=mb.labels,
                   output_processor=lambda **kw: "mine")
    assert out == "mine"


def test_peak_section_measures_the_ring_path(megatron_cpu):
    """The demo's "vocabulary projection + loss" section opens around Ring-DTP's module
    (forward and backward) and sees far less than the stock path's logits."""
    from megatron_flat.megatron.peaks import VOCAB, attach_peak_sections
    from megatron_flat.runtime.memory import MemoryMeter
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, global_batch

    # N = 512 tokens >> H = 64, so the logits (N x V) dwarf the weight gradient (V x H) that
    # both paths produce.
    tiny = TinyMoE(micro_batch_size=1, seq_length=512, vocab_size=1024)
    peaks = {}
    with megatron_layout(seed=tiny.seed):
        stock, flat = _pair(tiny, block_size=128)
        mb = global_batch(tiny)[0]
        for name, model in (("stock", stock), ("flat", flat)):
            model(mb.tokens, mb.position_ids, None, labels=mb.labels)  # warm one-time caches
            with MemoryMeter("cpu") as meter:
                handle = attach_peak_sections(model, meter)
                model(mb.tokens, mb.position_ids, None, labels=mb.labels).mean().backward()
                handle.remove()
            assert meter.sections[VOCAB].entries == 2  # forward and backward
            peaks[name] = meter.sections[VOCAB].peak_device_bytes
    logits = tiny.seq_length * tiny.vocab_size * 4
    assert peaks["stock"] >= logits  # fp32 logits (the softmax and its gradient reuse them)
    # 128-row strips (an eighth of the logits each) + the V x H weight gradient + dX.
    assert peaks["flat"] < logits / 2, peaks
