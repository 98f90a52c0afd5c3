"""install(): validation against Megatron settings, idempotence, nothing changes when off."""

import argparse

import pytest

import megatron_flat
from megatron_flat.config import FlatConfig
from megatron_flat.megatron import install as inst
from megatron_flat.testing.launch_args import megatron_args


@pytest.fixture(autouse=True)
def fresh():
    inst._reset_for_tests()
    yield
    inst._reset_for_tests()


def test_all_off_changes_nothing_and_is_idempotent():
    cfg = megatron_flat.install(megatron_args())
    assert cfg == FlatConfig() and inst.installed() == cfg
    assert megatron_flat.install(FlatConfig()) is cfg  # same config again: a no-op
    with pytest.raises(inst.FlatConfigError, match="already installed"):
        megatron_flat.install(FlatConfig(llep_alpha=2.0))


def test_every_problem_is_reported_at_once():
    args = megatron_args("--flat-sco", "--flat-optimizer-offload", "--flat-dispatch", "llep",
                         num_experts=None, recompute_granularity=None, optimizer="sgd")
    with pytest.raises(inst.FlatConfigError) as err:
        megatron_flat.install(args)
    text = str(err.value)
    assert "--num-experts is not set" in text
    assert "--recompute-granularity full" in text
    assert "--optimizer adam" in text
    assert inst.installed() is None  # nothing was installed


@pytest.mark.parametrize("settings, ok", [
    (dict(recompute_granularity="full"), True),
    (dict(recompute_granularity="selective"), True),  # Megatron's default module: core_attn
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]), True),
    (dict(recompute_granularity="selective", recompute_modules=["mlp"]), True),
    (dict(recompute_granularity=None, moe_layer_recompute=True), True),  # 0.16's old flag
    (dict(recompute_granularity="selective", recompute_modules=["moe_act", "layernorm"]), False),
    (dict(recompute_granularity="selective", recompute_modules=[]), False),
    (dict(recompute_granularity=None), False),
])
def test_sco_needs_a_recompute_with_boundaries(settings, ok):
    problems = inst.check_against_megatron(FlatConfig(sco=True), argparse.Namespace(**settings))
    if ok:
        assert problems == []
    else:
        assert len(problems) == 1 and "core_attn moe mlp" in problems[0], problems


def test_experts_must_split_over_ep():
    problems = inst.check_against_megatron(FlatConfig(dispatch="pipelined"),
                                           argparse.Namespace(num_experts=6,
                                                              expert_model_parallel_size=4))
    assert problems == ["--num-experts 6 does not split over --expert-model-parallel-size 4"]


def test_transformer_config_names_are_understood():
    cfg = argparse.Namespace(num_moe_experts=8, expert_model_parallel_size=2,
                             recompute_granularity="full")
    assert inst.check_against_megatron(FlatConfig(dispatch="llep", sco=True), cfg) == []


def test_technique_without_integration_is_refused_plainly(monkeypatch):
    monkeypatch.setattr(inst, "WIRING", {})
    with pytest.raises(inst.FlatConfigError, match="--flat-vocab: not available"):
        megatron_flat.install(FlatConfig(vocab=True))


def test_enabled_technique_is_wired_once(monkeypatch):
    calls = []
    monkeypatch.setattr(inst, "WIRING", {"vocab": lambda flat, meg: calls.append(flat)})
    megatron_flat.install(FlatConfig(vocab=True))
    megatron_flat.install(FlatConfig(vocab=True))
    assert len(calls) == 1


def test_sco_is_wired_by_install(megatron_cpu):
    from megatron_flat.megatron import sco

    flat = FlatConfig(sco=True, sco_host_budget_gib=0.5, sco_prefetch=1)
    try:
        megatron_flat.install(flat, argparse.Namespace(recompute_granularity="full"))
        active = sco.enabled()
        assert active is not None and active.prefetch == 1
    finally:
        sco.disable()
    assert sco.enabled() is None


def test_vocab_and_optimizer_offload_are_wired_by_install(megatron_cpu):
    from megatron_flat.megatron import optimizer, vocab

    args = megatron_args("--flat-vocab", "--flat-optimizer-offload")
    megatron_flat.install(args)
    assert inst.installed().vocab and optimizer._active_flat() == inst.installed()
    assert vocab._installed_vocab() == inst.installed()
    inst._reset_for_tests()
    assert optimizer._active_flat() is None and vocab._installed_vocab() is None


