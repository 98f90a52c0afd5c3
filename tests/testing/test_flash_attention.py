"""FlashCoreAttention: DotProductAttention's math without its N×N scores (CPU)."""

import pytest
import torch


def _step(tiny, megatron_cpu_layout):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, global_batch, transformer_config

    torch.manual_seed(tiny.seed)
    model = build_tiny_gpt(tiny, transformer_config(tiny, recompute="full"))
    model.train()
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(tiny.seed)
    mb = global_batch(tiny, 0)[0]
    loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def test_flash_matches_local_attention_and_keeps_no_scores(megatron_cpu):
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.cpu.flash_attention import FlashCoreAttention
    from megatron_flat.testing.tiny_gpt import TinyMoE

    local = TinyMoE(num_layers=2, seq_length=64)
    flash = local.with_(attention="flash")
    with megatron_layout(seed=local.seed):
        ref_loss, ref_grads, _ = _step(local, None)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with megatron_layout(seed=flash.seed), Ops():
        loss, grads, model = _step(flash, None)
    assert sum(isinstance(m, FlashCoreAttention) for m in model.modules()) == 2
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    # fp32: the flash blocks reorder the softmax's sums (absolute error scales with each
    # gradient's largest value).
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5,
                                   atol=1e-5 * float(ref_grads[name].abs().max()))
    # torch's CPU flash kernel ran, forward and backward, not the N×N path (no batched
    # score matmul).
    assert any("_scaled_dot_product_flash_attention_for_cpu.default" in op for op in seen)
    assert any("_scaled_dot_product_flash_attention_for_cpu_backward" in op for op in seen)
    assert not any("baddbmm" in op or "bmm" in op for op in seen)


def test_flash_refuses_what_it_does_not_model(megatron_cpu):
    from megatron_flat.testing.tiny_gpt import TinyMoE

    with pytest.raises(ValueError, match="attention"):
        TinyMoE(attention="sliding")


@pytest.mark.parametrize("overrides, named, layers_refused", [
    (dict(softmax_type="learnable"), "attention sinks", [1, 2]),
    (dict(softmax_type="off-by-one"), "attention sinks", [1, 2]),
    # GPT-OSS's alternation: every other layer full (window_attn_skip_freq=2 skips layer 2).
    (dict(window_size=(8, 0), window_attn_skip_freq=2), "sliding window", [1]),
])
def test_sinks_and_windows_are_refused_at_build_not_dropped(overrides, named, layers_refused,
                                                            megatron_cpu):
    """The flash kernel has no softmax offset and attends to the whole causal prefix: a layer
    with sinks or a window is refused when built, naming the setting, so no CPU run (test,
    demo, rehearsal under CP) computes another model's attention."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.cpu.flash_attention import FlashCoreAttention
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    with megatron_layout():
        config = transformer_config(TinyMoE(), **overrides)
        for layer in (1, 2):
            build = lambda: FlashCoreAttention(config, layer, AttnMaskType.causal, "self")  # noqa: E731
            if layer in layers_refused:
                with pytest.raises(ValueError, match=named):
                    build()
            else:
                assert build().layer_number == layer
