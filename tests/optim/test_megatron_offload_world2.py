"""OffloadStreamAdamW inside Megatron's optimizers at DP=2 (megatron_flat.megatron.optimizer).

Against Megatron's stock inner optimizer (``torch.optim.AdamW`` here: no transformer-engine
or apex), from the same initial weights, with a per-step lr and weight-decay schedule
written into the param groups as Megatron's scheduler does:

* the distributed optimizer (each rank streams only its shard) and the non-distributed
  Float16/FP32 wrappers, fp32, bf16 and fp16 models (fp16 with Megatron's dynamic loss
  scaling), and dense + expert sub-optimizers at EP=2: losses, model params, main params
  and moments are bitwise equal;
* an inf gradient on one rank skips the step on both, leaving every byte unchanged (fp16:
  found by Megatron's grad scaler, whose loss scale backs off as stock's does);
* Megatron checkpointing — ``torch_dist`` distributed checkpoints (``sharded_state_dict``,
  the distributed optimizer's default ``dp_reshardable`` format) and the legacy format
  (``state_dict`` plus, for the distributed optimizer, ``save/load_parameter_state``):
  save → load into a fresh model and optimizer → continue is bitwise equal to training
  without interruption;
* loading model weights without optimizer state, then ``reload_model_params()``: training
  continues from the loaded weights (no revert), bitwise as stock Megatron does.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.optim import _megatron_runs as runs
FLAT, LAYOUTS = runs.FLAT, runs.LAYOUTS
dist_checkpointing_on_cpu, equal_tensors, everywhere = (
    runs.dist_checkpointing_on_cpu, runs.equal_tensors, runs.everywhere)
inner_optimizers, make_trainer = runs.inner_optimizers, runs.make_trainer
loss_scale, model_bytes = runs.loss_scale, runs.model_bytes
remove_shared, same_bytes, schedule = runs.remove_shared, runs.same_bytes, runs.schedule
shared_tmpdir, state_bytes, train = runs.shared_tmpdir, runs.state_bytes, runs.train

pytestmark = pytest.mark.world(2)

STEPS = 4
CASES = {  # name -> (layout, model dtype)
    "distopt-fp32": ("distopt", "fp32"),
    "distopt-bf16": ("distopt", "bf16"),
    "distopt-fp16": ("distopt", "fp16"),
    "no-distopt-fp32": ("no-distopt", "fp32"),
    "no-distopt-bf16": ("no-distopt", "bf16"),
    "no-distopt-fp16": ("no-distopt", "fp16"),
}
# make_trainer's arguments per model dtype (fp16: with Megatron's dynamic loss scaling).
PRECISION = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}


@pytest.fixture(scope="module")
def tiny():
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE()


@pytest.fixture(scope="module")
def initial(megatron_cpu, tiny):
    """The full initial weights every run starts from."""
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.equivalence import full_tensors
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, transformer_config

    with megatron_layout(seed=tiny.seed):
        return full_tensors([build_tiny_gpt(tiny, transformer_config(tiny))])


@pytest.fixture(scope="module")
def uninterrupted():
    """Offloaded runs of STEPS steps, filled by the equivalence test: case -> full params
    and this rank's optimizer bytes (reused by the checkpoint test)."""
    return {}


def _layout(name):
    from megatron_flat.testing.distributed import megatron_layout

    layout = LAYOUTS[name]
    return layout, megatron_layout(layout.tp, layout.ep, layout.pp)