def test_vocab_takes_multi_token_prediction_and_refuses_deferred_embedding_wgrad(
        megatron_cpu):
    with pytest.raises(inst.FlatConfigError, match="defer-embedding-wgrad-compute"):
        megatron_flat.install(megatron_args("--flat-vocab", mtp_num_layers=1,
                                            defer_embedding_wgrad_compute=True))
    assert inst.installed() is None
    cfg = megatron_flat.install(megatron_args("--flat-vocab", mtp_num_layers=2))
    assert cfg.vocab and inst.installed() == cfg


def test_install_touches_no_device_and_pins_nothing(megatron_cpu, monkeypatch):
    """0.19-era scripts call install() before each rank sets its device: it must not create
    a CUDA context (torch.cuda._lazy_init) nor pin host memory (cudaHostRegister)."""
    import torch

    from megatron_flat.megatron import sco
    from megatron_flat.runtime import host_tier

    touched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: touched.append("_lazy_init"))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: touched.append("cudart"))
    args = megatron_args("--flat-preset", "paper", "--flat-sco-host-budget-gib", "0.25",
                         recompute_granularity="full")
    megatron_flat.install(args)
    assert touched == []
    assert host_tier.tier().allocated_bytes == {} and host_tier.tier().pinned_bytes == 0
    assert not sco.enabled().pool.allocated  # SCO's pool comes at its first offload


def test_host_budgets_that_cannot_fit_the_node_are_refused_at_install(megatron_cpu,
                                                                      monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = megatron_args("--flat-sco", "--flat-sco-host-budget-gib", "64",
                         "--flat-host-mem-per-node-gib", "256", recompute_granularity="full")
    with pytest.raises(inst.FlatConfigError) as err:
        megatron_flat.install(args)
    assert "8 rank(s) per node x 64.00 GiB per rank" in str(err.value)
    assert "> 256.00 GiB (--flat-host-mem-per-node-gib)" in str(err.value)
    assert inst.installed() is None


@pytest.mark.parametrize("settings, found", [
    (dict(tensor_model_parallel_size=2, sequence_parallel=True,
          spec=["megatron_flat.megatron.spec", "flat_gpt_layer_spec"]), []),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), []),  # a TransformerConfig
    (dict(tensor_model_parallel_size=1, sequence_parallel=False,
          spec=["megatron_flat.megatron.spec", "flat_gpt_layer_te_spec"]), ["--sequence-parallel"]),
    (dict(tensor_model_parallel_size=2, sequence_parallel=False), ["--sequence-parallel"]),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, spec=None),
     ["flat layer specs"]),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, multi_latent_attention=True),
     []),  # MLASelfAttention's projections are tiled
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, multi_latent_attention=True,
          mla_down_proj_fusion=True), ["--mla-down-proj-fusion"]),
])
def test_attention_tiles_need_sequence_parallelism_and_the_flat_spec(settings, found):
    problems = inst.check_against_megatron(FlatConfig(attn_tiles=4096),
                                           argparse.Namespace(**settings))
    assert len(problems) == len(found)
    for problem, word in zip(problems, found):
        assert word in problem, problems


def test_attention_tiles_are_installed_and_reach_the_flat_layer_spec(megatron_cpu):
    from megatron_flat.megatron import spec
    from megatron_flat.megatron.attention_tiles import TiledColumnParallelLinear

    args = megatron_args("--flat-attn-tiles", "512", tensor_model_parallel_size=2,
                         sequence_parallel=True,
                         spec=["megatron_flat.megatron.spec", "flat_gpt_layer_spec"])
    assert megatron_flat.install(args).attn_tiles == 512
    attention = spec.flat_gpt_layer_spec.resolve().submodules.self_attention.submodules
    assert attention.linear_qkv.module is TiledColumnParallelLinear
    assert attention.linear_qkv.params["tile_tokens"] == 512


REPLAY = ("--flat-attn-replay", "--flat-sco", "--flat-sco-host-budget-gib", "1")


def test_attention_replay_needs_full_recompute():
    for granularity in ("selective", None):
        problems = inst.check_against_megatron(
            FlatConfig(attn_replay=True), argparse.Namespace(recompute_granularity=granularity))
        assert len(problems) == 1 and "--recompute-granularity full" in problems[0]
    assert inst.check_against_megatron(
        FlatConfig(attn_replay=True), argparse.Namespace(recompute_granularity="full")) == []


