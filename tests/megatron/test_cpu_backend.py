"""The CPU backend: patches are listed with reasons, gated, idempotent, and confined."""

import pytest
import torch

from megatron_flat.cpu import backend as cpu


def test_every_patch_documents_why_and_applies_where_needed(megatron_cpu):
    assert cpu.WORKAROUNDS
    for patch in cpu.WORKAROUNDS:
        assert len(patch.reason) > 40, patch.name
    applied = [name for name in cpu.applied_workarounds() if name in {p.name for p in cpu.WORKAROUNDS}]
    expected = [p.name for p in cpu.WORKAROUNDS if p.name in applied or p.needed()]
    assert applied == expected


def test_every_workaround_patches_through_the_one_mechanism(megatron_cpu):
    """Each applied workaround's monkey-patches are ``runtime.patching`` records, in place,
    each saying what it expects and why; no marker attribute is written on what they patch."""
    from megatron_flat.runtime import patching

    in_place = patching.applied()
    for workaround in cpu.WORKAROUNDS:
        if workaround.name not in cpu.applied_workarounds():
            continue
        for patch in workaround.patches():
            assert patch.expects and len(patch.why) > 20, (workaround.name, patch)
            assert patching.is_applied(patch) and patch in in_place, (workaround.name, patch)
            replacement = getattr(patching.resolve(patch.owner), patch.attribute)
            assert not hasattr(replacement, "_megatron_flat"), patch


def test_feature_gating(megatron_cpu):
    """Patches follow what the installed release has, not its version number."""
    from megatron.core.transformer.moe import experts

    grouped = next(p for p in cpu.WORKAROUNDS if p.name == "grouped_gemm reference")
    assert (grouped.name in cpu.applied_workarounds()) == hasattr(experts, "GroupedMLP")
    te_gemm = next(p for p in cpu.WORKAROUNDS if p.name == "te_general_gemm global")
    # Once defined (by the patch or by the release itself), it is no longer needed.
    assert not te_gemm.needed()


def test_idempotent(megatron_cpu):
    before = cpu.applied_workarounds()
    assert cpu.enable_cpu_backend() == before


def test_noop_when_cuda_is_present(monkeypatch, megatron_cpu):
    monkeypatch.setattr(cpu, "cuda_present", lambda: True)
    assert cpu.enable_cpu_backend() == []


def test_confined_to_megatron_modules(megatron_cpu):
    from megatron.core.transformer.moe import token_dispatcher

    # Inside a patched Megatron module torch.cuda answers for the CPU ...
    assert token_dispatcher.torch.cuda.current_device() == torch.device("cpu")
    assert token_dispatcher.torch.zeros(2, device="cuda").device.type == "cpu"
    assert token_dispatcher.torch.Tensor is torch.Tensor
    # ... while torch itself is untouched.
    assert not torch.cuda.is_available()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    assert torch.Tensor.type(torch.zeros(1)) == "torch.FloatTensor"


def test_rng_tracker_forks_the_cpu_generator(megatron_cpu):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout(seed=7):
        tracker = get_cuda_rng_tracker()
        outside = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outside)  # restored on exit
        with tracker.fork():
            b = torch.rand(4)
        assert not torch.equal(a, b)  # the forked stream advanced


def test_tiny_moe_forward_backward_single_rank(megatron_cpu):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, build_tiny_gpt, global_batch, transformer_config

    tiny = TinyMoE()
    with megatron_layout():
        model = build_tiny_gpt(tiny, transformer_config(tiny, recompute="full"))
        mb = global_batch(tiny)[0]
        loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels).mean()
        loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tied_embedding_copy_is_confined_to_its_call(megatron_cpu):
    """The PP > 1 tied-embedding patch makes ``Tensor.cuda`` the identity only while
    ``setup_embeddings_and_output_layer`` runs (exercised by the world-4 TP2 x PP2 tied
    GPT step); elsewhere a CUDA copy still fails loudly on a CPU-only torch."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from megatron_flat.runtime import patching

    tied = next(w for w in cpu.WORKAROUNDS if w.name == "tied embeddings across pipeline stages")
    (patch,) = tied.patches()
    assert patching.is_applied(patch) and patching.resolve(patch.owner) is LanguageModule
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1).cuda()


def test_inference_linears_are_answered_without_transformer_engine(megatron_cpu, monkeypatch):
    """Megatron-LM main's inference linears subclass TE's placeholders without
    transformer-engine (mock objects, not classes): the workaround is needed exactly then,
    and its patch answers False where Megatron's own function raises."""
    import sys
    import types
    from unittest import mock

    from megatron_flat.runtime import patching

    name = "megatron.core.tensor_parallel.inference_layers"
    fake = types.ModuleType(name)

    def is_inference_column_parallel_linear(module):
        return isinstance(module, (fake.InferenceColumnParallelLinear,
                                   fake.InferenceLayerNormColumnParallelLinear))

    fake.is_inference_column_parallel_linear = is_inference_column_parallel_linear
    fake.InferenceColumnParallelLinear = type("InferenceColumnParallelLinear", (), {})
    fake.InferenceLayerNormColumnParallelLinear = type("InferenceLayerNorm", (), {})
    monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr("megatron.core.tensor_parallel.inference_layers", fake, raising=False)
    workaround = next(w for w in cpu.WORKAROUNDS
                      if w.name == "inference linears without transformer-engine")
    assert not workaround.needed()  # real classes: Megatron's own answer stands
    fake.InferenceColumnParallelLinear = mock.MagicMock(spec=str)  # TE absent in main
    assert workaround.needed()
    with pytest.raises(TypeError):
        is_inference_column_parallel_linear(torch.nn.Linear(2, 2))
    patches = workaround.patches()
    for patch in patches:
        patching.apply(patch)
    try:
        assert fake.is_inference_column_parallel_linear(torch.nn.Linear(2, 2)) is False
    finally:
        for patch in reversed(patches):
            patching.revert(patch)
    assert fake.is_inference_column_parallel_linear is is_inference_column_parallel_linear