@pytest.mark.parametrize("case", list(CASES))
def test_trains_bitwise_like_stock(case, tiny, initial, uninterrupted):
    from megatron_flat.megatron.optimizer import (
        MegatronMasterOffloadAdamW,
        MegatronOffloadStreamAdamW,
    )
    from megatron_flat.testing.equivalence import full_tensors

    name, dtype = CASES[case]
    layout, parallel = _layout(name)
    runs = {}
    with parallel:
        for offload in (False, True):
            trainer = make_trainer(tiny, layout, offload=offload, **PRECISION[dtype], init=initial)
            losses = train(trainer, range(STEPS))
            runs[offload] = (losses, full_tensors([trainer.ddp]), state_bytes(trainer))
            if offload:
                inners = inner_optimizers(trainer)
                # bf16/fp16 with the distributed optimizer: the fp32 master is in host
                # memory too (precision-aware path: the inner optimizer holds the
                # low-precision shards).
                low = dtype != "fp32"
                kind = MegatronMasterOffloadAdamW if low and layout.distributed_optimizer \
                    else MegatronOffloadStreamAdamW
                assert inners and all(type(o) is kind for o in inners)
                if kind is MegatronMasterOffloadAdamW:
                    model_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
                    shards = [(o, p) for o in inners for g in o.param_groups
                              for p in g["params"] if p.dtype == model_dtype]
                    assert shards
                    for o, p in shards:  # a separate fp32 master, not the param
                        master = o.state[p]["master_param"]
                        assert master.dtype == torch.float32 and master.device.type == "cpu"
                        assert master.untyped_storage().data_ptr() != \
                            p.untyped_storage().data_ptr()
                assert all(o.bucket_numel == FLAT.optimizer_bucket_numel
                           and o.num_slots == FLAT.optimizer_num_slots for o in inners)
                mine = sum(p.numel() for o in inners for g in o.param_groups for p in g["params"])
                streamed = torch.tensor([mine])
                dist.all_reduce(streamed)
                total = sum(t.numel() for t in initial.values())
                if layout.distributed_optimizer:
                    # Each rank streams only its shard; the shards cover the model once.
                    assert mine < total and streamed.item() == total
                else:
                    assert mine == total and streamed.item() == 2 * total
                uninterrupted[case] = (runs[offload][1], runs[offload][2])
    (stock_losses, stock_params, stock_state), (losses, params, state) = runs[False], runs[True]
    assert losses == stock_losses
    assert losses[-1] != losses[0]
    assert equal_tensors(params, stock_params) == []
    # Main params, step counts and both moments, byte for byte, on every rank.
    assert everywhere(same_bytes(state, stock_state))


def test_expert_and_dense_sub_optimizers_at_ep2(tiny, initial):
    """EP=2: Megatron chains a dense (DP=2) and an expert (expert-DP=1) sub-optimizer."""
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.equivalence import full_tensors
    from megatron_flat.testing.training import Layout

    layout = Layout(ep=2, distributed_optimizer=True)
    runs = {}
    with megatron_layout(ep=2):
        for offload in (False, True):
            trainer = make_trainer(tiny, layout, offload=offload, init=initial)
            losses = train(trainer, range(3))
            runs[offload] = (losses, full_tensors([trainer.ddp]), state_bytes(trainer))
            if offload:
                assert len(trainer.optimizer.chained_optimizers) == 2
                assert len(inner_optimizers(trainer)) == 2
    assert runs[True][0] == runs[False][0]
    assert equal_tensors(runs[True][1], runs[False][1]) == []
    assert everywhere(same_bytes(runs[True][2], runs[False][2]))


def _overflow(trainer):
    """An inf in the reduced gradients, where a real overflow would appear: with the
    distributed optimizer in one element of rank 1's shard only (each rank holds its own
    shard); otherwise in the all-reduced gradient, identical on both replicas."""
    distributed = trainer.layout.distributed_optimizer
    if distributed and dist.get_rank() != 1:
        return
    sub = trainer.optimizer.chained_optimizers[0]
    for param in trainer.model.parameters():
        start = 0
        if distributed:
            try:
                start = sub._get_model_param_range_map(param)["param"].start
            except KeyError:  # not in this rank's shard
                continue
        param.main_grad.view(-1)[start] = float("inf")
        return
    raise AssertionError("no parameter to overflow")


