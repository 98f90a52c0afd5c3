"""One rank of a rehearsal: run a Megatron-LM training script on CPU under the memory meter.

    python -m torch.distributed.run ... -m megatron_flat.rehearse.worker SCRIPT [ARGS...]

``python -m megatron_flat rehearse`` launches this twice (stock and flat); it is not meant to
be run by hand. Per rank it

1. puts SCRIPT's directory first on ``sys.path`` (a Megatron-LM checkout's own ``megatron``
   package then wins, as when the script is run directly) and applies the CPU workarounds
   (``cpu.backend``, ``cpu.training``);
2. runs SCRIPT as ``__main__`` — patched in memory with ``megatron_flat.patch`` when the file
   on disk is not (the checkout is never written);
3. measures under one ``MemoryMeter``: the four peak sections of ``megatron.peaks`` on every
   model chunk the training loop passes to Megatron-Core's forward-backward function, the
   optimizer step (every ``MegatronOptimizer.step``, outermost call), and ``step`` (from the
   forward-backward call to the end of the optimizer step that follows);
4. writes ``rank<R>.json`` into ``$MEGATRON_FLAT_REHEARSAL_OUT``: the peaks, the whole run's
   peak, which flat modules were really in the model, its parameters (names, shapes,
   dtypes), SCO's counters and the CPU workarounds applied. It is written also when the
   script fails (``"ok": false``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

OUT_ENV = "MEGATRON_FLAT_REHEARSAL_OUT"
STEP = "step"


class _Probe:
    """The meter's hooks into the training loop, and what they saw."""

    def __init__(self, meter):
        from megatron_flat.megatron.peaks import Switch

        self.meter = meter
        self.step = Switch(meter, STEP)
        self.models: List[Any] = []
        self._attached = set()
        self._sections = []
        self._optimizer_depth = 0
        self._optimizers_hooked = False

    # -- forward-backward: opens "step", attaches the peak sections to new model chunks --
    def wrap_schedule_getter(self, getter):
        probe = self

        def get_forward_backward_func(*args, **kwargs):
            func = getter(*args, **kwargs)

            def forward_backward(*f_args, **f_kwargs):
                if not f_kwargs.get("forward_only", False):
                    probe.attach(f_kwargs.get("model"))
                    probe.step.on()
                return func(*f_args, **f_kwargs)

            return forward_backward

        return get_forward_backward_func

    def attach(self, model) -> None:
        from megatron_flat.megatron.peaks import attach_peak_sections

        chunks = model if isinstance(model, (list, tuple)) else [model]
        for chunk in chunks:
            if chunk is None or id(chunk) in self._attached:
                continue
            self._attached.add(id(chunk))
            self.models.append(chunk)
            self._sections.append(attach_peak_sections(chunk, self.meter))
        self.hook_optimizers()

    # -- optimizer: every MegatronOptimizer subclass's own step, outermost call only --
    def hook_optimizers(self) -> None:
        if self._optimizers_hooked:
            return
        self._optimizers_hooked = True
        from megatron.core.optimizer.optimizer import MegatronOptimizer

        seen, todo = set(), [MegatronOptimizer]
        while todo:
            cls = todo.pop()
            if cls in seen:
                continue
            seen.add(cls)
            todo.extend(cls.__subclasses__())
            if "step" in cls.__dict__:
                cls.step = self._wrap_step(cls.__dict__["step"])

    def _wrap_step(self, step):
        import functools

        from megatron_flat.megatron.peaks import OPTIMIZER

        probe = self

        @functools.wraps(step)
        def wrapped(optimizer, *args, **kwargs):
            if probe._optimizer_depth:
                return step(optimizer, *args, **kwargs)
            probe._optimizer_depth += 1
            try:
                with probe.meter.section(OPTIMIZER):
                    return step(optimizer, *args, **kwargs)
            finally:
                probe._optimizer_depth -= 1
                probe.step.off()

        return wrapped

    def close(self) -> None:
        self.step.off()
        for sections in self._sections:
            sections.remove()


