"""Every expert module kind the CPU backend builds gives a sharded state dict that Megatron's
own sharding validation accepts — the check ``dist_checkpointing.save`` runs before it writes
a byte (``save_preprocess``: factories applied, then every tensor's main replicas must cover
it exactly once over the world).

Kinds: ``SequentialMLP`` (local linears), 0.16's ``GroupedMLP`` (the CPU reference grouped
GEMM) and ``TEGroupedMLP`` over the CPU grouped linears (``cpu/grouped.py``, a
transformer-engine line's experts), each with and without a gated linear unit (SwiGLU: fc1's
``[W; V]`` split by ``TEGroupedMLP``'s factory) and biases where the kind takes them. Layouts:
EP = world (the expert-DP group is one rank while the dense DP group is the world: the case
where the dense DP rank marks EP rank 1's experts as replicas), EP × expert DP, and expert
tensor parallelism with EP (dense TP 2). Each model takes one training step (the stand-ins
run at every layout), then its own sharded state dict and its optimizer's are validated:
the distributed optimizer's in ``dp_reshardable`` form (Megatron-LM's default, and the
synthetic checkout's), and the plain optimizer's, whose moments take their parameters'
sharding and replica ids. (The distributed optimizer's ``fully_reshardable`` form gathers
over CUDA, and its ``fully_sharded_model_space`` form refuses this model's output layer on
CPU, before any expert.)

Validation says a sharding is consistent, not that it is transformer-engine's; Megatron
makes ``TEGroupedMLP``'s interchangeable with ``SequentialMLP``'s, so the CPU grouped
linears' is also compared with ``SequentialMLP``'s, shard by shard, at every layout."""

import pytest
import torch
import torch.distributed as dist

from tests._worlds import per_world
from tests.megatron._expert_models import KINDS, build_model

# name -> (tp, ep, etp); dense DP and expert DP are what remains of the world.
LAYOUTS = {
    2: {"ep2": (1, 2, 1), "tp2-etp2": (2, 1, 2), "tp2-ep2-etp1": (2, 2, 1)},
    4: {"ep4": (1, 4, 1), "ep2-edp2": (1, 2, 1), "tp2-ep2-etp2": (2, 2, 2)},
}
CASES = per_world(LAYOUTS)
# (gated linear unit, biases) of each kind: GroupedMLP refuses biases, and Megatron takes
# expert biases only at expert-TP 1.
VARIANTS = {"sequential": [(True, False), (False, True)],
            "grouped-mlp": [(True, False), (False, False)],
            "te-grouped": [(True, False), (False, True), (True, True)]}
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}


def _one_step(tiny, model, config, distributed: bool):
    """Megatron's DDP and optimizer (``distributed`` or not) over ``model``, one step (the
    optimizer's state exists, as at a save); returns the optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_flat.testing.tiny_gpt import dp_share, global_batch
    from megatron_flat.testing.training import forward_step

    ddp = DistributedDataParallel(
        config=config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 use_distributed_optimizer=distributed))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32,
                        use_distributed_optimizer=distributed), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    mine = dp_share(global_batch(tiny, 1), parallel_state.get_data_parallel_rank(),
                    parallel_state.get_data_parallel_world_size())
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mine), model=[ddp],
        num_microbatches=len(mine), seq_length=tiny.seq_length,
        micro_batch_size=tiny.micro_batch_size, forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok
    return optimizer


def sharding_errors(sharded_state_dict) -> list:
    """Megatron's validation of ``sharded_state_dict`` as ``dist_checkpointing.save`` runs it,
    on every rank; its errors (rank 0 judges) as every rank's list (empty: valid)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    error = None
    try:
        save_preprocess(sharded_state_dict, validate_access_integrity=True)
    except CheckpointingException as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return [e for e in errors if e]


@pytest.mark.parametrize("world,name", CASES)
def test_expert_sharded_state_dicts_pass_megatrons_validation(megatron_cpu, world, name):
    """Each kind and variant: the model's sharded state dict, and with it the distributed
    optimizer's; the plain optimizer's for each kind's first variant."""
    from megatron_flat.megatron import compat
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    layout = LAYOUTS[world][name]
    tp, ep, etp = layout
    tiny = TinyMoE(num_experts=8, global_batch_size=8)
    kinds = [k for k in KINDS if k != "grouped-mlp" or compat.grouped_mlp_class() is not None]
    problems = []
    with megatron_layout(tp=tp, ep=ep, etp=etp):
        for kind in kinds:
            variants = [(g, b) for g, b in VARIANTS[kind] if etp == 1 or not b]
            runs = [(v, True) for v in variants] + [(variants[0], False)]
            for (glu, bias), distributed in runs:
                what = (f"{kind} {'glu' if glu else 'gelu'}{' bias' if bias else ''} "
                        f"{'distributed' if distributed else 'plain'} optimizer")
                model, config = build_model(tiny, kind, layout, glu, bias)
                assert type(model.decoder.layers[0].mlp.experts).__name__ == KINDS[kind]
                optimizer = _one_step(tiny, model, config, distributed)
                if distributed:
                    problems += [f"{what}, model: {e}"
                                 for e in sharding_errors(model.sharded_state_dict())]
                model_sd = model.sharded_state_dict()
                state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
                    model_sd, metadata=DP_RESHARDABLE)}
                problems += [f"{what}, model and optimizer: {e}"
                             for e in sharding_errors(state)]
    assert problems == []


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.world(2))])
def test_the_validation_sees_a_wrong_replica_id(megatron_cpu, world):
    """Negative control: one expert weight whose replica id is moved off the expert-DP rank
    (every copy of it a replica) fails the same validation."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE(num_experts=8)
    with megatron_layout(ep=2):
        model, _ = build_model(tiny, "te-grouped", (1, 2, 1), True, False)
        sd = model.sharded_state_dict()
        assert sharding_errors(model.sharded_state_dict()) == []
        for sh in nested_values(sd):
            if sh.key.endswith("experts.linear_fc2.weight"):
                sh.replica_id = (*sh.replica_id[:2], 1)
        errors = sharding_errors(sd)
    assert len(errors) == 1 and "Invalid access pattern" in errors[0] \
        and "linear_fc2.weight" in errors[0], errors


def _expert_shards(model) -> list:
    """Every expert tensor's and extra-state object's sharding on this rank, factories
    applied (the SwiGLU halves): ``(type, key, global shape, global offset, fragmentation,
    replica id)``, sorted."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    return sorted((type(sh).__name__, sh.key, sh.global_shape, sh.global_offset,
                   getattr(sh, "axis_fragmentations", None), sh.replica_id)
                  for sh in nested_values(sd) if ".experts." in sh.key)


@pytest.mark.parametrize("world,name", CASES)
def test_te_grouped_shards_as_sequential_mlp(megatron_cpu, world, name):
    """Megatron makes ``TEGroupedMLP``'s sharded state dict interchangeable with
    ``SequentialMLP``'s: over the CPU grouped linears every expert tensor (and extra-state
    object) has SequentialMLP's key, place in the global tensor and replica id, on every
    rank."""
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    layout = LAYOUTS[world][name]
    tiny = TinyMoE(num_experts=8)
    variants = [(True, False)] + ([(False, True)] if layout[2] == 1 else [])
    with megatron_layout(tp=layout[0], ep=layout[1], etp=layout[2]):
        for glu, bias in variants:
            want = _expert_shards(build_model(tiny, "sequential", layout, glu, bias)[0])
            got = _expert_shards(build_model(tiny, "te-grouped", layout, glu, bias)[0])
            assert want and got == want, (glu, bias)