# distopt-bf16/fp16 are the layouts whose fp32 master lives on the host: their check must
# read the shards' decoupled_grad (the grad buffer), not .grad (None there).
@pytest.mark.parametrize("case", list(CASES))
def test_inf_gradient_skips_the_step_everywhere(case, tiny, initial):
    """An inf in the reduced gradients (one rank's shard with the distributed optimizer):
    Megatron reports the step skipped on every rank, and no byte of the model or the
    optimizer state changes; the next finite step trains.

    fp32/bf16 have no grad scaler: the check is the one the offloaded wrappers add. fp16
    has Megatron's DynamicGradScaler, whose own unscale-and-check must find the inf: there
    a stock run does the same steps, and the loss scale backs off as it does there, and
    the next step (under the reduced scale) leaves the same bytes as stock's."""
    from megatron_flat.testing.equivalence import full_tensors

    name, dtype = CASES[case]
    layout, parallel = _layout(name)
    scaled = dtype == "fp16"
    seen = {}
    with parallel:
        for offload in (False, True) if scaled else (True,):
            trainer = make_trainer(tiny, layout, offload=offload, **PRECISION[dtype],
                                   init=initial)
            # With a scaler, Megatron's check (not the added one) is the one that runs.
            assert all((getattr(w, "grad_scaler", None) is not None) == scaled
                       for w in trainer.optimizer.chained_optimizers)
            train(trainer, range(2))
            before_state, before_model = state_bytes(trainer), model_bytes(trainer)
            before_full, before_scale = full_tensors([trainer.ddp]), loss_scale(trainer)
            schedule(trainer, 2)
            trainer.forward_backward(2)
            _overflow(trainer)
            ok, grad_norm, _ = trainer.optimizer.step()
            assert ok is False and grad_norm is None  # Megatron's own skip report
            assert everywhere(same_bytes(state_bytes(trainer), before_state))
            assert everywhere(same_bytes(model_bytes(trainer), before_model))
            assert equal_tensors(full_tensors([trainer.ddp]), before_full) == []
            skipped_scale = loss_scale(trainer)
            # The next finite step trains normally.
            train(trainer, [3])
            assert not everywhere(same_bytes(model_bytes(trainer), before_model))
            seen[offload] = (before_scale, skipped_scale, state_bytes(trainer),
                             full_tensors([trainer.ddp]))
    if scaled:
        (before, after, state, params), stock = seen[True], seen[False]
        assert after < before  # backed off (hysteresis 1), as stock's did:
        assert (before, after) == stock[:2]
        assert everywhere(same_bytes(state, stock[2]))
        assert equal_tensors(params, stock[3]) == []


CHECKPOINTS = [  # (case, format, which inner optimizer saved it, which one loads it)
    ("distopt-fp32", "torch_dist", "offload", "offload"),
    ("distopt-bf16", "torch_dist", "offload", "offload"),
    ("no-distopt-fp32", "torch_dist", "offload", "offload"),
    ("distopt-fp32", "legacy", "offload", "offload"),
    ("no-distopt-bf16", "legacy", "offload", "offload"),
    ("distopt-bf16", "legacy", "offload", "offload"),
    # A checkpoint of the stock optimizer resumes in the offloaded one. (The other way is
    # test_checkpoint_contents_are_stock_megatrons: stock Megatron with torch's AdamW, as on
    # CPU, cannot resume a distributed-optimizer checkpoint at all.)
    ("distopt-bf16", "torch_dist", "stock", "offload"),
    ("distopt-bf16", "legacy", "stock", "offload"),
]


