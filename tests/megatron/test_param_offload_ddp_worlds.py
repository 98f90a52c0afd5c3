"""Param offload under Megatron's DDP and schedule, on the tiny GPT with the flat MoE layer
and full recompute: DDP builds no buffer for the offloaded experts, and after a step's
forward and backward over 2 microbatches (Megatron's schedule, finalize_model_grads) every
rank's loss and every gradient — DDP's main_grad of the dense parameters, the host main_grad
of the experts (scaled and reduced as DDP's buffers are) — are bitwise those of the same run
with the experts in DDP's buffers. EP 2 (experts split, expert-DP 1: scaled by 1/DP) and
EP 1 at world 2 (experts data-parallel: all-reduced over the DP group)."""

import dataclasses

import pytest
import torch

from megatron_flat.config import FlatConfig
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer
from tests._worlds import per_world

CASES = per_world({2: ["ep2", "ep1-dp2"], 4: ["ep2-dp2"]})
FLAT = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8)


def _grads(trainer: Trainer) -> tuple:
    """(loss, {dense name: main_grad}, [expert gradients in offload order])."""
    loss = trainer.forward_backward(0)
    model = trainer.model
    offload = getattr(trainer.ddp, "flat_param_offload", None)
    experts, dense = [], {}
    offloaded = set()
    if offload is not None:
        for index, layer in enumerate(offload.offload.params):
            experts += [g.clone() for g in offload.offload.host_grads(index)]
            offloaded |= {id(p) for p in layer}
    else:
        from megatron_flat.megatron.param_offload import offloadable_layers

        experts = [p.main_grad.clone() for layer in offloadable_layers(model)
                   for p in layer.experts.parameters()]
        offloaded = {id(p) for layer in offloadable_layers(model)
                     for p in layer.experts.parameters()}
    for name, p in model.named_parameters():
        if id(p) not in offloaded:
            dense[name] = p.main_grad.clone()
    return loss, dense, experts


@pytest.mark.parametrize("world, case", CASES)
def test_ddp_step_gradients_are_bitwise_the_buffered_ones(megatron_cpu, world, case):
    from megatron_flat.megatron import param_offload

    ep = {"ep2": 2, "ep1-dp2": 1, "ep2-dp2": 2}[case]
    tiny = TinyMoE(num_experts=4, topk=2, num_layers=3, global_batch_size=2 * world)
    layout = Layout(ep=ep, recompute="full")
    with megatron_layout(ep=ep):  # each run seeded alike by its own layout
        want = _grads(Trainer(tiny, layout, flat=FLAT))
    with megatron_layout(ep=ep):
        param_offload.wire_ddp()  # the DDP half alone (the knob also needs EP > 1)
        try:
            trainer = Trainer(tiny, layout, flat=FLAT)
            got = _grads(trainer)
        finally:
            param_offload.unwire_ddp()
        # no device buffer holds an offloaded expert
        offload = trainer.ddp.flat_param_offload.offload
        buffered = {id(p) for buffer in trainer.ddp.buffers + trainer.ddp.expert_parallel_buffers
                    for p in buffer.params}
        assert not buffered & {id(p) for layer in offload.params for p in layer}
    assert want[0] == got[0]
    assert sorted(want[1]) == sorted(got[1])
    assert [n for n in want[1] if not torch.equal(want[1][n], got[1][n])] == []
    assert len(want[2]) == len(got[2]) > 0
    assert [i for i, (a, b) in enumerate(zip(want[2], got[2])) if not torch.equal(a, b)] == []


STEP_CASES = per_world({2: ["ep2-fp32", "ep2-bf16-distopt", "ep2-cp2-fp32",
                            "ep2-overlap-fp32", "ep2-all-fp32", "ep2-all-bf16-distopt",
                            "ep2-cp2-all-fp32", "ep2-cp2-all-bf16-distopt"],
                        4: ["ep2-dp2-fp32", "ep2-dp2-distopt", "ep2-tp2-fp32",
                            "ep2-pp2-fp32", "ep2-dp2-overlap-distopt",
                            "ep2-dp2-buckets-bf16-distopt", "ep2-dp2-all-fp32",
                            "ep2-dp2-all-bf16-distopt", "ep2-tp2-all-fp32",
                            "ep2-tp2-all-bf16-distopt", "ep2-pp2-all-fp32",
                            "ep2-pp2-all-bf16-distopt"]})
SPLITS = {"cp2": dict(cp=2), "tp2": dict(tp=2, etp=1), "pp2": dict(pp=2)}
FLAT_OPT = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8, optimizer_offload=True,
                      optimizer_bucket_numel=4096)
# "all": the other two techniques on too (Ring-DTP's strips, SCO's boundaries on the host).
FLAT_ALL = dataclasses.replace(FLAT_OPT, vocab=True, vocab_block_size=32, sco=True,
                               sco_host_budget_gib=1 / 64)


def _train(tiny, layout, overrides, flat, steps=2) -> tuple:
    """(trainer, [(loss, Megatron's count of zeros in the gradients)] per step, parameters)."""
    trainer = Trainer(tiny, layout, flat=flat, config_overrides=overrides, count_zeros=True)
    losses = []
    for step in range(steps):
        loss = trainer.forward_backward(step)
        trainer.optimizer_step()
        losses.append((loss, trainer.num_zeros))
    params = {n: p.data.clone() for n, p in trainer.model.named_parameters()}
    return trainer, losses, params


