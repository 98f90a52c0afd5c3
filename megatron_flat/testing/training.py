"""One Megatron training setup shared by the equivalence harness, the demo and benchmarks.

``Trainer`` builds this rank's model for a ``Layout`` (inside an active
``megatron_layout``), wraps it in Megatron's DDP, builds Megatron's optimizer and runs a
step with the schedule that fits the pipeline size (1F1B when PP > 1). Nothing here
hides Megatron: the attributes are the real Megatron objects.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import types
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_flat.runtime import memory
from megatron_flat.testing.tiny_gpt import (
    MicroBatch,
    TinyMoE,
    build_tiny_gpt,
    cp_share,
    dp_share,
    global_batch,
    reset_mtp_tracker,
    transformer_config,
)

LR = 1e-3
CLIP_GRAD = 1.0


@dataclass(frozen=True)
class Layout:
    """How the tiny model is split over the world (DP is whatever remains)."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dispatcher: str = "alltoall"
    distributed_optimizer: bool = False
    recompute: Optional[str] = None  # None, "full" or "selective"
    recompute_method: str = "uniform"  # full recompute: "uniform" or "block"
    recompute_num_layers: int = 1  # full recompute: layers per checkpointed region (uniform)
    recompute_modules: tuple = ()  # selective recompute: Megatron's module names
    etp: Optional[int] = None  # experts' tensor-parallel size (None: Megatron's default, tp)
    # Context parallelism: each CP rank holds two load-balanced chunks of every sequence
    # (tiny_gpt.cp_share) and attends through cpu.context_attention on CPU.
    cp: int = 1
    # DDP's --overlap-grad-reduce: each bucket's reduction starts as its gradients are ready.
    overlap_grad_reduce: bool = False
    # DDP's --ddp-bucket-size (elements; None: Megatron's default). Megatron keeps it only
    # with overlap_grad_reduce (one bucket otherwise).
    bucket_size: Optional[int] = None

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"ep{self.ep}", f"pp{self.pp}", self.dispatcher]
        if self.cp != 1:
            parts.insert(1, f"cp{self.cp}")
        if self.etp is not None:
            parts.insert(2, f"etp{self.etp}")
        if self.distributed_optimizer:
            parts.append("distopt")
        if self.overlap_grad_reduce:
            parts.append("overlap")
        if self.bucket_size is not None:
            parts.append(f"bucket{self.bucket_size}")
        if self.recompute == "full":
            parts.append(f"recompute-full-{self.recompute_method}"
                         + (f"{self.recompute_num_layers}" if self.recompute_num_layers != 1
                            else ""))
        elif self.recompute:
            parts.append("recompute-selective-" + "+".join(self.recompute_modules))
        return "-".join(parts)


def forward_step(data_iterator, model):
    """Megatron ``forward_step_func``: per-token loss, mean over the microbatch.

    Under CP the mean is over this rank's chunks: every CP rank holds as many tokens, so the
    mean of the CP ranks' means is the microbatch mean, and DDP's average over the data-
    and context-parallel group turns their gradients into its gradient (the K/V all-gather's
    backward brings each rank the gradient its tokens get from its peers' queries)."""
    from megatron.core import parallel_state

    mb: MicroBatch = next(data_iterator)
    if mb.loss_mask is not None:
        raise ValueError("a loss mask needs calculate_per_token_loss (forward_step_per_token): "
                         "the mean-loss forward step counts every token")
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels)
    cp = parallel_state.get_context_parallel_world_size()

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        # The schedule multiplies a (loss, dict) loss by the CP size (Megatron-LM's loss is the
        # CP group's mean, whose gradient reaches only this rank's tokens); handing it the
        # local mean / CP backpropagates the local mean, exactly (CP is a power of two).
        # clone: the schedule divides the returned loss in place by the microbatch count.
        return loss / cp, {"loss": loss.detach().clone()}

    return output, loss_func