def test_attention_replay_is_wired_and_local_attention_says_it_cannot(megatron_cpu):
    import warnings

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_flat.megatron import checkpoint_phase, replay_wiring
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, build_tiny_gpt
    from megatron_flat.testing.training import transformer_config

    init = DotProductAttention.__init__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # wired: no fallback warning
        megatron_flat.install(megatron_args(*REPLAY, recompute_granularity="full",
                                            transformer_impl="local"))
    assert replay_wiring.wired() and checkpoint_phase.enabled()
    tiny = TinyMoE()  # Megatron's local DotProductAttention, in both layers
    with megatron_layout(seed=tiny.seed), \
            pytest.warns(UserWarning, match="DotProductAttention keeps no log-sum-exp") as caught:
        build_tiny_gpt(tiny, transformer_config(tiny, recompute="full"))
    assert tiny.num_layers > 1 and len([w for w in caught if "log-sum-exp" in str(w.message)]) == 1
    inst._reset_for_tests()
    assert not replay_wiring.wired() and DotProductAttention.__init__ is init


@pytest.mark.parametrize("flags, settings, reason", [
    (("--flat-attn-replay",), {}, "no host budget"),
    (REPLAY, dict(transformer_impl="transformer_engine"), "transformer-engine"),
    (REPLAY, dict(fp8="hybrid", fp8_dot_product_attention=True), "fp8 attention"),
    (REPLAY, dict(attention_dropout=0.1), "attention dropout"),
])
def test_attention_replay_falls_back_with_one_warning(megatron_cpu, flags, settings, reason):
    from megatron_flat.megatron import replay_wiring

    args = megatron_args(*flags, **{"recompute_granularity": "full", "transformer_impl": "local",
                                    "attention_dropout": 0.0, **settings})
    with pytest.warns(UserWarning, match="attn-replay is off") as caught:
        cfg = megatron_flat.install(args)
    assert len(caught) == 1 and reason in str(caught[0].message)
    assert cfg.attn_replay and not replay_wiring.wired()


PARAM_OFFLOAD = dict(dispatch="pipelined", optimizer_offload=True, param_offload=True)


def test_param_offload_needs_the_flat_dispatch_and_the_optimizer_offload():
    for missing in ({"dispatch": "off"}, {"optimizer_offload": False}):
        with pytest.raises(ValueError, match="--flat-param-offload. needs --flat-dispatch"):
            FlatConfig(**{**PARAM_OFFLOAD, **missing})


@pytest.mark.parametrize("settings, found", [
    (dict(expert_model_parallel_size=2), []),
    (dict(expert_model_parallel_size=1), ["--expert-model-parallel-size > 1"]),
    (dict(expert_model_parallel_size=2, fp16=True, data_parallel_random_init=True,
          use_torch_fsdp2=True, num_distributed_optimizer_instances=2),
     ["--fp16", "--data-parallel-random-init", "--use-torch-fsdp2",
      "--num-distributed-optimizer-instances"]),
])
def test_param_offload_refuses_what_it_cannot_honour(settings, found):
    problems = inst.check_against_megatron(FlatConfig(**PARAM_OFFLOAD),
                                           argparse.Namespace(num_experts=4, **settings))
    assert len(problems) == len(found)
    for problem, flag in zip(problems, found):
        assert problem.startswith("--flat-param-offload: ") and flag in problem


def test_param_offload_is_wired_by_install(megatron_cpu):
    from megatron_flat.megatron import param_offload, param_offload_optimizer
    from megatron_flat.runtime import patching

    megatron_flat.install(FlatConfig(**PARAM_OFFLOAD))
    assert patching.is_applied(param_offload.DDP_PATCH) and param_offload_optimizer.is_wired()
    assert patching.is_applied(param_offload_optimizer.ZEROS_PATCH)
    with param_offload.offloading(inst.installed()):  # a trainer's scope keeps install's
        pass
    assert patching.is_applied(param_offload.DDP_PATCH) and param_offload_optimizer.is_wired()
    inst._reset_for_tests()
    assert not patching.is_applied(param_offload.DDP_PATCH)
    assert not param_offload_optimizer.is_wired()
    assert not patching.is_applied(param_offload_optimizer.NORM_PATCH)
    assert not patching.is_applied(param_offload_optimizer.ZEROS_PATCH)
