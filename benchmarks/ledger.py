"""Stock Megatron vs megatron-flat, side by side, in the counts that decide GPU step time.

For each unit below, one pass under ``MemoryMeter`` gives the device peak and a separate pass
under ``CostLedger`` (``megatron_flat.runtime.ledger``) gives the counts, both on the same
inputs and after one warm-up pass (inside a throwaway ledger, not metered), so one-time
setup is in neither: Megatron's global all-gather buffer and causal mask / rotary tables, the
first call's settings check and plan of PipelinedLLEP, DDP's and Megatron's lazily made
buffers, AdamW state (made by the first optimizer step; for OffloadStreamAdamW also its
bucket plan and staging slots), the SCO host pool (made when SCO is built). Records (one
per unit and variant, ``variant`` in ``stock`` / ``flat``):

``moe``
    One MoE layer forward + backward at EP = world (2): Megatron's ``MoELayer`` with the
    ``alltoall`` dispatcher vs ``FlatMoELayer`` with PipelinedLLEP (``--flat-dispatch
    pipelined``, strided membership, every chunk recomputed in backward), built, wrapped in
    Megatron's DDP and routed (RouterReplay, a ``routing_profile``) as
    ``benchmarks/dispatch.py`` does. ``stages``: the chunk count K of the flat layer.
``moe-recompute``
    The same layers inside Megatron's full recompute, as ``recompute_granularity="full"``
    runs a transformer layer: the forward wrapped in ``tensor_parallel.checkpoint``
    (Megatron's reentrant ``CheckpointFunction``: forward without grad, forward again in
    backward, then backward).
``vocab``
    Output layer + loss at TP = world with sequence parallelism: Megatron's
    ``ColumnParallelLinear`` (all-gather of the tokens, ``[N, V/TP]`` logits) and
    ``vocab_parallel_cross_entropy`` vs Ring-DTP (``RingDTPOutputLoss``, what ``--flat-vocab``
    puts in ``GPTModel``) on the same weight, forward + backward of the mean loss.
    ``stages``: the ring size P.
``sco``
    The demo model's ``TransformerBlock`` (``examples/train_tiny_moe.py`` DEMO_MODEL, EP = 2,
    ``recompute_granularity="full"``), forward + backward of its hidden states: Megatron's
    full recompute vs the same with SCO (``--flat-sco``, DEMO_FLAT's host budget and
    prefetch) offloading each layer's boundary to the pinned host pool. ``stages``: the
    number of checkpointed layers.
``optimizer``
    One ``optimizer.step()`` of the demo trainer (DEMO_MODEL, LAYOUT: EP = 2, Megatron's
    distributed optimizer, Adam): Megatron's stock inner optimizer vs OffloadStreamAdamW
    (``--flat-optimizer-offload``, DEMO_FLAT's buckets and slots). ``stages``: the number of
    buckets the offloaded optimizer streams (dense and expert optimizers together).
``attention-replay``
    The demo model (DEMO_MODEL: 4 layers, CPU flash core attention, LAYOUT: EP 2, full
    recompute), one forward + backward of every microbatch: Megatron's full recompute with
    SCO's boundaries (``--flat-sco``, DEMO_FLAT's budget; the host tier replay needs) vs the
    same with ``--flat-attn-replay`` (each layer's core attention keeps its first pass's
    output and log-sum-exp in SCO's host pool and returns them in the re-run without the
    kernel, the previous layer's pair prefetched). Records add ``layers``, ``peak_bytes``
    (= ``peak_device_bytes``), the ledger's ``attention_forward_calls`` /
    ``attention_backward_calls`` and replay's own copies (``replay_d2h_bytes`` /
    ``replay_h2d_bytes``, also in ``h2d_bytes`` / ``d2h_bytes``). ``stages``: the layers.
``step``
    One whole ``make demo`` training step (forward + backward of every microbatch, grad
    finalization, optimizer step, the Trainer's loss report), stock vs all four techniques
    on (DEMO_FLAT), step 1's batch after a warm-up step on step 0's. ``stages``: a dict
    (dispatch chunks K, ring size, vocab strips per shard, checkpointed layers, optimizer
    buckets).

``optimizer`` and ``step`` share one stock and one flat trainer (same initial weights). After
the warm-up step their learning rate is set to 0: Adam runs the same kernels, the weights
stay put, so every measured pass routes its tokens alike whatever ran before it.

Every record holds the ledger's figures (``flops``, ``all_to_all_bytes``,
``other_collective_bytes``, ``collective_bytes`` / ``collective_calls`` per collective,
``h2d_bytes``, ``d2h_bytes``, ``syncs``, ``sync_kinds``, ``ops``, ``mem_bytes``),
``peak_device_bytes`` (MemoryMeter: device peak above the resting state at entry, worst
rank), ``stages`` and ``shape``. The counts are rank 0's (they are deterministic; other ranks
differ only where their data does), taken on CPU, where the ledger tells device data from
host data by taint: block inputs, parameters, gradients and optimizer state are device data,
what is built only from host factories (a plan) is host data, the host pool is host memory
(see the ``ledger`` module docstring). The warm-up pass runs inside a throwaway ledger, so
state it makes keeps its origin (AdamW's step counters and the flat plans are host data, as
on a GPU); Megatron's dispatcher chunk-sort indices, made on the host at construction, are
marked host data by the CPU backend (``megatron_flat.cpu.backend``).

Reading the stock MoE syncs: on a GPU, Megatron's alltoall dispatcher copies its split sizes
and token counts to the host asynchronously and waits once (``d2h_event.synchronize()``);
the CPU backend (``megatron_flat.cpu.backend``) does the same (host copies, a counted
``event_synchronize``), so the stock rows show that one wait and 0.16's two
``masked_select`` (``permute``), as a GPU run would. Run (about half a minute on
2 CPU cores)::

    torchrun --standalone --nproc-per-node 2 benchmarks/ledger.py --json results/ledger.json
    torchrun --standalone --nproc-per-node 2 benchmarks/ledger.py --units moe vocab
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_flat.plan.time import format_seconds, overlap_for, predict
from megatron_flat.runtime.ledger import CostLedger, format_count
from megatron_flat.runtime.memory import MemoryMeter, format_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UNITS = ["moe", "moe-recompute", "vocab", "sco", "attention-replay", "optimizer", "step"]
VARIANTS = ["stock", "flat"]
RECORD_KEYS = ["unit", "variant", "flops", "all_to_all_bytes", "other_collective_bytes",
               "h2d_bytes", "d2h_bytes", "syncs", "ops", "mem_bytes", "peak_device_bytes",
               "attention_forward_calls", "attention_backward_calls",
               "sync_kinds", "collective_calls", "collective_bytes", "stages", "shape"]


def _load(name: str, path: str):
    """A module of a directory that is not a package (benchmarks/, examples/)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dispatch_bench():
    return _load("megatron_flat_bench_dispatch", os.path.join(HERE, "dispatch.py"))


