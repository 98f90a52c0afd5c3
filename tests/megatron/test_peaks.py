"""Per-component sections of a Megatron step (what the demo's peak table reports)."""

import pytest
import torch

from megatron_flat.megatron.peaks import BOUNDARIES, COMPONENTS, DISPATCH, VOCAB, attach_peak_sections
from megatron_flat.runtime.memory import MemoryMeter

F32 = 4


def _run(tiny, recompute=None):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, global_batch, transformer_config

    with megatron_layout(seed=tiny.seed):
        model = build_tiny_gpt(tiny, transformer_config(tiny, recompute=recompute))
        mb = global_batch(tiny)[0]
        model(mb.tokens, mb.position_ids, None, labels=mb.labels)  # warm one-time caches
        with MemoryMeter("cpu") as meter:
            handle = attach_peak_sections(model, meter)
            loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels).mean()
            loss.backward()
            handle.remove()
    return meter


@pytest.fixture(scope="module")
def tiny(megatron_cpu):
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE(micro_batch_size=1, seq_length=64, vocab_size=1024)


def test_every_component_is_measured_forward_and_backward(tiny):
    meter = _run(tiny)
    n_tokens, hidden = tiny.seq_length * tiny.micro_batch_size, tiny.hidden_size
    # Forward and backward of each MoE layer; forward and backward of the output layer.
    assert meter.sections[DISPATCH].entries == 2 * tiny.num_layers
    assert meter.sections[VOCAB].entries == 2
    assert meter.sections[BOUNDARIES].entries == 1
    # Lower bounds from what must exist: fp32 logits N x V; k routed copies of N x H.
    assert meter.sections[VOCAB].peak_device_bytes >= n_tokens * tiny.vocab_size * F32
    assert meter.sections[DISPATCH].peak_device_bytes >= tiny.topk * n_tokens * hidden * F32
    assert meter.sections[BOUNDARIES].peak_device_bytes >= n_tokens * hidden * F32


def test_recompute_hooks_fire_in_recomputed_forward(tiny):
    meter = _run(tiny, recompute="full")
    # Original forward (no grad), recomputed forward and backward of each MoE layer.
    assert meter.sections[DISPATCH].entries == 3 * tiny.num_layers
    assert meter.sections[VOCAB].entries == 2


def test_vocab_peak_scales_with_tokens(tiny):
    # From 128 tokens on the section peaks with the N x V fp32 logits, beside per-token
    # vectors only: every tensor then is proportional to N, so twice the tokens is exactly
    # twice the bytes (at 64 tokens the V x H weight gradient's phase is the higher one).
    n = 2 * tiny.seq_length
    small = _run(tiny.with_(seq_length=n)).sections[VOCAB].peak_device_bytes
    large = _run(tiny.with_(seq_length=2 * n)).sections[VOCAB].peak_device_bytes
    assert small >= n * tiny.vocab_size * F32
    assert large == 2 * small


def test_hooks_are_removed(tiny):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, global_batch, transformer_config

    with megatron_layout(seed=tiny.seed):
        model = build_tiny_gpt(tiny, transformer_config(tiny))
        mb = global_batch(tiny)[0]
        with MemoryMeter("cpu") as meter:
            attach_peak_sections(model, meter).remove()
            model(mb.tokens, mb.position_ids, None, labels=mb.labels).mean().backward()
    assert all(meter.sections.get(name) is None or meter.sections[name].entries == 0
               for name in COMPONENTS)


def _held_with_cyclic_garbage(tiny, garbage_numel):
    """The boundaries' held bytes of one step whose first layer leaves a tensor of
    ``garbage_numel`` floats in a reference cycle (garbage once the layer returns)."""
    import gc

    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, global_batch, transformer_config

    def make_cycle(mod, args, output):
        cycle = {"tensor": torch.ones(garbage_numel)}
        cycle["self"] = cycle

    with megatron_layout(seed=tiny.seed):
        model = build_tiny_gpt(tiny, transformer_config(tiny))
        mb = global_batch(tiny)[0]
        model(mb.tokens, mb.position_ids, None, labels=mb.labels)  # warm one-time caches
        hook = model.decoder.layers[0].register_forward_hook(make_cycle)
        frozen_before = gc.get_freeze_count()
        gc.disable()  # only the sections' own collects may free the cycle
        try:
            with MemoryMeter("cpu") as meter:
                sections = attach_peak_sections(model, meter)
                loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels).mean()
                frozen_during = gc.get_freeze_count()
                loss.backward()
                sections.remove()
        finally:
            gc.enable()
            hook.remove()
    return meter.sections[BOUNDARIES].peak_device_bytes, frozen_before, frozen_during, \
        gc.get_freeze_count()


def test_boundary_collects_free_the_steps_cycles_with_the_heap_frozen(tiny):
    """The decoder's collects freeze what was alive at the first forward (a full walk of
    Megatron's heap each time cost a third of a rehearsal run), yet still free every cycle
    the step made: a 1 MiB tensor left in a cycle inside the forward is not held. The heap
    is unfrozen when the sections are removed."""
    plain, *_ = _held_with_cyclic_garbage(tiny, 0)
    held, before, during, after = _held_with_cyclic_garbage(tiny, 1 << 18)
    assert held == plain
    assert during > before and after == before


def test_the_heap_thaws_when_the_last_sections_are_removed(tiny):
    import gc

    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, global_batch, transformer_config

    before = gc.get_freeze_count()
    with megatron_layout(seed=tiny.seed):
        model = build_tiny_gpt(tiny, transformer_config(tiny))
        mb = global_batch(tiny)[0]
        with MemoryMeter("cpu") as meter:
            first, second = attach_peak_sections(model, meter), attach_peak_sections(model, meter)
            model(mb.tokens, mb.position_ids, None, labels=mb.labels).mean().backward()
            first.remove()
            assert gc.get_freeze_count() > before  # the second sections still collect
            second.remove()
    assert gc.get_freeze_count() == before