def forward_step_per_token(data_iterator, model):
    """Megatron ``forward_step_func`` for ``calculate_per_token_loss`` (Megatron-LM's
    ``--calculate-per-token-loss``): the loss function returns ``(sum of the masked per-token
    loss, number of unmasked tokens, dict)``, as ``pretrain_gpt.py``'s does. The schedule then
    neither divides by the microbatch count nor multiplies by the CP size, DDP sums the data-
    and context-parallel gradients instead of averaging them, and ``finalize_model_grads``
    divides every gradient by the step's token count summed over that group: the gradient of
    the global batch's mean token loss, however unevenly the mask spreads the tokens.

    The model gets the loss mask (Megatron's MTP heads roll and count it; Ring-DTP gives
    masked tokens no loss and no gradient). Under CP each rank returns its own chunks' sum
    and count: their sums over the CP group are the microbatch's, and the K/V all-gather's
    backward brings each rank the gradient its tokens get from its peers' queries, so no CP
    factor is needed anywhere."""
    mb: MicroBatch = next(data_iterator)
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels, loss_mask=mb.loss_mask)

    def loss_func(per_token_loss):
        losses = per_token_loss.float()
        mask = (torch.ones_like(losses) if mb.loss_mask is None
                else mb.loss_mask.to(losses.device, losses.dtype))
        loss_sum = (losses * mask).sum()
        # int: the schedule accumulates it into an int32 total for finalize_model_grads.
        num_tokens = mask.sum().detach().to(torch.int)
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().clone(),
                                      "num_tokens": num_tokens.clone()}

    return output, loss_func