def demo():
    return _load("megatron_flat_demo", os.path.join(ROOT, "examples", "train_tiny_moe.py"))


# ------------------------------------------------------------------------------ measuring
def _worst(value: int) -> int:
    """Max over the ranks (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def count(run: Callable[[], Any]) -> dict:
    """This rank's ledger figures of ``run()``."""
    with CostLedger() as ledger:
        run()
    return ledger.totals.as_dict()


def warm(run: Callable[[], Any]) -> None:
    """A warm-up pass inside a ledger whose counts are thrown away: state it makes (AdamW's
    step counters, plans and caches built from host data) keeps its origin as host data,
    as on a GPU, instead of counting as device data never seen before."""
    with CostLedger():
        run()


def measure(run: Callable[[], Any], *, warm_up: bool = True) -> tuple[int, dict]:
    """(worst rank's device peak, this rank's ledger figures) of ``run()``: a warm-up pass
    (unless ``warm_up`` is False: the caller ran one), a metered pass, a counted pass."""
    if warm_up:
        warm(run)
    with MemoryMeter() as meter:
        run()
    peak = meter.peak_device_bytes
    costs = count(run)
    return _worst(peak), costs


def record(unit: str, variant: str, peak: int, costs: dict, stages: Any, shape: dict) -> dict:
    # The step-time model's prediction for an H200 from these counts and the unit's overlap
    # (plan.time.OVERLAPS); a whole step is predicted serially (an upper bound: its units'
    # overlap is not separated out of one count).
    overlap = overlap_for(unit, variant, stages if isinstance(stages, int) else 1)
    prediction = predict(costs, overlap, "H200")
    return dict(unit=unit, variant=variant, **costs, peak_device_bytes=peak, stages=stages,
                shape=dict(shape), predicted_s=prediction.total_s,
                prediction=prediction.as_dict())