@pytest.mark.parametrize("world, case", STEP_CASES)
def test_training_steps_are_bitwise_the_buffered_ones(megatron_cpu, world, case):
    """Two steps through Megatron's schedule and optimizer (OffloadStreamAdamW inner
    optimizers; the experts' own ParamOffloadOptimizer with param offload): every loss and
    every parameter after the updates bitwise equal, at expert-DP 2 with the distributed
    optimizer too (the experts' norm sums the pieces its shards would hold, on the ranks
    that would hold them: the same partial sums in the same order), also with CP 2, TP 2 +
    SP (expert-TP 1) and PP 2 (1F1B: each stage's layers offloaded by its own DDP), with
    every other technique on ("all": Ring-DTP, SCO, and the attention tiles at TP 2 + SP)
    at each of those layouts in fp32 and bf16, and with DDP's overlapped gradient reduction
    ("overlap"; "buckets": in buckets of 2,000 elements, so that shards cut parameters)."""
    from megatron_flat.megatron.param_offload_optimizer import ParamOffloadOptimizer

    # bf16 (pipeline_dtype: what PP's stages send each other, as Megatron-LM's --bf16 sets)
    overrides = dict(bf16=True, params_dtype=torch.bfloat16,
                     pipeline_dtype=torch.bfloat16) if "bf16" in case else {}
    split = next((v for k, v in SPLITS.items() if k in case), {})
    tiny = TinyMoE(num_experts=4, topk=2, num_layers=4 if "pp2" in case else 3,
                   global_batch_size=2 * world)
    layout = Layout(ep=2, recompute="full", distributed_optimizer="distopt" in case,
                    overlap_grad_reduce="overlap" in case or "buckets" in case,
                    bucket_size=2000 if "buckets" in case else None, **split)
    parallel = dict(ep=2, tp=layout.tp, pp=layout.pp, cp=layout.cp, etp=layout.etp)
    flat = FLAT_ALL if "-all-" in case else FLAT_OPT
    if "-all-" in case and "tp2" in case:
        flat = dataclasses.replace(flat, attn_tiles=4)  # the fifth, under TP 2 + SP
    with megatron_layout(**parallel):
        _, want_losses, want = _train(tiny, layout, overrides, flat)
    with megatron_layout(**parallel):
        trainer, losses, got = _train(tiny, layout, overrides,
                                      dataclasses.replace(flat, param_offload=True))
    experts = [o for o in trainer.optimizer.chained_optimizers
               if isinstance(o, ParamOffloadOptimizer)]
    assert len(experts) == 1
    assert sorted(got) == sorted(want)
    assert losses[0][0] != losses[1][0]
    assert losses == want_losses
    assert [n for n in want if not torch.equal(want[n], got[n])] == []


@pytest.mark.parametrize("world, case", per_world({2: ["ep2"]}))
def test_zero_count_covers_the_host_gradients(megatron_cpu, world, case):
    """--log-num-zeros-in-grad: Megatron's count over the chain equals the run without param
    offload's where experts get no token (their gradients all zero, in the host tier)."""
    tiny = TinyMoE(num_experts=16, topk=2, num_layers=3, seq_length=4, micro_batch_size=1,
                   global_batch_size=2)
    layout = Layout(ep=2, recompute="full")
    with megatron_layout(ep=2):
        _, want, _ = _train(tiny, layout, {}, FLAT_OPT, steps=1)
    with megatron_layout(ep=2):
        trainer, got, _ = _train(tiny, layout, {},
                                 dataclasses.replace(FLAT_OPT, param_offload=True), steps=1)
        offload = trainer.ddp.flat_param_offload.offload
        host_zeros = sum(int((g == 0).sum()) for i in range(len(offload.params))
                         for g in offload.host_grads(i))
    assert host_zeros > 0  # what the count must include
    assert got == want


@pytest.mark.parametrize("world, case", per_world({2: ["ep2"]}))
def test_an_inf_host_gradient_skips_the_step_everywhere(megatron_cpu, world, case):
    """An inf in one rank's host main_grad of an offloaded expert: the inf/nan check the
    offloaded wrappers add (no grad scaler in fp32) reads the host gradients' flag on the
    host and Megatron reports the step skipped on every rank, no parameter changed. The
    check copies nothing to the device (a blocking copy on a GPU): the skipped step's only
    syncs are the reads of the agreed flags, one per wrapped optimizer."""
    import torch.distributed as dist

    from megatron_flat.runtime.ledger import CostLedger

    tiny = TinyMoE(num_experts=4, topk=2, num_layers=3, global_batch_size=2 * world)
    layout = Layout(ep=2, recompute="full")
    with megatron_layout(ep=2):
        trainer, _, _ = _train(tiny, layout, {},
                               dataclasses.replace(FLAT_OPT, param_offload=True), steps=1)
        trainer.forward_backward(1)
        before = {n: p.data.clone() for n, p in trainer.model.named_parameters()}
        offload = trainer.ddp.flat_param_offload.offload
        if dist.get_rank() == 1:
            offload.host_grads(0)[0].view(-1)[0] = float("inf")
        with CostLedger() as ledger:
            ok, grad_norm, _ = trainer.optimizer.step()
        assert ok is False and grad_norm is None
        assert [n for n, p in trainer.model.named_parameters()
                if not torch.equal(p.data, before[n])] == []
        assert dict(ledger.sync_kinds) == {"item": 2}