def _flat_modules(models) -> Dict[str, int]:
    """What megatron-flat really put into the model chunks (counted by class), and the core
    attentions the CPU backend built for context parallelism."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.attention_tiles import TiledColumnParallelLinear
    from megatron_flat.cpu.context_attention import ContextParallelCoreAttention
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.vocab import ring_dtp_output

    counts = {"FlatMoELayer": 0, "MoELayer": 0, "RingDTPOutputLoss": 0,
              "ContextParallelCoreAttention": 0, "tiled_layers": 0,
              "attention_tiles_used": 0, "layers": 0, "attention_replays": 0,
              "attention_stock_reruns": 0, "replay_capable_attentions": 0,
              "offloaded_layers": 0}
    offloads = {}  # param offload: one per DDP-wrapped model chunk
    for model in models:
        for module in model.modules():
            counts["FlatMoELayer"] += isinstance(module, FlatMoELayer)
            offload = getattr(module, "param_offload", None)
            if isinstance(module, FlatMoELayer) and offload is not None:
                counts["offloaded_layers"] += 1
                offloads[id(offload)] = offload
            counts["MoELayer"] += isinstance(module, MoELayer)
            if type(module).__name__ == "TransformerLayer":
                counts["layers"] += 1
                # Layers whose attention has tiled projections (MLA: several a layer).
                counts["tiled_layers"] += any(
                    isinstance(m, TiledColumnParallelLinear) for m in module.modules())
            # The most tiles any tiled projection's call used (1 at a shape whose sequence
            # fits one tile).
            if isinstance(module, TiledColumnParallelLinear):
                counts["attention_tiles_used"] = max(counts["attention_tiles_used"],
                                                     module.most_tiles)
            # Attention replay: core attentions that can replay, and the re-runs served.
            if hasattr(type(module), "replay") and hasattr(module, "layer_number"):
                counts["replay_capable_attentions"] += 1
                store = module.replay
                counts["attention_replays"] += store.replays if store is not None else 0
                counts["attention_stock_reruns"] += \
                    store.stock_reruns if store is not None else 0
            # The CPU backend's stand-in for transformer-engine's CP attention (both runs).
            counts["ContextParallelCoreAttention"] += isinstance(
                module, ContextParallelCoreAttention) and module.cp_size > 1
        # Ring-DTP's module hangs off the GPTModel, outside its registered submodules.
        counts["RingDTPOutputLoss"] += ring_dtp_output(model) is not None
    for offload in offloads.values():
        for key, value in (("host_bytes", offload.plan.host_bytes),
                           ("device_bytes", offload.plan.device_bytes),
                           ("fetches", offload.stats.fetches),
                           ("demand_fetches", offload.stats.demand_fetches),
                           ("drains", offload.stats.drains)):
            counts[f"param_offload_{key}"] = counts.get(f"param_offload_{key}", 0) + value
    return counts


def _parameters(models) -> List[list]:
    """This rank's parameters, ``[chunk, name, shape, dtype]`` in registration order: what a
    flat model must share with the stock one built from the same line."""
    found = []
    for index, model in enumerate(models):
        for name, param in model.named_parameters():
            found.append([index, name, list(param.shape), str(param.dtype).replace("torch.", "")])
    return found


def _offload_optimizers() -> int:
    import gc

    from megatron_flat.optim.offload_adamw import OffloadStreamAdamW

    return sum(1 for obj in gc.get_objects() if isinstance(obj, OffloadStreamAdamW))


def script_source(script: Path) -> bytes:
    """SCRIPT's bytes, patched in memory when the file is not patched (and can be)."""
    from megatron_flat import patch

    data = script.read_bytes()
    if script.name != patch.TARGET:
        return data
    state = patch.inspect_state(data, script.name)
    if state.patched or state.problem is not None:
        return data
    return patch.patch(data, script.name).data