# ------------------------------------------------------------------------------ moe units
def _moe_layers(args):
    """(stock alltoall DDP(MoELayer), flat DDP(FlatMoELayer) with PipelinedLLEP), same
    weights, built by ``benchmarks/dispatch.py``'s ``build_layers``."""
    ns = argparse.Namespace(
        experts=args.experts, topk=args.topk, hidden=args.hidden, ffn=args.ffn,
        chunk=args.chunk, max_chunks=args.max_chunks,
        min_tokens_per_gemm=args.min_tokens_per_gemm,
        imbalance_threshold=args.imbalance_threshold, saved_chunks=args.max_chunks,
        grouped=False)
    layers = dispatch_bench().build_layers(ns, torch.device("cpu"))
    return layers["alltoall"], layers["pipelined-strided"]


def _moe_pass(ddp, x, grad, ids, recompute: bool) -> None:
    """Forward + backward of one MoE layer (under Megatron's full recompute if asked), the
    routing replayed through both (the recompute in backward routes again)."""
    from megatron.core import tensor_parallel

    from megatron_flat.megatron.moe import replay_routing

    x = x.detach().requires_grad_()
    with replay_routing(ddp.module, ids):
        if recompute:
            # What TransformerBlock._checkpointed_forward does with a layer (0.19:
            # megatron.core.recompute.checkpointed_forward): Megatron's reentrant checkpoint.
            out = tensor_parallel.checkpoint(lambda h: ddp(h)[0], False, x)
        else:
            out, _ = ddp(x)
        out.backward(grad)


def _moe_shape(args) -> dict:
    return dict(experts=args.experts, topk=args.topk, tokens_per_rank=args.tokens,
                hidden=args.hidden, ffn=args.ffn, chunk_cap=args.chunk,
                max_chunks=args.max_chunks, profile=args.profile,
                ep=dist.get_world_size())