def _save(trainer, fmt, path):
    from megatron.core import dist_checkpointing

    if fmt == "torch_dist":
        model_sd = trainer.model.sharded_state_dict()
        state = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(
            model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        with dist_checkpointing_on_cpu():
            dist_checkpointing.save(state, path)
        return
    # Megatron-LM's legacy format: a torch.save'd state dict per rank, and the distributed
    # optimizer's parameter state gathered to DP rank 0 in a separate file.
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()},
               os.path.join(path, f"rank{dist.get_rank()}.pt"))
    if trainer.layout.distributed_optimizer:
        trainer.optimizer.save_parameter_state(os.path.join(path, "distrib_optim.pt"))


def _load(trainer, fmt, path):
    from megatron.core import dist_checkpointing

    if fmt == "torch_dist":
        model_sd = trainer.model.sharded_state_dict()
        template = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        with dist_checkpointing_on_cpu():
            loaded = dist_checkpointing.load(template, path)
        trainer.model.load_state_dict(loaded["model"])
        with torch.no_grad():  # fp32 main shards are views of the (leaf) model params
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        return
    loaded = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    trainer.model.load_state_dict(loaded["model"])
    with torch.no_grad():
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        if trainer.layout.distributed_optimizer:
            trainer.optimizer.load_parameter_state(os.path.join(path, "distrib_optim.pt"))


@pytest.mark.parametrize("case,fmt,saver,loader", CHECKPOINTS,
                         ids=[f"{c}-{f}-{s}-to-{l}" for c, f, s, l in CHECKPOINTS])
def test_checkpoint_round_trip_continues_bitwise(case, fmt, saver, loader, tiny, initial,
                                                 uninterrupted):
    """save after 2 steps → load into a fresh model and optimizer (other weights) → 2 more
    steps == 4 uninterrupted offloaded steps, params and optimizer state byte for byte. A
    checkpoint saved with Megatron's stock inner optimizer resumes the same way in the
    offloaded one, and the other way round (the offloaded run is bitwise the stock one)."""
    from megatron_flat.testing.equivalence import full_tensors

    name, dtype = CASES[case]
    if case not in uninterrupted:  # normally left by test_trains_bitwise_like_stock
        layout, parallel = _layout(name)
        with parallel:
            trainer = make_trainer(tiny, layout, offload=True, **PRECISION[dtype], init=initial)
            train(trainer, range(STEPS))
            uninterrupted[case] = (full_tensors([trainer.ddp]), state_bytes(trainer))
    want_params, want_state = uninterrupted[case]
    layout, parallel = _layout(name)
    path = shared_tmpdir()
    try:
        with parallel:
            first = make_trainer(tiny, layout, offload=saver == "offload", **PRECISION[dtype],
                                 init=initial)
            train(first, range(2))
            _save(first, fmt, path)
            dist.barrier()
            other = {k: v + 0.25 for k, v in initial.items()}  # loading must replace all
            resumed = make_trainer(tiny, layout, offload=loader == "offload", **PRECISION[dtype],
                                   init=other)
            _load(resumed, fmt, path)
            train(resumed, range(2, STEPS))
            params, state = full_tensors([resumed.ddp]), state_bytes(resumed)
    finally:
        remove_shared(path)
    assert equal_tensors(params, want_params) == []
    assert everywhere(same_bytes(state, want_state))