def run(script: Path, argv: List[str], out: Optional[Path]) -> int:
    script = script.resolve()
    sys.argv = [str(script)] + list(argv)
    sys.path.insert(0, str(script.parent))

    from megatron_flat.cpu import training as cpu_training

    cpu_training.shim_python()
    from megatron_flat.cpu import backend as cpu

    cpu.enable_cpu_backend()
    cpu_training.enable_cpu_training()
    from megatron_flat.rehearse import resume as cpu_resume

    if not cpu.cuda_present():
        cpu.apply_workarounds([cpu_resume.WORKAROUND])
    cpu_resume.record_checkpoints()

    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    from megatron_flat.runtime import patching
    from megatron_flat.runtime.memory import MemoryMeter

    record: Dict[str, Any] = {"ok": False, "script": str(script)}
    code = 1
    meter = MemoryMeter("cpu")
    with meter:
        probe = _Probe(meter)
        for owner in (pipeline_parallel, schedules):  # bound in both; training imports either
            patching.apply(patching.Patch(
                patching.path_of(owner), "get_forward_backward_func",
                probe.wrap_schedule_getter, expects="a function",
                why="the rehearsal measures each step's peaks"))
        namespace = {"__name__": "__main__", "__file__": str(script),
                     "__builtins__": __builtins__}
        try:
            exec(compile(script_source(script), str(script), "exec"), namespace)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            record["error"] = traceback.format_exc(limit=-3)
        finally:
            probe.close()
    record["ok"] = code == 0
    record["exit"] = code
    record["sections"] = {name: [s.peak_device_bytes, s.peak_host_bytes, s.entries]
                          for name, s in meter.sections.items()}
    record["run_peak"] = [meter.peak_device_bytes, meter.peak_host_bytes]
    record["patches"] = cpu.applied_workarounds()
    record["checkpoints"] = cpu_resume.events()
    record.update(_what_ran(probe.models))
    if out is not None:
        rank = int(os.environ.get("RANK", "0"))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    return code


def _what_ran(models) -> Dict[str, Any]:
    from megatron_flat.megatron import sco
    from megatron_flat.megatron.state import installed

    flat = installed()
    found: Dict[str, Any] = {"flat": None if flat is None else flat.to_dict(),
                             "modules": _flat_modules(models),
                             "parameters": _parameters(models),
                             "offload_optimizers": _offload_optimizers()}
    active = sco.enabled()
    if active is not None:
        stats = active.stats
        found["sco"] = {k: getattr(stats, k) for k in
                        ("checkpoints", "boundaries_offloaded", "boundaries_kept",
                         "reloads_on_demand", "prefetch_hits", "peak_host_bytes")}
    return found


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print("usage: python -m megatron_flat.rehearse.worker SCRIPT [ARGS...]",
              file=sys.stderr)
        return 2
    out = os.environ.get(OUT_ENV)
    if out:
        _stack_on_signal(Path(out))
    return run(Path(argv[0]), argv[1:], Path(out) if out else None)


_STACK_FILE = []  # kept open for faulthandler for the life of the process


def _stack_on_signal(out: Path) -> None:
    """The supervisor (``rehearse.supervise``) asks for this rank's Python stack with
    ``DUMP_SIGNAL`` before it ends a run that stalled or ran out of time; a crash (SIGSEGV,
    SIGABRT) prints its stack to the run's log."""
    import faulthandler

    from megatron_flat.rehearse.supervise import DUMP_SIGNAL

    out.mkdir(parents=True, exist_ok=True)
    sink = open(out / f"stack-rank{os.environ.get('RANK', '0')}.txt", "w")
    _STACK_FILE.append(sink)
    faulthandler.register(DUMP_SIGNAL, file=sink, all_threads=True)
    faulthandler.enable()


if __name__ == "__main__":
    sys.exit(main())