def _moe_units(args, units: list[str]) -> list[dict]:
    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.testing.distributed import megatron_layout

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    with megatron_layout(ep=world):
        stock, flat = _moe_layers(args)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(args.tokens, 1, args.hidden, generator=gen)
        grad = torch.randn(args.tokens, 1, args.hidden, generator=gen)
        ids = routing_profile(args.profile, args.tokens, args.experts, args.topk)
        # Every rank routes alike: rank r computes world x (its experts' routes of one rank)
        # and sends off-rank the routes to other ranks' experts (plain EP; the formulas of
        # megatron_flat.plan.costs take these).
        native = (ids // (args.experts // world)) == rank
        routes = dict(routes_computed=int(native.sum()) * world,
                      routes_sent_off_rank=int((~native).sum()))
        for unit in units:
            recompute = unit == "moe-recompute"
            shape = _moe_shape(args) | routes | {"recompute": "full" if recompute else None}
            for variant, layer in (("stock", stock), ("flat", flat)):
                peak, costs = measure(lambda: _moe_pass(layer, x, grad, ids, recompute))
                stages, units = 1, {}
                if variant == "flat":  # chunks, and (expert, chunk) units run on this rank
                    last = layer.module.flat_dispatch.last
                    stages, units = last.num_chunks, {"units": last.units}
                out.append(record(unit, variant, peak, costs, stages, shape | units))
        del stock, flat
    return out


def unit_moe(args) -> list[dict]:
    """``moe``: one MoE layer forward + backward, alltoall MoELayer vs PipelinedLLEP."""
    return _moe_units(args, ["moe"])


def unit_moe_recompute(args) -> list[dict]:
    """``moe-recompute``: the same inside Megatron's full recompute (reentrant checkpoint)."""
    return _moe_units(args, ["moe-recompute"])


# ------------------------------------------------------------------------------ vocab
def unit_vocab(args) -> list[dict]:
    """``vocab``: ColumnParallelLinear + vocab_parallel_cross_entropy vs Ring-DTP at TP=P."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_flat.megatron import compat
    from megatron_flat.megatron.vocab import RingDTPOutputLoss
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = args.vocab_per_rank * world
    seq = args.vocab_tokens * world  # the whole sequence; each rank holds s/TP rows (SP)
    shape = dict(tp=world, tokens_per_rank=args.vocab_tokens, hidden=args.hidden,
                 vocab=vocab, vocab_per_rank=args.vocab_per_rank,
                 block_size=args.vocab_block, sequence_parallel=world > 1, mode="auto")
    out = []
    with megatron_layout(tp=world):
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tiny = TinyMoE(num_layers=1, hidden_size=args.hidden, num_attention_heads=world,
                       vocab_size=vocab, seq_length=seq, micro_batch_size=1)
        config = transformer_config(tiny, tp=world)
        torch.manual_seed(1234)
        output_layer = ColumnParallelLinear(  # as GPTModel builds its output layer
            config.hidden_size, vocab, config=config, init_method=config.init_method,
            bias=False, skip_bias_add=False, gather_output=False, tp_group=tp_group)
        ring = RingDTPOutputLoss(tp_group if world > 1 else None,
                                 sequence_parallel=config.sequence_parallel, mode="auto",
                                 block_size=args.vocab_block)
        gen = torch.Generator().manual_seed(4321)
        labels = torch.randint(0, vocab, (1, seq), generator=gen)  # [b, s], every rank
        gen.manual_seed(100 + rank)
        hidden = torch.randn(seq // world, 1, args.hidden, generator=gen)  # [s/TP, b, H]

        def stock() -> None:
            h = hidden.detach().requires_grad_()
            logits, _ = output_layer(h)  # [s, b, V/TP]
            loss = compat.vocab_parallel_cross_entropy(
                logits, labels.transpose(0, 1).contiguous(), tp_group)
            loss.transpose(0, 1).contiguous().mean().backward()

        def flat() -> None:
            h = hidden.detach().requires_grad_()
            ring(h, output_layer.weight, labels).mean().backward()

        for variant, run in (("stock", stock), ("flat", flat)):
            peak, costs = measure(run)
            out.append(record("vocab", variant, peak, costs,
                              world if variant == "flat" else 1, shape))
    return out


# ------------------------------------------------------------------------------ sco
def unit_sco(args) -> list[dict]:
    """``sco``: the demo model's TransformerBlock under full recompute, SCO off vs on."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_flat.checkpoint import SelectiveCheckpointOffload
    from megatron_flat.megatron import sco
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import build_tiny_gpt, transformer_config

    bench = demo()
    tiny = bench.DEMO_MODEL.with_(seq_length=args.seq_length)
    flat_cfg = bench.DEMO_FLAT
    layout = bench.LAYOUT
    rank = dist.get_rank()
    shape = dict(layers=tiny.num_layers, hidden=tiny.hidden_size, seq=tiny.seq_length,
                 micro_batch=tiny.micro_batch_size, experts=tiny.num_experts, topk=tiny.topk,
                 ep=layout.ep, recompute="full", recompute_method=layout.recompute_method,
                 host_budget_bytes=flat_cfg.sco_host_budget_bytes,
                 prefetch=flat_cfg.sco_prefetch)
    out = []
    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed):
        config = transformer_config(tiny, tp=layout.tp, ep=layout.ep, pp=layout.pp,
                                    recompute="full", recompute_method=layout.recompute_method)
        model = build_tiny_gpt(tiny, config)
        ddp = DistributedDataParallel(  # persistent fp32 grad buffers, as in training
            config=config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                     overlap_grad_reduce=False))
        decoder = model.decoder
        rope = model.rotary_pos_emb(tiny.seq_length)
        gen = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(tiny.seq_length, tiny.micro_batch_size, tiny.hidden_size, generator=gen)
        grad = torch.randn(x.shape, generator=gen)
        engine = SelectiveCheckpointOffload(flat_cfg.sco_host_budget_bytes,
                                            prefetch=flat_cfg.sco_prefetch)

        def run() -> None:
            h = x.detach().requires_grad_()
            y = decoder(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)
            y.backward(grad)

        @contextlib.contextmanager
        def sco_on() -> Iterator[None]:
            sco.enable(0, sco=engine)
            try:
                yield
            finally:
                sco.disable()

        for variant in VARIANTS:
            scope = sco_on() if variant == "flat" else contextlib.nullcontext()
            with scope:
                peak, costs = measure(run)
            out.append(record("sco", variant, peak, costs,
                              tiny.num_layers if variant == "flat" else 1, shape))
        del ddp, model, decoder
    return out