def _leaves(tree, path=""):
    """(path, value) of every leaf of a nested checkpoint dict; a sharded entry's key and
    data in place of the object."""
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{i}")
    elif hasattr(tree, "key") and hasattr(tree, "data"):  # ShardedTensor / ShardedObject
        yield f"{path}[{tree.key}]", tree.data
    else:
        yield path, tree


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_checkpoint_contents_are_stock_megatrons(fmt, tiny, initial):
    """bf16 + distributed optimizer, the fp32 master in host memory: after the same steps,
    what the offloaded optimizer writes for a checkpoint (torch_dist: its sharded state dict,
    dp_reshardable; legacy: the tensors of its state dict and the gathered parameter state
    file) has the stock optimizer's keys, dtypes and bytes, fp32 masters included."""
    name, dtype = CASES["distopt-bf16"]
    layout, parallel = _layout(name)
    written = {}
    path = shared_tmpdir()
    try:
        with parallel:
            for offload in (False, True):
                trainer = make_trainer(tiny, layout, offload=offload, **PRECISION[dtype],
                                       init=initial)
                train(trainer, range(2))
                if fmt == "torch_dist":
                    model_sd = trainer.model.sharded_state_dict()
                    tree = trainer.optimizer.sharded_state_dict(
                        model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
                else:
                    file = os.path.join(path, f"param_state_{int(offload)}.pt")
                    trainer.optimizer.save_parameter_state(file)
                    dist.barrier()
                    # The state dict's param groups also name each inner optimizer's
                    # implementation (torch AdamW's flags): compare its tensors only.
                    tensors = [(p_, v) for p_, v in _leaves(trainer.optimizer.state_dict())
                               if torch.is_tensor(v)]
                    tree = {"param_state": torch.load(file, weights_only=False)
                            if dist.get_rank() == 0 else None}
                    written[offload] = tensors + list(_leaves(tree))
                    continue
                written[offload] = list(_leaves(tree))
    finally:
        remove_shared(path)
    stock, offloaded = written[False], written[True]
    assert [p for p, _ in offloaded] == [p for p, _ in stock]
    masters = 0
    for (path_, a), (_, b) in zip(stock, offloaded):
        if torch.is_tensor(a):
            assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path_
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), path_
            masters += a.dtype == torch.float32 and "param" in path_
        elif not callable(a):
            assert type(a) is type(b), path_
    # The fp32 masters were compared, not only moments (legacy: gathered on rank 0).
    assert everywhere(masters > 0 or (fmt == "legacy" and dist.get_rank() != 0))


def _shifted(trainer, shift):
    from megatron_flat.testing.equivalence import full_tensors

    return {k: v + shift for k, v in full_tensors([trainer.ddp]).items()}


@pytest.mark.parametrize("case", ["distopt-bf16", "no-distopt-bf16"])
def test_model_only_load_then_reload_model_params(case, tiny, initial):
    """Weights loaded without optimizer state (``--no-load-optim``): after Megatron-LM's
    ``optimizer.reload_model_params()`` training continues from the loaded weights — the
    fp32 masters follow them — with the moments kept, exactly as stock Megatron does.
    (bf16 models: with fp32 ones the main params are the model params or views of them,
    so there is nothing that could go stale.)"""
    from megatron_flat.testing.equivalence import full_tensors, load_full

    name, dtype = CASES[case]
    layout, parallel = _layout(name)
    shift, bound = 0.25, 0.05  # one Adam step moves an element by about lr = 1e-3
    results = {}
    with parallel:
        for offload in (False, True):
            trainer = make_trainer(tiny, layout, offload=offload, **PRECISION[dtype], init=initial)
            train(trainer, range(2))
            loaded = _shifted(trainer, shift)
            load_full([trainer.model], loaded)  # model weights only
            trainer.optimizer.reload_model_params()
            train(trainer, [2])
            after = full_tensors([trainer.ddp])
            assert max((after[k] - loaded[k]).abs().max().item() for k in after) < bound
            train(trainer, [3])
            results[offload] = (full_tensors([trainer.ddp]), state_bytes(trainer))
        if case == "no-distopt-bf16":
            # Control: without reload_model_params the stale fp32 masters win — the check
            # above would catch a silent revert.
            trainer = make_trainer(tiny, layout, offload=True, **PRECISION[dtype], init=initial)
            train(trainer, range(2))
            loaded = _shifted(trainer, shift)
            load_full([trainer.model], loaded)
            train(trainer, [2])
            after = full_tensors([trainer.ddp])
            assert max((after[k] - loaded[k]).abs().max().item() for k in after) > shift / 2
    assert equal_tensors(results[True][0], results[False][0]) == []
    assert everywhere(same_bytes(results[True][1], results[False][1]))
