"""Hooks follow what the installed megatron-core has, not its version number; an untested
release gets one warning, a too-old one a clear refusal."""

import warnings

import pytest

from megatron_flat.megatron import compat


@pytest.fixture
def fake_version(monkeypatch):
    def set_version(v):
        monkeypatch.setattr(compat, "version", lambda: v)
        compat.check_supported.cache_clear()

    yield set_version
    compat.check_supported.cache_clear()


def test_a_newer_release_warns_once_and_runs(fake_version):
    fake_version((0, 21, 0))
    with pytest.warns(compat.UntestedMegatronWarning, match="0.21.0 is newer"):
        compat.check_supported()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_supported()  # once per process


def test_an_older_release_is_refused(fake_version):
    fake_version((0, 15, 3))
    with pytest.raises(RuntimeError, match="needs megatron-core 0.16 or newer; found 0.15.3"):
        compat.check_supported()


@pytest.mark.parametrize("v", [(0, 16, 1), (0, 17, 0), (0, 18, 0), (0, 19, 2), (0, 20, 0)])
def test_tested_releases_are_silent(fake_version, v):
    fake_version(v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_supported()


def test_mechanisms_match_the_installed_release(megatron_cpu):
    """Each detected feature agrees with what the installed release really has."""
    import inspect

    from megatron.core import tensor_parallel
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe import experts

    caller, owner, name = compat.full_recompute_site()
    if hasattr(transformer_block, "checkpointed_forward"):
        assert (owner, name) == (transformer_block, "checkpointed_forward")
    else:
        assert (owner, name) == (transformer_block.TransformerBlock, "_checkpointed_forward")
    assert callable(getattr(owner, name)) and hasattr(caller, "tensor_parallel")
    takes_group = "tp_group" in inspect.signature(
        tensor_parallel.vocab_parallel_cross_entropy).parameters
    assert compat._cross_entropy_takes_group() == takes_group
    spec = compat.te_grouped_mlp_spec(object, object)
    if hasattr(experts, "GroupedMLPSubmodules"):
        assert spec.func is experts.TEGroupedMLP
    else:
        assert spec.module is experts.TEGroupedMLP


def test_moe_recompute_reads_the_installed_forward(megatron_cpu):
    # Known from the releases' sources: 0.16 recomputes MoE whenever asked, 0.17 on only in
    # training (the tests run on 0.16.1 and 0.19.2).
    assert compat._moe_recompute_only_in_training() == (compat.minor() >= (0, 17))