# ------------------------------------------------------------------------------ demo trainer
class DemoTrainers:
    """The demo's stock and flat (all four on) Trainers, built once for ``optimizer`` and
    ``step`` (call inside the demo layout); each has run one warm-up step."""

    def __init__(self, args) -> None:
        from megatron_flat.testing.equivalence import full_tensors, load_full
        from megatron_flat.testing.training import Trainer

        bench = demo()
        self.tiny = bench.DEMO_MODEL.with_(seq_length=args.seq_length)
        self.layout = bench.LAYOUT
        self.flat_config = bench.DEMO_FLAT
        stock = Trainer(self.tiny, self.layout, lr=args.lr)
        initial = full_tensors([stock.model])
        flat = Trainer(self.tiny, self.layout, lr=args.lr, flat=self.flat_config,
                       init=lambda model: load_full([model], initial))
        self.trainers = {"stock": stock, "flat": flat}
        for trainer in self.trainers.values():  # warm-up: caches, optimizer state, plans
            warm(lambda trainer=trainer: (trainer.forward_backward(0), trainer.optimizer_step()))
            # Measured steps leave the weights as they are (Adam with lr 0 runs the same
            # kernels), so every pass routes its tokens alike whatever ran before it.
            for group in trainer.optimizer.param_groups:
                group["lr"] = 0.0

    def shape(self) -> dict:
        t = self.tiny
        return dict(layers=t.num_layers, hidden=t.hidden_size, heads=t.num_attention_heads,
                    experts=t.num_experts, topk=t.topk, expert_ffn=t.moe_ffn_hidden_size,
                    vocab=t.vocab_size, seq=t.seq_length, micro_batch=t.micro_batch_size,
                    global_batch=t.global_batch_size, layout=self.layout.name)

    def optimizer_buckets(self) -> int:
        from megatron_flat.megatron.optimizer import inner_optimizers

        return sum(len(inner.plan.buckets)
                   for inner in inner_optimizers(self.trainers["flat"].optimizer)
                   if hasattr(inner, "plan"))

    def dispatch_chunks(self) -> int:
        from megatron_flat.megatron.moe import FlatMoELayer

        ks = [m.flat_dispatch.last.num_chunks for m in self.trainers["flat"].model.modules()
              if isinstance(m, FlatMoELayer) and m.flat_dispatch is not None
              and m.flat_dispatch.last is not None]
        return max(ks) if ks else 0


@contextlib.contextmanager
def demo_trainers(args) -> Iterator[DemoTrainers]:
    from megatron_flat.testing.distributed import megatron_layout

    layout = demo().LAYOUT
    tiny = demo().DEMO_MODEL
    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed):
        trainers = DemoTrainers(args)
        try:
            yield trainers
        finally:
            del trainers


def unit_optimizer(args, trainers: Optional[DemoTrainers] = None) -> list[dict]:
    """``optimizer``: one step of Megatron's distributed optimizer, stock Adam vs
    OffloadStreamAdamW (gradients from the warm-up step)."""
    if trainers is None:
        with demo_trainers(args) as built:
            return unit_optimizer(args, built)
    f = trainers.flat_config
    shape = trainers.shape() | dict(distributed_optimizer=True,
                                    bucket_numel=f.optimizer_bucket_numel,
                                    slots=f.optimizer_num_slots)
    out = []
    for variant in VARIANTS:
        trainer = trainers.trainers[variant]
        peak, costs = measure(trainer.optimizer_step, warm_up=False)  # warmed in DemoTrainers
        stages = trainers.optimizer_buckets() if variant == "flat" else 1
        out.append(record("optimizer", variant, peak, costs, stages, shape))
    return out


