"""megatron_flat.megatron.optimizer in one process: the wiring (patch, scope, undo), the
settings it refuses, and MegatronOffloadStreamAdamW's Megatron conventions (groups as
given, host-resident init_state, step un-aliasing and transformer-engine-style steps).
Multi-rank training, skipping and checkpoints: test_megatron_offload_world2.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_flat.config import FlatConfig
from megatron_flat.megatron import optimizer as mopt
from megatron_flat.megatron.optimizer import MegatronOffloadStreamAdamW
from megatron_flat.runtime import patching

FLAT = FlatConfig(optimizer_offload=True, optimizer_bucket_numel=4096, optimizer_num_slots=2)


@pytest.fixture
def unwired():
    mopt.unwire_optimizer_offload()
    yield
    mopt.unwire_optimizer_offload()


def _builder():
    import megatron.core.optimizer as m

    return m._get_megatron_optimizer_based_on_param_groups


def _inner_types(flat=None):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE
    from megatron_flat.testing.training import Layout, Trainer

    tiny = TinyMoE(num_layers=1)
    with megatron_layout():
        trainer = Trainer(tiny, Layout(), flat=flat)
        return [type(o).__name__ for o in mopt.inner_optimizers(trainer.optimizer)]


def test_wiring_patches_megatron_and_is_undone(megatron_cpu, unwired):
    stock = _builder()
    assert _inner_types() == ["AdamW"]
    mopt.wire_optimizer_offload(FLAT, argparse.Namespace(optimizer="adam"))
    assert _builder() is not stock and patching.original(mopt.builder_patch()) is stock
    assert _inner_types() == ["MegatronOffloadStreamAdamW"]  # plain get_megatron_optimizer
    patched = _builder()
    mopt.wire_optimizer_offload(FLAT)  # again: still one patch
    assert _builder() is patched and patching.original(mopt.builder_patch()) is stock
    mopt.unwire_optimizer_offload()
    assert _builder() is stock
    assert _inner_types() == ["AdamW"]


def test_scoped_offload_nests_and_restores(megatron_cpu, unwired):
    stock = _builder()
    with mopt.optimizer_offload(FLAT):
        assert _inner_types() == ["MegatronOffloadStreamAdamW"]
        with mopt.optimizer_offload(FlatConfig()):  # offload off inside: stock
            assert _inner_types() == ["AdamW"]
        assert _inner_types() == ["MegatronOffloadStreamAdamW"]
    assert _builder() is stock
    # The Trainer's own hook, with offload off: Megatron's optimizer.
    assert _inner_types(flat=FlatConfig()) == ["AdamW"]
    assert _builder() is stock


def test_wiring_refuses_settings_it_cannot_run(megatron_cpu, unwired):
    from megatron_flat.megatron.state import FlatConfigError

    stock = _builder()
    args = argparse.Namespace(optimizer="sgd", optimizer_cpu_offload=True,
                              decoupled_weight_decay=False, use_precision_aware_optimizer=True)
    with pytest.raises(FlatConfigError) as err:
        mopt.wire_optimizer_offload(FLAT, args)
    text = str(err.value)
    for what in ("optimizer 'adam'", "optimizer_cpu_offload", "decoupled_weight_decay",
                 "use_precision_aware_optimizer"):
        assert what in text
    assert _builder() is stock  # nothing patched
    assert mopt.unsupported_optimizer_settings(argparse.Namespace(optimizer_cuda_graph=True))
    assert mopt.unsupported_optimizer_settings(argparse.Namespace(optimizer="adam")) == []


def test_programmatic_builder_refuses_sgd(megatron_cpu):
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(ValueError, match="optimizer 'adam'"):
        mopt.get_megatron_offload_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-3), [], FLAT)


# --------------------------------------------------------------- MegatronOffloadStreamAdamW
def _views():
    """Non-leaf fp32 views of one flat buffer, like the distributed optimizer's shards."""
    buffer = torch.randn(300, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return buffer, [buffer.view(-1)[:100], buffer.view(-1)[100:300]]


def _twins(seed=1):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(10, 7), (33,), (5, 5)]
    mine = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in mine]
    return mine, ref