class Trainer:
    """Model + DDP + optimizer + schedule for one layout. Call inside ``megatron_layout``.

    ``flat`` (a ``FlatConfig``, optional) turns on, for this trainer only, every technique
    it enables: the flat MoE layer (``dispatch``), Ring-DTP's output module (``vocab``),
    SCO for the recompute boundaries while this trainer's steps run (``sco``; needs
    full recompute, or selective recompute of ``core_attn``, ``moe`` or ``mlp``) and OffloadStreamAdamW as Megatron's inner optimizer
    (``optimizer_offload``). ``Trainer(flat=None)`` and ``Trainer(flat=FlatConfig())`` are
    stock Megatron. ``count_zeros``: Megatron's ``--log-num-zeros-in-grad`` (each
    ``optimizer_step`` keeps the count in ``num_zeros``).

    The forward step follows the config: ``forward_step`` (mean token loss per microbatch)
    or, with ``config_overrides={"calculate_per_token_loss": True}``,
    ``forward_step_per_token`` (the only one that takes ``TinyMoE.masked_fraction``'s masks).
    """

    def __init__(self, tiny: TinyMoE, layout: Layout, *, config_overrides: Optional[dict] = None,
                 wrap_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                 init: Optional[Callable[[torch.nn.Module], None]] = None, lr: float = LR,
                 flat=None, count_zeros: bool = False):
        from megatron.core.distributed import finalize_model_grads

        self.tiny, self.layout = tiny, layout
        # --log-num-zeros-in-grad: optimizer_step keeps Megatron's count in num_zeros
        self.count_zeros = count_zeros
        self.num_zeros = None
        settings = dict(
            tp=layout.tp, ep=layout.ep, pp=layout.pp, dispatcher=layout.dispatcher,
            recompute=layout.recompute, recompute_method=layout.recompute_method,
            recompute_num_layers=layout.recompute_num_layers,
            recompute_modules=layout.recompute_modules,
            **({} if layout.etp is None else {"expert_tensor_parallel_size": layout.etp}),
            **({} if layout.cp == 1 else {"context_parallel_size": layout.cp}))
        settings.update(config_overrides or {})  # the caller's overrides win
        self.config = transformer_config(tiny, **settings)
        self.flat = flat
        if getattr(self.config, "mtp_num_layers", None):
            reset_mtp_tracker()
        if flat is not None and flat.sco:
            from megatron_flat.megatron.sco import recompute_problems

            problems = recompute_problems(self.config)
            if problems:
                raise ValueError(f"layout {layout.name}: " + "; ".join(problems))
        with _flat_specs(flat):
            model = build_tiny_gpt(tiny, self.config, flat=flat)
        if flat is not None and flat.vocab:
            from megatron_flat.megatron.vocab import enable_ring_dtp

            enable_ring_dtp(model, flat)
        self._sco = None
        if flat is not None and flat.sco:
            from megatron_flat.checkpoint import SelectiveCheckpointOffload

            self._sco = SelectiveCheckpointOffload(flat.sco_host_budget_bytes,
                                                   prefetch=flat.sco_prefetch)
        self.replay_stores = self._attach_replay(model, flat)
        if wrap_model is not None:
            model = wrap_model(model)
        if init is not None:
            init(model)
        self.model = model
        offloading = contextlib.nullcontext()
        if flat is not None and flat.param_offload:
            from megatron_flat.megatron.param_offload import offloading

            offloading = offloading(flat)
        with offloading:  # param offload: DDP leaves the experts out, the chain steps them
            self.ddp, self.optimizer = self._ddp_and_optimizer(model, layout, flat, lr)
        self.config.finalize_model_grads_func = finalize_model_grads
        self._start()

    def _ddp_and_optimizer(self, model, layout: Layout, flat, lr: float) -> tuple:
        """Megatron's DDP over ``model`` and its optimizer (OffloadStreamAdamW inner ones
        with ``flat.optimizer_offload``)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=layout.overlap_grad_reduce,
                use_distributed_optimizer=layout.distributed_optimizer,
                bucket_size=layout.bucket_size,
            ),
            module=model,
        )
        # With ``flat.optimizer_offload`` Megatron's inner optimizer is OffloadStreamAdamW.
        build_optimizer = get_megatron_optimizer
        if flat is not None:
            from megatron_flat.megatron.optimizer import get_megatron_offload_optimizer

            build_optimizer = functools.partial(get_megatron_offload_optimizer, flat=flat)
        optimizer = build_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                adam_eps=1e-8, clip_grad=CLIP_GRAD,
                # bf16 parameters (config_overrides={"bf16": True, "params_dtype": bf16})
                # get Megatron's mixed-precision optimizer: fp32 main params and grads
                bf16=bool(getattr(self.config, "bf16", False)),
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=layout.distributed_optimizer,
                log_num_zeros_in_grad=self.count_zeros,
            ),
            [ddp],
        )
        return ddp, optimizer

    def _start(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_step = (forward_step_per_token if self.config.calculate_per_token_loss
                             else forward_step)
        self.config.no_sync_func = self.ddp.no_sync
        self._forward_backward = get_forward_backward_func()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_size = parallel_state.get_context_parallel_world_size()

    def _attach_replay(self, model, flat) -> list:
        """``flat.attn_replay``: this trainer's replay-capable core attentions keep their
        first outputs in its SCO's host pool (what ``install()`` wires process-wide); the
        stock recompute with ``install()``'s one warning where that cannot be exact."""
        if flat is None or not flat.attn_replay:
            return []
        from megatron_flat.megatron.replay_wiring import (
            fallback_reasons,
            recompute_problems,
            warn_fallback,
        )

        problems = recompute_problems(self.config)
        if problems:
            raise ValueError(f"layout {self.layout.name}: " + "; ".join(problems))
        reasons = fallback_reasons(flat, self.config)
        if reasons:
            warn_fallback(reasons)
            return []
        from megatron_flat.attention.replay_host import ReplayHost
        from megatron_flat.megatron import attention_replay

        host = ReplayHost(self._sco.mover)
        return [a.replay for a in attention_replay.attach(model, host=host)]

    def microbatches(self, step: int) -> List[MicroBatch]:
        """This rank's microbatches of the step: its data-parallel share of the global batch,
        each cut to its context-parallel chunks."""
        mine = dp_share(global_batch(self.tiny, step), self.dp_rank, self.dp_size)
        return [cp_share(mb, self.cp_rank, self.cp_size) for mb in mine]

    def warm_up(self) -> None:
        """One forward-only pass over step 0's batch (no grads, no optimizer state).

        Fills Megatron's one-time caches (causal mask, rotary tables) so a meter opened
        afterwards attributes only per-step memory to the components.
        """
        mine = self.microbatches(0)
        with self._sco_scope():
            self._forward_backward(
                forward_step_func=self.forward_step, data_iterator=iter(mine), model=[self.ddp],
                num_microbatches=len(mine), seq_length=self.tiny.seq_length,
                micro_batch_size=self.tiny.micro_batch_size, forward_only=True,
            )

    def forward_backward(self, step: int) -> float:
        """Zero grads, run every microbatch of this rank's share; returns the step's mean loss
        over the global batch (known on every rank; with a per-token loss the mean over its
        unmasked tokens). Grads are finalized (reduced)."""
        mine = self.microbatches(step)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._sco_scope():
            loss_dicts = self._forward_backward(
                forward_step_func=self.forward_step,
                data_iterator=iter(mine),
                model=[self.ddp],
                num_microbatches=len(mine),
                seq_length=self.tiny.seq_length,
                micro_batch_size=self.tiny.micro_batch_size,
                forward_only=False,
            )
        return step_loss(loss_dicts)

    @contextlib.contextmanager
    def _sco_scope(self) -> Iterator[None]:
        """SCO routes this trainer's full-recompute boundaries while its steps run (SCO is a
        process-wide patch; whatever was in force before comes back afterwards)."""
        if self._sco is None:
            yield
            return
        from megatron_flat.megatron import sco

        previous = sco.enabled()
        sco.enable(0, sco=self._sco)
        try:
            yield
        finally:
            if previous is None:
                sco.disable()
            else:
                sco.enable(0, sco=previous)

    @property
    def sco(self):
        """This trainer's ``SelectiveCheckpointOffload`` (None without ``flat.sco``)."""
        return self._sco

    def optimizer_step(self) -> None:
        ok, _, self.num_zeros = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"{self.layout.name}: optimizer step was skipped")

    def release(self) -> None:
        """Let go of the model, DDP and optimizer (``megatron_flat.release``: DDP's
        gradient-accumulator hooks, param offload's host tier and slots, the host optimizer
        state, cached rotary tables) and of this trainer's SCO pool and replay stores, so
        that dropping the trainer frees them all. The trainer is unusable afterwards."""
        from megatron_flat.megatron.release import release

        release([self.ddp], self.optimizer)
        self._sco = None
        self.replay_stores = []