def unit_step(args, trainers: Optional[DemoTrainers] = None) -> list[dict]:
    """``step``: one whole demo training step, stock vs all four on."""
    if trainers is None:
        with demo_trainers(args) as built:
            return unit_step(args, built)
    f = trainers.flat_config
    shape = trainers.shape() | dict(flat=f.describe())
    out = []
    for variant in VARIANTS:
        trainer = trainers.trainers[variant]

        def run(trainer=trainer) -> None:
            trainer.forward_backward(1)
            trainer.optimizer_step()

        peak, costs = measure(run, warm_up=False)  # warmed in DemoTrainers (step 0)
        stages: Any = 1
        if variant == "flat":
            block = f.vocab_block_size
            stages = dict(dispatch_chunks=trainers.dispatch_chunks(),
                          ring=trainers.layout.tp,
                          vocab_strips=-(-trainers.tiny.vocab_size // trainers.layout.tp
                                         // block),
                          checkpointed_layers=trainers.tiny.num_layers,
                          optimizer_buckets=trainers.optimizer_buckets())
        out.append(record("step", variant, peak, costs, stages, shape))
    return out


def unit_attention_replay(args) -> list[dict]:
    """``attention-replay``: the demo model's forward + backward under full recompute with
    SCO's boundaries, without and with ``--flat-attn-replay``, from the same weights."""
    import dataclasses

    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron import attention_replay
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.equivalence import full_tensors, load_full
    from megatron_flat.testing.training import Trainer

    bench = demo()
    layout, tiny = bench.LAYOUT, bench.DEMO_MODEL.with_(seq_length=args.seq_length)
    sco = FlatConfig(sco=True, sco_host_budget_gib=bench.DEMO_FLAT.sco_host_budget_gib,
                     sco_prefetch=bench.DEMO_FLAT.sco_prefetch)
    configs = {"stock": sco, "flat": dataclasses.replace(sco, attn_replay=True)}
    shape = dict(layers=tiny.num_layers, hidden=tiny.hidden_size,
                 heads=tiny.num_attention_heads, seq=tiny.seq_length,
                 micro_batch=tiny.micro_batch_size, global_batch=tiny.global_batch_size,
                 layout=layout.name, baseline="full recompute + SCO", flat="+ attention replay")
    out = []
    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed):
        initial = None
        for variant in VARIANTS:
            init = None if initial is None else (lambda model: load_full([model], initial))
            trainer = Trainer(tiny, layout, lr=args.lr, flat=configs[variant], init=init)
            if initial is None:
                initial = full_tensors([trainer.model])
            try:
                peak, costs = measure(lambda trainer=trainer: trainer.forward_backward(0))
                # replay's own copies in one pass (its counters span every pass run)
                before = _replay_copies(trainer)
                warm(lambda trainer=trainer: trainer.forward_backward(0))
                after = _replay_copies(trainer)
                trainer.sco.synchronize()
            finally:
                attention_replay.disable()
            extra = dict(layers=tiny.num_layers, peak_bytes=peak,
                         replay_d2h_bytes=after[0] - before[0],
                         replay_h2d_bytes=after[1] - before[1])
            out.append(record("attention-replay", variant, peak, costs, tiny.num_layers,
                              shape) | extra)
            del trainer
    return out


def _replay_copies(trainer) -> tuple[int, int]:
    """(d2h, h2d) bytes attention replay's host tier has copied so far (0, 0 without it)."""
    if not trainer.replay_stores:
        return 0, 0
    stats = trainer.replay_stores[0].host.stats  # one host tier, shared by every store
    return stats.bytes_offloaded, stats.bytes_reloaded


UNIT_FUNCTIONS = {
    "moe": unit_moe,
    "moe-recompute": unit_moe_recompute,
    "vocab": unit_vocab,
    "sco": unit_sco,
    "attention-replay": unit_attention_replay,
    "optimizer": unit_optimizer,
    "step": unit_step,
}


def run_units(args, units: list[str]) -> list[dict]:
    """Every unit asked for, in ``UNITS`` order; the two MoE units share their layers and
    ``optimizer`` and ``step`` their trainers."""
    units = [u for u in UNITS if u in units]
    records: list[dict] = []
    moe = [u for u in units if u.startswith("moe")]
    if moe:
        records += _moe_units(args, moe)
    for unit in ("vocab", "sco", "attention-replay"):
        if unit in units:
            records += UNIT_FUNCTIONS[unit](args)
    trained = [u for u in units if u in ("optimizer", "step")]
    if trained:
        with demo_trainers(args) as trainers:
            for unit in trained:
                records += UNIT_FUNCTIONS[unit](args, trainers)
    return records