def _grads(params, refs, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    for p, r in zip(params, refs):
        p.grad = torch.randn(p.shape, generator=gen)
        r.grad = p.grad.clone()


def test_groups_as_given_take_non_leaf_views():
    _, views = _views()
    with pytest.raises(ValueError, match="non-leaf"):
        torch.optim.AdamW([{"params": views}])
    groups = [{"params": [views[0]], "wd_mult": 1.0, "lr": 1e-2},
              {"params": [views[1]], "wd_mult": 0.0, "weight_decay": 0.0}]
    opt = MegatronOffloadStreamAdamW.over_param_groups(groups, lr=1e-3, bucket_numel=64,
                                                       device="cpu")
    assert [g["params"][0] for g in opt.param_groups] == views  # the very tensors
    assert [g["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]  # Megatron's keys kept
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[1]["lr"] == 1e-3
    assert not opt.state
    with pytest.raises(ValueError, match="more than once"):
        MegatronOffloadStreamAdamW.over_param_groups([{"params": [views[0], views[0]]}])


def test_init_state_is_host_resident_and_changes_nothing():
    mine, ref = _twins()
    opt = MegatronOffloadStreamAdamW(mine, lr=1e-2, bucket_numel=64, device="cpu")
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    opt.init_state()
    opt.init_state()  # idempotent
    host = opt._host
    for p in mine:
        st = opt.state[p]
        assert float(st["step"]) == 0.0
        for key in ("exp_avg", "exp_avg_sq"):
            buf = getattr(host, key)
            assert st[key].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert not st[key].any()
    for step in range(3):
        _grads(mine, ref, step)
        opt.step()
        torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))


def test_steps_are_never_aliased_on_load():
    """Megatron's distributed optimizer loads one shared step tensor into every entry;
    torch's AdamW would then count a step once per parameter."""
    mine, ref = _twins()
    opt = MegatronOffloadStreamAdamW(mine, lr=1e-2, bucket_numel=64, device="cpu")
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    shared = torch.tensor(5.0)
    state = {i: {"step": shared, "exp_avg": torch.zeros(p.shape),
                 "exp_avg_sq": torch.zeros(p.shape)} for i, p in enumerate(mine)}
    opt.load_state_dict({"state": state, "param_groups": [
        {**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": [0, 1, 2]}]})
    ref_state = {i: {**s, "step": torch.tensor(5.0)} for i, s in state.items()}
    torch_opt.load_state_dict({"state": ref_state, "param_groups": [
        {**{k: v for k, v in torch_opt.param_groups[0].items() if k != "params"},
         "params": [0, 1, 2]}]})
    _grads(mine, ref, 0)
    opt.step()
    torch_opt.step()
    assert [float(opt.state[p]["step"]) for p in mine] == [6.0, 6.0, 6.0]
    assert float(shared) == 5.0  # the caller's tensor is untouched
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))


def test_transformer_engine_style_steps_round_trip():
    """The state dict carries each group's step (FusedAdam's place for it, which the
    distributed optimizer reads when TE or apex is installed); entries without a step
    take their group's on load."""
    mine, ref = _twins()
    opt = MegatronOffloadStreamAdamW(mine, lr=1e-2, bucket_numel=64, device="cpu")
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    for step in range(2):
        _grads(mine, ref, step)
        opt.step()
        torch_opt.step()
    packed = opt.state_dict()
    assert packed["param_groups"][0]["step"] == 2
    te_style = {"state": {i: {k: v for k, v in st.items() if k != "step"}
                          for i, st in packed["state"].items()},
                "param_groups": packed["param_groups"]}
    other = [p.detach().clone().requires_grad_() for p in mine]
    fresh = MegatronOffloadStreamAdamW(other, lr=1e-2, bucket_numel=100, device="cpu")
    fresh.load_state_dict(te_style)
    assert [float(fresh.state[p]["step"]) for p in other] == [2.0, 2.0, 2.0]
    assert "step" not in fresh.param_groups[0]
    _grads(other, ref, 2)
    fresh.step()
    torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(other, ref))


# ------------------------------------------------- the precision-aware path (fp32 master on host)
def _bf16_shards(seed=3):
    """bf16 non-leaf shards of one model-param buffer with fp32 gradients by attribute, as
    the distributed optimizer's precision-aware path gives them (``decoupled_grad``)."""
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(300, generator=gen).to(torch.bfloat16).requires_grad_()
    shards = [buffer.view(-1)[:120], buffer.view(-1)[120:300]]
    return buffer, shards


def _master_opt(shards, **kwargs):
    return mopt.MegatronMasterOffloadAdamW.over_param_groups(
        [{"params": shards}], lr=1e-2, bucket_numel=64, device="cpu",
        grad_attr="decoupled_grad", **kwargs)


def test_precision_aware_inner_steps_bf16_shards_like_fp32_master_adamw():
    """bf16 shards, fp32 ``decoupled_grad``: the fp32 master lives in host state and the
    shard receives the update rounded to bf16 — bitwise what Megatron's stock path gives
    (AdamW on an fp32 copy, then copied into the bf16 param)."""
    _, shards = _bf16_shards()
    masters = [s.detach().float().clone().requires_grad_() for s in shards]
    opt, ref = _master_opt(shards), torch.optim.AdamW(masters, lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        for s, m in zip(shards, masters):
            s.decoupled_grad = torch.randn(s.shape, generator=gen)
            m.grad = s.decoupled_grad.clone()
        opt.step()
        ref.step()
    for s, m in zip(shards, masters):
        st = opt.state[s]
        assert torch.equal(st["master_param"], m.detach())  # the fp32 master, on host
        assert st["master_param"].untyped_storage().data_ptr() != \
            s.untyped_storage().data_ptr()
        assert torch.equal(s.detach(), m.detach().to(torch.bfloat16))
        assert torch.equal(opt.get_unscaled_state(s, "exp_avg"), ref.state[m]["exp_avg"])


def test_precision_aware_state_accessors():
    """Megatron's checkpoint accessors: state made on first access; ``step`` and
    non-tensor values (0.16's ``padding`` flag) ignored on set; shapes checked; an fp32
    shard is its own master; int16 remainders refused."""
    buffer = torch.randn(40).requires_grad_()
    fp32_shard = buffer.view(-1)[:40]
    _, shards = _bf16_shards()
    opt = mopt.MegatronMasterOffloadAdamW.over_param_groups(
        [{"params": shards + [fp32_shard]}], lr=1e-2, bucket_numel=64, device="cpu",
        grad_attr="decoupled_grad")
    master = opt.get_unscaled_state(shards[0], "master_param")
    assert master.dtype == torch.float32 and torch.equal(master, shards[0].detach().float())
    assert opt.get_unscaled_state(fp32_shard, "master_param") is not None
    assert torch.equal(opt.get_unscaled_state(fp32_shard, "master_param"), fp32_shard.detach())
    new = torch.full((120,), 0.5)
    before = shards[0].detach().clone()
    opt.set_scaled_state(shards[0], "master_param", new)
    assert torch.equal(opt.get_unscaled_state(shards[0], "master_param"), new)
    assert torch.equal(shards[0].detach(), before)  # the bf16 shard is the model's to load
    opt.set_scaled_state(shards[0], "exp_avg_sq", torch.ones(120))
    assert torch.equal(opt.state[shards[0]]["exp_avg_sq"], torch.ones(120))
    opt.set_scaled_state(shards[0], "step", torch.tensor(9.0))
    opt.set_scaled_state(shards[0], "padding", False)
    assert float(opt.state[shards[0]]["step"]) == 0.0
    opt.set_scaled_state(fp32_shard, "master_param", torch.full((40,), 2.0))
    assert torch.equal(fp32_shard.detach(), torch.full((40,), 2.0))
    with pytest.raises(ValueError, match="elements"):
        opt.set_scaled_state(shards[1], "exp_avg", torch.zeros(7))
    with pytest.raises(KeyError):
        opt.set_scaled_state(shards[1], "exp_avg_sq_remainder", torch.zeros(180))
    with pytest.raises(ValueError, match="remainders"):
        opt.initialize_state(shards[1], store_param_remainders=True)
    packed = opt.state_dict()  # fp32 masters in the state dict, Megatron's key
    assert {k for st in packed["state"].values() for k in st} == \
        {"step", "exp_avg", "exp_avg_sq", "master_param"}


def test_where_the_master_lives():
    from megatron.core.optimizer import OptimizerConfig

    def config(**kw):
        return OptimizerConfig(optimizer="adam", lr=1e-3, **kw)

    assert mopt.master_stays_on_device(config(bf16=True, use_distributed_optimizer=True)) is None
    assert "fp32 model" in mopt.master_stays_on_device(config(use_distributed_optimizer=True))
    assert "--use-distributed-optimizer" in mopt.master_stays_on_device(config(bf16=True))
    fp8 = config(bf16=True, use_distributed_optimizer=True, fp8_recipe="delayed")
    assert "fp8" in mopt.master_stays_on_device(fp8)
    given = config(bf16=True, use_distributed_optimizer=True)
    copied = mopt._master_offload_config(given)
    assert getattr(copied, mopt._PRECISION_AWARE) and not copied.store_param_remainders
    assert not copied.use_precision_aware_optimizer  # TE's FusedAdam is not asked for
    assert not getattr(given, mopt._PRECISION_AWARE)  # the caller's config is unchanged


def test_main_params_from_a_checkpoint_are_refused_on_the_precision_aware_path():
    """``--load-main-params-from-ckpt`` would load fp32 main params that this path has
    not got (Megatron would ignore them silently): a clear error instead."""
    calls = []

    class Wrapper:
        def reload_model_params(self, state_dict=None):
            calls.append(state_dict)

    wrapper = Wrapper()
    mopt._no_main_params_from_checkpoint(wrapper)
    wrapper.reload_model_params()
    with pytest.raises(NotImplementedError, match="load-main-params-from-ckpt"):
        wrapper.reload_model_params(state_dict={"model": {}})
    with pytest.raises(NotImplementedError):
        wrapper.reload_model_params({"model": {}})
    assert calls == [None]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_distributed_save_adds_at_most_one_bucket_of_host_bytes(megatron_cpu, bf16):
    """Under the distributed optimizer, a checkpoint save (Megatron's ``state_dict`` and
    ``sharded_state_dict`` in the dp_reshardable format, Megatron-LM's default) reads
    the host state where it is: the save's transient CPU bytes stay within one bucket of host
    state (bucket_numel x 12 B). A compact copy of the state — what the inner state dict made
    before — is 8-12 B per parameter, many buckets here. (On CPU every new tensor is a CPU
    tensor; on a GPU machine these are the host-side bytes of the save.)"""
    import sys

    from megatron_flat.runtime.memory import MemoryMeter
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE
    from megatron_flat.testing.training import Layout

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _megatron_runs import make_trainer, train

    tiny = TinyMoE()
    with megatron_layout(seed=tiny.seed):
        trainer = make_trainer(tiny, Layout(distributed_optimizer=True), offload=True,
                               bf16=bf16)
        train(trainer, [0])
        inners = mopt.inner_optimizers(trainer.optimizer)
        bucket = max(o.bucket_numel for o in inners) * 12
        held = sum(o.host_bytes for o in inners)
        assert held > 4 * bucket  # the state spans several buckets
        model_sd = trainer.model.sharded_state_dict()
        figures = {}
        with MemoryMeter() as meter:
            trainer.optimizer.state_dict()
        figures["state_dict"] = meter.peak_device_bytes
        for fmt in ("dp_reshardable",):
            with MemoryMeter() as meter:
                trainer.optimizer.sharded_state_dict(
                    model_sd, metadata={"distrib_optim_sharding_type": fmt})
            figures[fmt] = meter.peak_device_bytes
        with MemoryMeter() as meter:  # what a compact copy of the state costs
            compact = [o.state_dict() for o in inners]
        copied = meter.peak_device_bytes
        del compact
    assert all(v <= bucket for v in figures.values()), (figures, bucket)
    assert copied >= held * 8 // 12 > bucket, (copied, held)