def _flat_specs(flat):
    """Megatron's stock spec functions build the flat MoE layer while the model is built
    (when ``flat.dispatch`` is on)."""
    if flat is None or flat.dispatch == "off":
        return contextlib.nullcontext()
    from megatron_flat.megatron.spec import flat_moe_specs

    return flat_moe_specs(flat)


def step_loss(loss_dicts: List[dict]) -> float:
    """Mean loss of the step, known on every rank (only last stages compute it).

    Per-token dicts (``forward_step_per_token``): the global batch's loss sum over its token
    count; mean dicts: the mean over microbatches and data-parallel replicas."""
    from megatron.core import parallel_state

    local = None
    if parallel_state.is_pipeline_last_stage():
        if loss_dicts and "num_tokens" in loss_dicts[0]:
            local = (sum(d["loss_sum"].item() for d in loss_dicts),
                     sum(int(d["num_tokens"]) for d in loss_dicts))
        else:
            local = sum(d["loss"].item() for d in loss_dicts) / len(loss_dicts)
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, local)
    present = [v for v in values if v is not None]
    if present and isinstance(present[0], tuple):
        # Each DP x CP rank's (sum, count); TP peers repeat theirs, every replica alike, so
        # the ratio of the totals is the global one.
        return sum(v[0] for v in present) / max(1, sum(v[1] for v in present))
    # Every last-stage rank reports its DP replica's mean; TP peers repeat the same value
    # equally often for every replica, so the plain mean over them is the DP mean.
    return sum(present) / len(present)


@dataclass
class PeakReport:
    """What ``measure`` recorded: per-component peaks (worst rank) and rank 0's timeline."""

    device: dict  # {component or "step": peak device bytes above the section's entry}
    host: dict  # the same for pinned host-pool bytes in use
    timeline: list  # [(seconds since the meter opened, live device bytes)], rank 0 only


MODEL_STATE = "model state"