# ------------------------------------------------------------------------------ report
COLUMNS = [  # (heading, key, formatter)
    ("FLOPs", "flops", format_count),
    ("all-to-all", "all_to_all_bytes", format_bytes),
    ("other coll.", "other_collective_bytes", format_bytes),
    ("h2d", "h2d_bytes", format_bytes),
    ("d2h", "d2h_bytes", format_bytes),
    ("syncs", "syncs", format_count),
    ("ops", "ops", format_count),
    ("device peak", "peak_device_bytes", format_bytes),
    ("pred. H200", "predicted_s", format_seconds),
]


def _ratio(flat: float, stock: float) -> str:
    if stock == 0:
        return "n/a" if flat else "1.00x"
    return f"{flat / stock:.2f}x"


def print_table(records: list[dict], world: int) -> None:
    print(f"\nstock vs flat on CPU, {world} ranks (gloo): counts are rank 0's (CostLedger), "
          "device peak the worst rank's (MemoryMeter, above the resting state); pred. H200: "
          "time predicted from the counts by the step-time model (plan.time), not measured")
    head = f"{'unit':14s} {'variant':7s}" + "".join(f" {h:>12s}" for h, _, _ in COLUMNS)
    print(head)
    print("-" * len(head))
    by = {(r["unit"], r["variant"]): r for r in records}
    for unit in [u for u in UNITS if any(r["unit"] == u for r in records)]:
        for variant in VARIANTS:
            r = by.get((unit, variant))
            if r is None:
                continue
            print(f"{unit:14s} {variant:7s}" + "".join(f" {fmt(r[k]):>12s}"
                                                       for _, k, fmt in COLUMNS))
        if (unit, "stock") in by and (unit, "flat") in by:
            s, f = by[(unit, "stock")], by[(unit, "flat")]
            print(f"{'':14s} {'flat/st':7s} syncs {_ratio(f['syncs'], s['syncs'])}, "
                  f"FLOPs {_ratio(f['flops'], s['flops'])}, "
                  f"peak {_ratio(f['peak_device_bytes'], s['peak_device_bytes'])}; "
                  f"stages {f['stages']}; sync kinds stock {dict(s['sync_kinds'])} "
                  f"flat {dict(f['sync_kinds'])}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", nargs="+", choices=UNITS, default=UNITS)
    p.add_argument("--json", default=None, help="write the records here (rank 0)")
    g = p.add_argument_group("moe, moe-recompute")
    g.add_argument("--experts", type=int, default=16)
    g.add_argument("--topk", type=int, default=4)
    g.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    g.add_argument("--hidden", type=int, default=256, help="hidden size (also vocab's)")
    g.add_argument("--ffn", type=int, default=256, help="expert FFN hidden size")
    g.add_argument("--chunk", type=int, default=128, help="per-source token cap per chunk")
    g.add_argument("--max-chunks", type=int, default=16, help="K_max")
    g.add_argument("--min-tokens-per-gemm", type=int, default=64, help="LLEP m")
    g.add_argument("--imbalance-threshold", type=float, default=1.3, help="LLEP lambda")
    g.add_argument("--profile", default="balanced",
                   help="routing profile (megatron_flat.dispatch.profiles)")
    g = p.add_argument_group("vocab")
    g.add_argument("--vocab-tokens", type=int, default=512, help="tokens per rank (s/TP)")
    g.add_argument("--vocab-per-rank", type=int, default=4096, help="V/TP")
    g.add_argument("--vocab-block", type=int, default=1024,
                   help="Ring-DTP strip rows (FlatConfig.vocab_block_size)")
    g = p.add_argument_group("sco, attention-replay, optimizer, step (the demo model)")
    g.add_argument("--seq-length", type=int, default=512)
    g.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    from megatron_flat.cpu.backend import enable_cpu_backend
    from megatron_flat.testing.distributed import init_distributed

    args = parse_args(argv)
    world = init_distributed()
    enable_cpu_backend()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    start = time.perf_counter()
    records = run_units(args, args.units)
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print_table(records, world)
        print(f"\n{len(records)} records in {seconds:.1f} s")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1, default=str)
            print(f"wrote {args.json}")
    return records


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