def held_bytes(roots: Iterable[object],
               device: Optional[torch.device] = None) -> Tuple[int, int]:
    """(device bytes, host-tier bytes) of the distinct storages reachable from ``roots``:
    through containers, objects' attributes (a Parameter's ``main_grad`` too), a tensor's
    ``.grad``, bound methods and closures; never through modules, classes or a function's
    globals, so only what the roots hold is counted, however many runs the process made.
    Host-tier storages (``memory.is_host_storage``: pinned pools and buffers) count as host,
    other storages on ``device`` (default: CUDA when available, else CPU) as device."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seen, storages = set(), {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_WALKED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_meta or obj.layout != torch.strided:
                continue
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.device.type == device.type:
                storages[storage.data_ptr()] = storage
            if obj.grad is not None:
                stack.append(obj.grad)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or ()
                         if c.cell_contents is not None)
        elif isinstance(obj, functools.partial):
            stack.extend((obj.func, obj.args, obj.keywords))
        if hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
            stack.append(vars(obj))
        for name in getattr(type(obj), "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                stack.append(getattr(obj, name))
    host = sum(s.nbytes() for s in storages.values() if memory.is_host_storage(s))
    return sum(s.nbytes() for s in storages.values()) - host, host


# Walking these would reach objects the roots do not own (a module's globals, a class's).
_NOT_WALKED = (types.ModuleType, type, str, bytes, int, float, bool, type(None),
               threading.Thread)


def trainer_state_bytes(trainer: "Trainer") -> Tuple[int, int]:
    """``held_bytes`` of what ``trainer`` keeps between steps: its model, DDP, optimizer."""
    return held_bytes([trainer.model, trainer.ddp, trainer.optimizer])


def record_model_state(report: PeakReport, trainer: "Trainer") -> None:
    """Add ``MODEL_STATE`` to ``report``: what ``trainer`` holds between steps (``held_bytes``
    of its model, DDP and optimizer: weights, gradient buffers, the optimizer state on the device,
    param offload's slots; and the host-tier bytes beside them: optimizer state, param
    offload's host tier), worst rank. A collective over the world."""
    device, host = trainer_state_bytes(trainer)
    figures = torch.tensor([device, host], dtype=torch.int64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the worst rank binds
    report.device[MODEL_STATE] = int(figures[0])
    report.host[MODEL_STATE] = int(figures[1])


def gather_buffer_bytes() -> int:
    """Bytes Megatron's persistent gather buffer holds now (``parallel_state``'s global
    memory buffer, every name and dtype: sequence parallelism's all-gathers land there)."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state.get_global_memory_buffer(), "buffer", None) or {}
    return sum(t.numel() * t.element_size() for t in buffer.values())


def measure(trainer: Trainer, steps: int,
            on_step: Optional[Callable[[int, float, float], None]] = None, *,
            timeline: bool = False) -> PeakReport:
    """Train ``steps`` steps under a ``MemoryMeter`` with one section per peak component.

    A forward-only warm-up runs first, outside the meter (see ``Trainer.warm_up``); the
    first step's optimizer-state allocation is inside it, as it is in a real run.

    Peaks are reported for every name in ``peaks.COMPONENTS`` and the attention block
    (``peaks.ATTENTION``; each above the live set when the component begins) plus
    ``"step"``: the whole run of steps above the lowest live set before its peak (the model
    and its gradient buffers, once the warm-up's leftovers are freed;
    ``MemoryMeter.peak_rise_bytes``), so the optimizer state the first step allocates
    counts in every later step's figure, as it does in device memory, and so does
    Megatron's persistent sequence-parallel gather buffer; each the worst rank's
    (collective over the world), for device memory and for the pinned host pool (SCO's
    boundaries, OffloadStreamAdamW's state). The timeline's maximum above
    its lowest point before it, plus the gather buffer, is the ``"step"`` figure.
    ``on_step(step, loss, seconds)`` is called after every step. ``timeline``: also keep
    rank 0's device-memory samples.
    """
    import time

    from megatron_flat.megatron.peaks import (
        ATTENTION,
        COMPONENTS,
        OPTIMIZER,
        attach_peak_sections,
    )
    from megatron_flat.runtime.memory import MemoryMeter

    trainer.warm_up()
    # The warm-up sized Megatron's gather buffer; held from then on, it sits in the floor
    # the step's rise is measured from, so it is added back (device memory the run holds).
    held = gather_buffer_bytes()
    with MemoryMeter(timeline=timeline and dist.get_rank() == 0) as meter:
        sections = attach_peak_sections(trainer.model, meter)
        try:
            for step in range(steps):
                start = time.perf_counter()
                loss = trainer.forward_backward(step)
                with meter.section(OPTIMIZER):
                    trainer.optimizer_step()
                if on_step is not None:
                    on_step(step, loss, time.perf_counter() - start)
        finally:
            sections.remove()
    names = list(COMPONENTS) + [ATTENTION]
    stats = [meter.sections.get(n) for n in names]
    rows = [[0, 0] if st is None else [st.peak_device_bytes, st.peak_host_bytes]
            for st in stats]
    names.append("step")
    rows.append([meter.peak_rise_bytes + held, meter.peak_host_bytes])
    peaks = torch.tensor(rows, dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank binds
    device = dict(zip(names, peaks[:, 0].tolist()))
    host = dict(zip(names, peaks[:, 1].tolist()))
    return PeakReport(device, host, list(meter.timeline))


def measure_peaks(trainer: Trainer, steps: int,
                  on_step: Optional[Callable[[int, float, float], None]] = None) -> dict:
    """``measure(...).device``: ``{component: peak device bytes}`` plus ``"step"``."""
    return measure(trainer, steps, on_step).device
