"""Rehearse a Megatron-LM launch line on CPU: stock and flat, losses side by side, peaks.

    python -m megatron_flat rehearse [--nproc-per-node N] [--iters N] -- pretrain_gpt.py ARGS...

Runs the user's own training script (Megatron-LM's ``pretrain_gpt.py``, patched in memory when
the checkout is not) twice with ``torch.distributed.run`` on this machine's CPU, gloo as the
backend, at the tiny shape ARGS give:

* **stock**: ARGS with every ``--flat-*`` flag and a megatron-flat ``--spec`` removed: the model
  Megatron builds from the line without megatron-flat (its own spec for the line).
* **flat**: ARGS as given.

Before the runs, the checkout's own parser is asked what the line sets
(``rehearse.probe``) and ``megatron_flat.rehearse.line`` plans the line's CPU form, announced in
one block, one line per change (asked -> runs instead: why): transformer-engine modules and a
transformer-engine layer spec -> the local ones, fused kernels -> their unfused forms, the
grouped-GEMM capability check -> answered on CPU; GPU features that do not change the math
(CUDA graphs, userbuffer overlap, ...) are dropped; settings that do (fp8/fp4 recipes) are
refused before anything runs. ``--strict`` refuses any change instead.

Both runs also get the same overrides, printed before they start: ``--train-iters``
(``--iters``), ``--log-interval 1``, ``--distributed-backend gloo``, and under context
parallelism ``--attention-dropout 0`` (the CPU backend's CP core attention has no dropout;
Megatron-LM's default is 0.1); ``--save`` / ``--load`` and logging destinations are dropped, so
a production line can be rehearsed as it is (given tiny shapes and ``--mock-data``); SCO's host
budget is capped (``--host-budget-gib``), because the CPU allocates it as plain memory.

Before the losses are compared, the two models must be the same: per rank, the same parameter
names, shapes and dtypes (a flat module keeps the parameters of the module it replaces). Both
parameter counts are printed; any difference fails the rehearsal whatever the losses say.

Prints each iteration's ``lm loss`` from both runs, the per-component peak table (the worst
rank's, measured by the memory meter: ``megatron_flat.rehearse.worker``), which flat modules
were really built, and a verdict as the last line:

    rehearsal: flat losses equal stock over N iterations (K CPU substitutions)

With ``--resume-at I`` checkpoints also cross (torch_dist, into the work directory): the
stock and flat runs save at iteration I, a flat run resumes from stock's checkpoint and a stock
run from flat's, all to at least I+3 iterations; every resumed loss must equal stock's (I+2
aside: Megatron-LM's first log line after a start keeps its running loss, so the next averages
two iterations) and, per rank, the optimizer state loaded must be bitwise the state saved
(``rehearse.resume`` records both). The verdict then ends
``; checkpoints cross both ways at iteration I``.

Exit status: 0 equal; 1 the losses differ beyond ``--rtol`` (fp32 reordering, 1e-5: the log
prints 7 significant digits; a quarter of the unit roundoff for a ``--bf16``/``--fp16``
line), a run failed, printed no losses, or a requested technique was not in the model; 2 bad
arguments or a refused line (nothing launched).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_flat.rehearse import line as cpu_line, preflight, supervise
from megatron_flat.config import FlatConfig, add_flat_args

WORKER = "megatron_flat.rehearse.worker"
PROBE = "megatron_flat.rehearse.probe"
LOSS_LINE = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|.*?\blm loss:\s*([-+0-9.eEinfa]+)")
# Flags dropped from both runs (each takes one value): outputs a rehearsal must not write.
DROPPED = ("--save", "--load", "--save-interval", "--ckpt-step", "--tensorboard-dir",
           "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity")
# Flags that keep a checkpoint from carrying the optimizer (or its RNG) across: refused with
# --resume-at, whose point is that they cross.
NOT_CROSSING = ("--no-save-optim", "--no-load-optim", "--no-save-rng", "--no-load-rng",
                "--finetune")
# Megatron-LM's first log line after a (re)start does not reset its running loss sum, so the
# next line averages two iterations: a resumed run's iteration I+2 is not comparable.
RESUME_SKIPPED = 2
PEAK_ROWS = ("expert dispatch", "vocabulary projection + loss", "checkpoint boundaries",
             "optimizer step", "step")
EXIT_EQUAL, EXIT_DIFFER, EXIT_USAGE = 0, 1, 2
# Loss tolerance: fp32 reordering (the log prints 7 significant digits); a half-precision line
# reorders half-precision sums (the flat dispatch combines expert outputs in another order),
# which a few optimizer steps carry into the loss: a quarter of the type's unit roundoff.
FP32_RTOL = 1e-5
HALF_RTOL = {"bf16": 2.0**-8 / 4, "fp16": 2.0**-11 / 4}


def default_rtol(args: Sequence[str]) -> Tuple[float, str]:
    """The loss tolerance for ``args`` and what it is."""
    for dtype in ("bf16", "fp16"):
        if f"--{dtype}" in args:
            return HALF_RTOL[dtype], f"a quarter of {dtype}'s unit roundoff ({dtype} line)"
    return FP32_RTOL, "fp32 reordering"


class RehearsalError(Exception):
    """Bad arguments: reported before anything is launched."""


# ---------------------------------------------------------------------------- launch lines
def _flat_arities() -> Dict[str, int]:
    """``--flat-*`` option string -> number of values it takes."""
    parser = add_flat_args(argparse.ArgumentParser(add_help=False))
    arities = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith(("--flat-", "--no-flat-")):
                arities[option] = 0 if action.nargs == 0 else 1
    return arities


# The line's tokens: one reading of options and their values, shared with the CPU plan.
strip_options = cpu_line.strip_options


def _last_value(args: Sequence[str], name: str) -> Optional[str]:
    """The value the last ``name`` in ``args`` gives (argparse's rule), or None if absent."""
    values = cpu_line.option_values(args, name, 1)
    return values[0] if values else None


def _context_parallel(args: Sequence[str]) -> int:
    try:
        return int(_last_value(args, "--context-parallel-size") or 1)
    except ValueError:
        return 1


MEGATRON_DROPOUT = 0.1  # Megatron-LM's --attention-dropout and --hidden-dropout default


def _dropout(args: Sequence[str], name: str) -> float:
    """The dropout probability ``args`` set with ``name`` (Megatron-LM's default if unset)."""
    value = _last_value(args, name)
    try:
        return MEGATRON_DROPOUT if value is None else float(value)
    except ValueError:
        return MEGATRON_DROPOUT


def flat_config_of(args: Sequence[str]) -> FlatConfig:
    """The FlatConfig ``args`` ask for (other flags ignored); raises RehearsalError if bad."""
    parser = add_flat_args(argparse.ArgumentParser(add_help=False))
    try:
        known, _ = parser.parse_known_args(list(args))
        return FlatConfig.from_args(known)
    except (SystemExit, ValueError) as exc:
        raise RehearsalError(f"the --flat-* flags do not parse: {exc}") from None


@dataclass
class Lines:
    stock: List[str]
    flat: List[str]
    notes: List[str] = field(default_factory=list)
    flat_config: FlatConfig = field(default_factory=FlatConfig)


def resume_iters(iters: int, resume_at: int) -> int:
    """Iterations per run for ``--resume-at resume_at``: at least ``resume_at + 3`` (the
    resumed runs' I+2 is skipped, see RESUME_SKIPPED; I+3 is the first loss after two
    updates with the loaded optimizer state)."""
    return max(iters, resume_at + 3)


@dataclass
class Crossing:
    """The four runs of ``--resume-at``, as ``(name, args)``: the straight stock and flat
    runs, which also save at iteration ``at`` under ``root/<kind>``, then each line resumed
    from the other kind's checkpoint (``A-to-B``: B's line loads A's)."""

    at: int
    root: Path

    def save_args(self, kind: str) -> List[str]:
        return ["--save", str(self.root / kind), "--save-interval", str(self.at)]

    def load_args(self, kind: str) -> List[str]:
        return ["--load", str(self.root / kind), "--ckpt-step", str(self.at)]

    def runs(self, lines: Lines) -> List[Tuple[str, List[str]]]:
        return [("stock", lines.stock + self.save_args("stock")),
                ("flat", lines.flat + self.save_args("flat")),
                ("stock-to-flat", lines.flat + self.load_args("stock")),
                ("flat-to-stock", lines.stock + self.load_args("flat"))]


def check_resumable(args: Sequence[str], options: Optional[Dict[str, int]]) -> None:
    """Refuse a ``--resume-at`` line whose checkpoints would not carry the optimizer, or a
    checkout whose parser has no ``--ckpt-step`` (``options``: the probe's, if any)."""
    blocking = [a for a in args if a in NOT_CROSSING]
    if blocking:
        raise RehearsalError(f"--resume-at checks that checkpoints carry the optimizer and "
                             f"RNG state across; the line has {' '.join(blocking)}")
    if options is not None and "--ckpt-step" not in options:
        raise RehearsalError("--resume-at loads the checkpoint of iteration I with "
                             "--ckpt-step, which this checkout's parser does not have")


def launch_lines(args: Sequence[str], *, iters: int, host_budget_gib: float,
                 resume: bool = False) -> Lines:
    """The stock and flat argument lists for one rehearsal of ``args`` (``resume``: for
    ``--resume-at``, whose runs also load checkpoints)."""
    notes = []
    common, dropped = strip_options(args, {name: 1 for name in DROPPED})
    if dropped:
        notes.append("dropped (a rehearsal writes nothing): " + " ".join(dropped))
    overrides = ["--log-interval", "1", "--distributed-backend", "gloo"]
    if iters > 0:
        overrides = ["--train-iters", str(iters)] + overrides
    notes.append("added to both runs: " + " ".join(overrides))
    if _context_parallel(common) > 1 and _dropout(common, "--attention-dropout") != 0.0:
        # The CPU backend's CP core attention (ContextParallelCoreAttention) has no attention
        # dropout; transformer-engine's, which a GPU run uses, has. Both runs lose it alike.
        overrides += ["--attention-dropout", "0"]
        notes.append("added to both runs: --attention-dropout 0 (the CPU backend's context-"
                     "parallel attention has no dropout; transformer-engine's on a GPU has)")
    if resume and _dropout(common, "--hidden-dropout") != 0.0:
        # Hidden dropout draws from the device's default generator, which a checkpoint
        # restores. On CPU that generator is the CPU one, and Megatron-LM's data loader draws
        # its seed from it after the load, so a resumed run's masks would shift; a GPU's
        # generator is separate. (Attention dropout forks the RNG tracker, restored exactly.)
        overrides += ["--hidden-dropout", "0"]
        notes.append("added to every run: --hidden-dropout 0 (--resume-at: on CPU the device "
                     "RNG is the CPU generator, which the data loader draws from after a "
                     "load; a GPU's is separate)")
    common = list(common) + overrides
    flat = flat_config_of(common)
    flat_args = list(common)
    if flat.sco and flat.sco_host_budget_gib > host_budget_gib:
        flat_args += ["--flat-sco-host-budget-gib", f"{host_budget_gib:g}"]
        notes.append(f"SCO host budget capped for the CPU: {flat.sco_host_budget_gib:g} GiB -> "
                     f"{host_budget_gib:g} GiB per rank (--host-budget-gib)")
        flat = flat_config_of(flat_args)
    stock, removed = strip_options(common, _flat_arities())
    stock, spec = _without_flat_spec(stock)
    removed += spec
    notes.append("stock run: without " + (" ".join(removed) if removed else "any --flat-* flag")
                 + (" (Megatron builds its own spec for the line)" if spec else ""))
    return Lines(stock, flat_args, notes, flat)


FLAT_SPEC_MODULE = "megatron_flat.megatron.spec"


def _without_flat_spec(args: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``args`` without a ``--spec`` naming a megatron-flat spec, and what was removed (a
    user's own ``--spec`` stays: it is part of the model)."""
    values = cpu_line.option_values(args, "--spec", 2)
    if not values or values[0] != FLAT_SPEC_MODULE:
        return list(args), []
    kept, removed = strip_options(args, {"--spec": 2})
    return kept, removed


# ---------------------------------------------------------------------------- one run
@dataclass
class Run:
    name: str
    exit: int
    log: Path
    losses: Dict[int, float]
    ranks: List[dict]
    seconds: float
    cause: Optional[str] = None  # why the supervisor ended it (stalled, out of time)
    stacks: Dict[int, str] = field(default_factory=dict)  # rank -> stack dumped then

    @property
    def ok(self) -> bool:
        return self.exit == 0 and bool(self.ranks) and all(r.get("ok") for r in self.ranks)

    def peak(self, row: str) -> Optional[int]:
        values = [r["sections"][row][0] for r in self.ranks if row in r.get("sections", {})]
        return max(values) if values else None

    def run_peak(self) -> Optional[int]:
        values = [r["run_peak"][0] for r in self.ranks if "run_peak" in r]
        return max(values) if values else None


def parse_losses(text: str) -> Dict[int, float]:
    """``{iteration: lm loss}`` from Megatron-LM's training log (first line per iteration)."""
    losses: Dict[int, float] = {}
    for match in LOSS_LINE.finditer(text):
        iteration = int(match.group(1))
        try:
            losses.setdefault(iteration, float(match.group(2)))
        except ValueError:
            continue
    return losses


def _environment(out: Path, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})  # the CPU line's (e.g. TEGroupedMLP for TE's grouped experts)
    env["CUDA_VISIBLE_DEVICES"] = ""  # a rehearsal is a CPU run, also on a GPU machine
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["MEGATRON_FLAT_REHEARSAL_OUT"] = str(out)
    # Megatron-LM's Makefiles and helpers call ``python3``: make it this interpreter's.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def launch(name: str, script: Path, args: Sequence[str], *, nproc: int, work: Path,
           timeout: float, stall_seconds: float = supervise.STALL_S,
           env: Optional[Dict[str, str]] = None) -> Run:
    """One run under ``rehearse.supervise``: it ends by itself, or is ended (stalled or out of
    time) with its ranks' stacks and the cause in the returned :class:`Run`."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = work / f"{name}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", WORKER, str(script), *args]
    start = time.monotonic()
    log.write_text("$ " + " ".join(command) + "\n")
    outcome = supervise.supervise(command, log=log, env=_environment(out, env), timeout=timeout,
                                  stall_seconds=stall_seconds, stack_dir=out)
    if outcome.cause is not None:
        with log.open("a") as sink:
            sink.write(f"\nrehearsal: the run {outcome.cause}; ended at: "
                       f"{supervise.where(outcome.stacks)}\n")
            for rank, stack in sorted(outcome.stacks.items()):
                sink.write(f"\n-- rank {rank}'s Python stack --\n{stack}\n")
    text = log.read_text(errors="replace")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return Run(name, outcome.code, log, parse_losses(text), ranks, time.monotonic() - start,
               outcome.cause, outcome.stacks)


EXIT_NOT_RUN = -1  # a Run that was not started (the stock run it needed did not complete)
PROBE_TIMEOUT_S = 300.0  # the parser probe, when --timeout is not given


def _train_iters(args: Sequence[str]) -> int:
    """The run's --train-iters (what the time limit is derived from; 100 when not given)."""
    values = cpu_line.option_values(args, "--train-iters", 1)
    try:
        return int(values[0]) if values else 100
    except ValueError:
        return 100


def probe_line(script: Path, args: Sequence[str], work: Path,
               timeout: float) -> Tuple[Optional[dict], str]:
    """The checkout parser's view of ``args`` (``rehearse.probe``), or (None, why)."""
    command = [sys.executable, "-m", PROBE, str(script), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=_environment(work / "probe"), cwd=str(script.parent))
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g} s"
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):]), ""
    tail = [l for l in done.stderr.strip().splitlines() if l.strip()]
    return None, tail[-1] if tail else f"exit {done.returncode}"


def cpu_line_of(script: Path, args: Sequence[str], *, work: Path, strict: bool,
                timeout: float, resume: bool = False) -> Tuple[cpu_line.CpuLine, List[str]]:
    """The line to rehearse on CPU (substitutions applied) and notes; raises RehearsalError
    for a line refused (a setting that changes the math, any change under ``strict``, a
    package the runs will import that this environment lacks (``preflight``), or with
    ``resume`` a line or checkout that cannot cross checkpoints)."""
    found, why = probe_line(script, args, work, timeout)
    if resume:
        check_resumable(args, None if found is None else found["options"])
    if found is None:
        if strict:
            raise RehearsalError(f"--strict: the checkout's parser could not be asked what "
                                 f"the line sets ({why})")
        return cpu_line.CpuLine(list(args)), [
            f"the checkout's parser could not be asked what the line sets ({why}): it runs "
            "as written, without CPU substitutions"]
    absent = preflight.missing(found["values"], checkpoints=resume)
    if absent:
        raise RehearsalError(preflight.refusal(absent))
    line = cpu_line.plan(args, found["values"], found["options"])
    if line.refused:
        raise RehearsalError("the line has settings a CPU rehearsal cannot run without "
                             "changing the math:\n  - " + "\n  - ".join(line.refused))
    if strict:
        refusal = cpu_line.strict_refusal(line)
        if refusal:
            raise RehearsalError(refusal)
    return line, []


# ---------------------------------------------------------------------------- report
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*"
                        r"(?:Error|Exception|Interrupt)\b.*)$")


def first_error(text: str) -> Optional[str]:
    """The first exception line in a run's log (torchrun's own ChildFailedError aside) and the
    frame that raised it; for a rank killed by a signal, torchrun's root cause.

    A rank killed by a signal other than SIGTERM (SIGKILL: the OOM killer or a user; SIGSEGV)
    is named first even when a peer's error is logged before it: the peers' errors (a closed
    gloo connection) follow from it, and which is logged first depends on the machine's load.
    SIGTERM is what torchrun sends the other ranks when it ends a run."""
    killed = _killed_rank(text)
    if killed is not None:
        return killed
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _EXCEPTION.match(line.strip())
        if match and "ChildFailedError" not in line:
            error = match.group(1)
            if ":" not in error:  # a bare "AssertionError": name the failing line
                source = [s.strip() for s in lines[max(0, i - 3):i]
                          if s.strip() and set(s.strip()) - set("^~ ")]
                if source:
                    error += f" ({source[-1]})"
            for frame in reversed(lines[max(0, i - 8):i]):  # the frame that raised it
                where = _FRAME.search(frame)
                if where:
                    short = "/".join(Path(where.group(1)).parts[-2:])
                    return f"{error}, raised in {where.group(3)} ({short}:{where.group(2)})"
            return error
    # No Python error (a rank killed by a signal): torchrun's root cause, with its rank.
    at = text.rfind("Root Cause")
    root = text[at:] if at >= 0 else text
    rank = _RANK_LINE.search(root)
    for pattern in (_SIGNAL_LINE, _EXITCODE_LINE):
        match = pattern.search(root)
        if match:
            return (f"rank {rank.group(1)}: " if rank else "") + match.group(0).strip()
    return None


def _killed_rank(text: str) -> Optional[str]:
    """"rank R: Signal N (NAME) received by PID P" for the first rank torchrun reports killed
    by a signal other than SIGTERM (its Failures and Root Cause blocks), else None."""
    at = text.find("Failures:")
    section = text[at:] if at >= 0 else text[max(text.rfind("Root Cause"), 0):]
    marks = list(_RANK_LINE.finditer(section))
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(section)
        signal = _SIGNAL_LINE.search(section, mark.end(), end)
        if signal and "(SIGTERM)" not in signal.group(0):
            return f"rank {mark.group(1)}: {signal.group(0).strip()}"
    return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_RANK_LINE = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_SIGNAL_LINE = re.compile(r"Signal \d+ \(\w+\) received by PID \d+")
_EXITCODE_LINE = re.compile(r"exitcode\s*:\s*-?\d+[^\n]*")


def _bytes(n: Optional[int]) -> str:
    from megatron_flat.runtime.memory import format_bytes

    return "-" if n is None else format_bytes(n)


def _ratio(flat: Optional[int], stock: Optional[int]) -> str:
    if flat is None or stock is None or stock <= 0:
        return "-"
    return f"{flat / stock:.2f}"


def loss_table(stock: Run, flat: Run, resumed: Sequence[Run] = (),
               skipped: Optional[int] = None) -> List[str]:
    """Each iteration's lm loss per run and the largest relative difference to stock; the
    resumed runs' iteration ``skipped`` is marked ``*`` and left out of the difference."""
    runs = [stock, flat, *resumed]
    rows = [" | ".join(["iteration"] + [f"{r.name} lm loss" for r in runs]
                       + ["relative difference"])]
    for it in sorted(set().union(*(r.losses for r in runs))):
        values = [r.losses.get(it) for r in runs]
        marked = [it == skipped and i >= 2 and v is not None for i, v in enumerate(values)]
        a = values[0]
        diffs = [_relative(a, b) for b, m in zip(values[1:], marked[1:])
                 if a is not None and b is not None and not m]
        cells = [f"{it:9d}"] + [f"{_fmt(v) + ('*' if m else ''):>{len(r.name) + 8}s}"
                                for r, v, m in zip(runs, values, marked)]
        rows.append(" | ".join(cells + [f"{max(diffs):.1e}" if diffs else "-"]))
    if skipped is not None and resumed:
        rows.append(f"* the mean of iterations {skipped - 1} and {skipped}, as Megatron-LM logs "
                    "the second line after a start: not compared")
    return rows


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.6E}"


def _relative(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _above(flat: Optional[int], stock: Optional[int]) -> bool:
    return flat is not None and stock is not None and flat > stock


def peak_table(stock: Run, flat: Run) -> List[str]:
    rows = ["peak (worst rank, device bytes) | stock | flat | flat/stock"]
    for row in PEAK_ROWS:
        a, b = stock.peak(row), flat.peak(row)
        if a is None and b is None:
            continue
        rows.append(f"{row} | {_bytes(a)} | {_bytes(b)} | {_ratio(b, a)}")
    a, b = stock.run_peak(), flat.run_peak()
    rows.append(f"whole run | {_bytes(a)} | {_bytes(b)} | {_ratio(b, a)}")
    return rows


def _modules(run: Run) -> Dict[str, int]:
    """Flat and Megatron module counts of a run (the largest any rank reported)."""
    modules: Dict[str, int] = {}
    for r in run.ranks:
        for k, v in r.get("modules", {}).items():
            modules[k] = max(modules.get(k, 0), v)
    return modules


def what_ran(flat: Run) -> List[str]:
    """One line per technique the flat run asked for: what was really in the model."""
    if not flat.ranks:
        return []
    config = flat.ranks[0].get("flat") or {}
    modules = _modules(flat)
    lines = []
    if config.get("dispatch", "off") != "off":
        lines.append(f"PipelinedLLEP ({config['dispatch']}): FlatMoELayer in "
                     f"{modules.get('FlatMoELayer', 0)} of {modules.get('MoELayer', 0)} MoE layers")
    if config.get("vocab"):
        lines.append(f"Ring-DTP: {'on' if modules.get('RingDTPOutputLoss') else 'not built'}")
    if config.get("sco"):
        sco = [r.get("sco") for r in flat.ranks if r.get("sco")]
        offloaded = max((s["boundaries_offloaded"] for s in sco), default=0)
        checkpoints = max((s["checkpoints"] for s in sco), default=0)
        lines.append(f"SCO: {offloaded} of {checkpoints} boundaries offloaded (worst rank)"
                     if sco else "SCO: not enabled in the run")
    if config.get("optimizer_offload"):
        count = max(r.get("offload_optimizers", 0) for r in flat.ranks)
        lines.append(f"OffloadStreamAdamW: {count} inner optimizer(s)")
    if config.get("param_offload"):
        mib = 1 << 20
        lines.append(
            f"param offload: routed experts of {modules.get('offloaded_layers', 0)} of "
            f"{modules.get('MoELayer', 0)} MoE layers in the host tier "
            f"({modules.get('param_offload_host_bytes', 0) / mib:.2f} MiB), device slots "
            f"{modules.get('param_offload_device_bytes', 0) / mib:.2f} MiB; "
            f"{modules.get('param_offload_fetches', 0)} fetches "
            f"({modules.get('param_offload_demand_fetches', 0)} on demand), "
            f"{modules.get('param_offload_drains', 0)} drains (worst rank)")
    if config.get("attn_tiles"):
        used = modules.get("attention_tiles_used", 0)
        note = " (the tile holds the whole rehearsal sequence)" if used == 1 else ""
        lines.append(f"attention tiles: tiled QKV and output projections in "
                     f"{modules.get('tiled_layers', 0)} of "
                     f"{modules.get('layers', 0)} layers, up to {used} tile(s) per "
                     f"projection{note}")
    if config.get("attn_replay"):
        replays = modules.get("attention_replays", 0)
        capable = modules.get("replay_capable_attentions", 0)
        stock = modules.get("attention_stock_reruns", 0)
        note = (f", {stock} recomputed as stock (nothing kept for them: see the run's "
                f"warnings)" if stock else "")
        lines.append(f"attention replay: {replays} re-run(s) served without the kernel{note}"
                     if replays else
                     f"attention replay: fell back to the stock recompute ({capable} core "
                     "attention(s) can replay; Megatron's local DotProductAttention and "
                     "transformer-engine's cannot yet: see the run's warning)")
    return lines


def cp_attention_note(stock: Run, flat: Run) -> Optional[str]:
    """Where the CPU backend stood in for transformer-engine's context-parallel attention (in
    both runs alike, so the comparison stays stock vs flat), one line saying so."""
    counts = [_modules(run).get("ContextParallelCoreAttention", 0) for run in (stock, flat)]
    if not any(counts):
        return None
    return (f"core attention under context parallelism: the CPU backend's "
            f"ContextParallelCoreAttention (K/V all-gather, exact; transformer-engine's CP "
            f"attention on a GPU) in {counts[0]} stock and {counts[1]} flat layer(s) per rank")


def missing_techniques(flat: Run) -> List[str]:
    """Techniques the flat line turned on that the flat run's model does not have."""
    if not flat.ranks:
        return []
    config = flat.ranks[0].get("flat") or {}
    modules = _modules(flat)
    missing = []
    if (config.get("dispatch", "off") != "off" and modules.get("MoELayer", 0)
            and not modules.get("FlatMoELayer", 0)):
        missing.append(f"--flat-dispatch {config['dispatch']} is on but no MoE layer is a "
                       "FlatMoELayer (a --spec that builds its own MoE layer?)")
    if (config.get("attn_tiles") and modules.get("layers", 0)
            and not modules.get("tiled_layers", 0)):
        missing.append(f"--flat-attn-tiles {config['attn_tiles']} is on but no layer has the "
                       "tiled projections (a --spec that builds its own attention?)")
    return missing


def parameter_count(run: Run) -> Optional[int]:
    """The parameters of the run's model, summed over its ranks (a replicated parameter counts
    once per rank that holds it), or None when no rank reported its model."""
    if not run.ranks or not all("parameters" in r for r in run.ranks):
        return None
    return sum(math.prod(shape) for r in run.ranks for _, _, shape, _ in r["parameters"])


def parameter_line(stock: Run, flat: Run) -> Optional[str]:
    """``parameters: stock N, flat M (over R ranks)`` for the report, or None."""
    counts = [parameter_count(run) for run in (stock, flat)]
    if counts == [None, None]:
        return None
    shown = ["-" if c is None else f"{c:,}" for c in counts]
    return f"parameters: stock {shown[0]}, flat {shown[1]} (over {len(stock.ranks)} rank(s))"


def parameter_difference(stock: Run, flat: Run) -> Optional[str]:
    """Where the flat model's parameters first differ from stock's (rank, name, shape), or None
    when every rank's are the same (or a run reported none: its failure is reported)."""
    if parameter_count(stock) is None or parameter_count(flat) is None:
        return None
    for rank, (a, b) in enumerate(zip(stock.ranks, flat.ranks)):
        ours, theirs = a["parameters"], b["parameters"]
        if ours == theirs:
            continue
        for x, y in zip(ours, theirs):
            if x != y:
                return (f"rank {rank}: stock has {x[1]} {x[2]} {x[3]} where flat has "
                        f"{y[1]} {y[2]} {y[3]}")
        longer, name = (ours, "stock") if len(ours) > len(theirs) else (theirs, "flat")
        extra = longer[min(len(ours), len(theirs))]
        return (f"rank {rank}: {len(ours)} parameters in stock, {len(theirs)} in flat; only "
                f"{name} has {extra[1]} {extra[2]}")
    return None


def stopped_verdict(run: Run) -> str:
    """The verdict for a run the supervisor ended: the cause, where each rank was, the log."""
    return (f"rehearsal: the {run.name} run {run.cause}: {supervise.where(run.stacks)}; "
            f"its log: {run.log}")


def verdict(stock: Run, flat: Run, rtol: float, substitutions: int = 0) -> Tuple[int, str]:
    for run in (stock, flat):
        if run.cause is not None:
            return EXIT_DIFFER, stopped_verdict(run)
        if not run.ok:
            return EXIT_DIFFER, (f"rehearsal: the {run.name} run failed (exit {run.exit}); "
                                 f"its log: {run.log}")
        if not run.losses:
            return EXIT_DIFFER, (f"rehearsal: the {run.name} run printed no 'lm loss' lines; "
                                 f"its log: {run.log}")
    differs = parameter_difference(stock, flat)
    if differs:
        return EXIT_DIFFER, (f"rehearsal: the flat model is not the stock model "
                             f"({parameter_line(stock, flat)}): {differs}")
    if set(stock.losses) != set(flat.losses):
        return EXIT_DIFFER, (f"rehearsal: the runs logged different iterations (stock "
                             f"{sorted(stock.losses)}, flat {sorted(flat.losses)})")
    for it in sorted(stock.losses):
        a, b = stock.losses[it], flat.losses[it]
        rel = _relative(a, b)
        if not rel <= rtol:
            return EXIT_DIFFER, (f"rehearsal: flat loss differs from stock at iteration {it}: "
                                 f"{_fmt(b)} vs {_fmt(a)} (relative {rel:.1e} > rtol {rtol:g})")
    stock_flat = _modules(stock).get("FlatMoELayer", 0)
    if stock_flat:
        return EXIT_DIFFER, (f"rehearsal: the stock run built {stock_flat} FlatMoELayer(s) "
                             "without --flat-* flags: the comparison would not be against stock")
    missing = missing_techniques(flat)
    if missing:
        return EXIT_DIFFER, "rehearsal: " + "; ".join(missing)
    text = f"rehearsal: flat losses equal stock over {len(stock.losses)} iterations"
    if substitutions:
        text += f" ({substitutions} CPU substitution{'s' if substitutions > 1 else ''})"
    return EXIT_EQUAL, text


def _digests(run: Run, op: str, at: int) -> List[Optional[dict]]:
    """Per rank, the optimizer digest ``run`` recorded at its ``op`` of iteration ``at``."""
    found = []
    for rank in run.ranks:
        events = [e for e in rank.get("checkpoints", [])
                  if e.get("op") == op and e.get("iteration") == at]
        found.append(events[-1]["digest"] if events else None)
    return found


def crossing_verdict(straight: Dict[str, Run], resumed: Sequence[Run], at: int,
                     rtol: float) -> Optional[str]:
    """Why the checkpoint crossings at iteration ``at`` failed, or None when both held.

    ``resumed``: the runs named ``A-to-B`` (B's line resumed from A's checkpoint). Each must log
    the iterations after ``at`` and equal stock within ``rtol`` (I+2 aside: RESUME_SKIPPED),
    and on every rank the optimizer state it loaded must be bitwise the state A saved."""
    reference = straight["stock"]
    for run in resumed:
        saver = straight[run.name.split("-to-")[0]]
        if run.cause is not None:
            return stopped_verdict(run)
        if not run.ok:
            return f"rehearsal: the {run.name} run failed (exit {run.exit}); its log: {run.log}"
        want = {it for it in reference.losses if it > at}
        if set(run.losses) != want:
            return (f"rehearsal: the {run.name} run logged iterations {sorted(run.losses)}, "
                    f"not {sorted(want)} (resumed from iteration {at}?); its log: {run.log}")
        for it in sorted(want - {at + RESUME_SKIPPED}):
            a, b = reference.losses[it], run.losses[it]
            rel = _relative(a, b)
            if not rel <= rtol:
                return (f"rehearsal: the {run.name} run's loss differs from stock at iteration "
                        f"{it}: {_fmt(b)} vs {_fmt(a)} (relative {rel:.1e} > rtol {rtol:g})")
        saved, loaded = _digests(saver, "save", at), _digests(run, "load", at)
        if not saved or None in saved or None in loaded or len(saved) != len(loaded):
            return (f"rehearsal: no optimizer state recorded for the {run.name} crossing at "
                    f"iteration {at} (saved on {sum(d is not None for d in saved)}, loaded on "
                    f"{sum(d is not None for d in loaded)} of {len(run.ranks)} ranks)")
        for rank, (a, b) in enumerate(zip(saved, loaded)):
            differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            if differ:
                return (f"rehearsal: the optimizer state did not cross {run.name} at iteration "
                        f"{at}: {', '.join(differ)} differ on rank {rank}")
    return None


# ---------------------------------------------------------------------------- CLI
def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Run a Megatron-LM launch line on CPU twice (stock, then with "
        "its --flat-* flags) and compare losses and memory peaks.",
        epilog="example: python -m megatron_flat rehearse --nproc-per-node 2 -- "
               "$MEGATRON_LM/pretrain_gpt.py --num-layers 2 ... --mock-data --flat-preset paper")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks (processes) per run (default: 1)")
    parser.add_argument("--iters", type=int, default=3,
                        help="training iterations per run: sets --train-iters (0: keep the "
                             "line's own; default: 3)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest relative loss difference accepted as reordering "
                             f"(default: {FP32_RTOL:g} for an fp32 line; a quarter of the "
                             "unit roundoff of --bf16 / --fp16 lines: "
                             f"{HALF_RTOL['bf16']:.1e} / {HALF_RTOL['fp16']:.1e})")
    parser.add_argument("--host-budget-gib", type=float, default=1.0,
                        help="cap on SCO's host budget per rank for the rehearsal (default: 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds each run may take (default: from the line, 5 minutes "
                             "plus a minute per iteration and rank); its ranks' Python "
                             "stacks are reported when it runs out")
    parser.add_argument("--stall-seconds", type=float, default=supervise.STALL_S,
                        help="end a run whose log gains no line while its processes use "
                             "under a tenth of a core for this long (default: "
                             f"{supervise.STALL_S:g}): a rank waiting for a collective a "
                             "peer never reaches, or for a process that died")
    parser.add_argument("--strict", action="store_true",
                        help="refuse a line with GPU-only settings instead of running their "
                             "CPU forms (default: substitute them and say so)")
    parser.add_argument("--resume-at", type=int, default=None, metavar="I",
                        help="also cross checkpoints: the stock and flat runs save at "
                             "iteration I (into the work directory), a flat run resumes from "
                             "stock's and a stock run from flat's; losses and the loaded "
                             "optimizer state must match (runs get at least I+3 iterations)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where logs and per-rank peaks go (default: a temporary "
                             "directory, kept when the rehearsal fails)")
    parser.usage = f"{prog} [options] -- SCRIPT [ARGS...]"
    return parser


def _check_script(script: Path) -> None:
    if not script.is_file():
        raise RehearsalError(f"{script}: no such file")
    from megatron_flat import patch

    if script.name == patch.TARGET:
        state = patch.inspect_state(script.read_bytes(), script.name)
        if state.problem is not None:
            raise RehearsalError(f"{state.problem} (python -m megatron_flat patch --check "
                                 f"{script.parent} says more)")


def _refused(prog: str, exc: Exception, out) -> int:
    """A line refused before any run: the whole message on stderr, the verdict line (its first
    line, and its last where it has more: what to do) last on the report."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    print("rehearsal: refused: " + " ... ".join(lines[:1] + lines[1:][-1:]), file=out)
    return EXIT_USAGE


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m megatron_flat rehearse",
         out=None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:cut])  # everything after "--" is the launch line
    if cut + 1 >= len(argv):
        parser.error("give the launch line after --: -- pretrain_gpt.py ARGS...")
    script, line = Path(argv[cut + 1]), argv[cut + 2:]
    try:
        if opts.nproc_per_node < 1:
            raise RehearsalError("--nproc-per-node must be >= 1")
        if (opts.timeout is not None and opts.timeout <= 0) or opts.stall_seconds <= 0:
            raise RehearsalError("--timeout and --stall-seconds must be > 0")
        if opts.iters < 0 or (opts.rtol or 0) < 0 or opts.host_budget_gib < 0:
            raise RehearsalError("--iters, --rtol and --host-budget-gib must be >= 0")
        if opts.resume_at is not None:
            if opts.resume_at < 1:
                raise RehearsalError("--resume-at must be >= 1 (an iteration to save at)")
            if opts.iters == 0:
                raise RehearsalError("--resume-at needs --iters (the runs' length, at least "
                                     "I+3), not the line's own --train-iters")
        _check_script(script)
        flat_config_of(line)  # bad --flat-* flags: refused before anything runs
    except RehearsalError as exc:
        return _refused(prog, exc, out)

    work = opts.work_dir or Path(tempfile.mkdtemp(prefix="megatron-flat-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    script = script.resolve()
    try:
        resume = opts.resume_at is not None
        on_cpu, probe_notes = cpu_line_of(script, line, work=work, strict=opts.strict,
                                          timeout=opts.timeout or PROBE_TIMEOUT_S,
                                          resume=resume)
        iters = resume_iters(opts.iters, opts.resume_at) if resume else opts.iters
        lines = launch_lines(on_cpu.args, iters=iters, host_budget_gib=opts.host_budget_gib,
                             resume=resume)
    except RehearsalError as exc:
        if opts.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return _refused(prog, exc, out)
    print(f"rehearsing {script} on CPU with {opts.nproc_per_node} rank(s), gloo", file=out)
    print(f"flat: {lines.flat_config.describe()}", file=out)
    if opts.rtol is None:
        opts.rtol, why = default_rtol(lines.flat)
        probe_notes.append(f"loss tolerance: relative {opts.rtol:.1e} ({why}; --rtol)")
    for note in probe_notes + lines.notes:
        print(f"  {note}", file=out)
    crossing = None
    if resume:
        crossing = Crossing(opts.resume_at, work / "checkpoints")
        if iters != opts.iters:
            print(f"  --resume-at {opts.resume_at}: {iters} iterations per run (I+3: the "
                  f"first loss after two updates with the loaded optimizer state)", file=out)
        print(f"  checkpoints (torch_dist) at iteration {opts.resume_at} in "
              f"{crossing.root}; iteration {opts.resume_at + RESUME_SKIPPED} of the resumed "
              "runs is not compared (Megatron-LM's first log line after a start does not "
              "reset its running loss, so the next one averages two iterations)", file=out)
    for row in on_cpu.block():
        print(row, file=out)
    plan = crossing.runs(lines) if crossing else [("stock", lines.stock), ("flat", lines.flat)]
    runs = []
    for name, args in plan:
        if runs and not runs[0].ok:  # no reference: the other runs could not be compared
            print(f"{name} run: not started (the stock run did not complete)", file=out)
            runs.append(Run(name, EXIT_NOT_RUN, work / f"{name}.log", {}, [], 0.0))
            continue
        print(f"{name} run ... (log: {work / (name + '.log')})", file=out, flush=True)
        run = launch(name, script, args, nproc=opts.nproc_per_node, work=work,
                     timeout=opts.timeout or supervise.derived_timeout(
                         _train_iters(args), opts.nproc_per_node),
                     stall_seconds=opts.stall_seconds, env=on_cpu.env)
        print(f"{name} run: exit {run.exit}, {len(run.losses)} iterations logged, "
              f"{run.seconds:.0f} s", file=out, flush=True)
        runs.append(run)
    stock, flat, resumed = runs[0], runs[1], runs[2:]
    print("", file=out)
    skipped = crossing.at + RESUME_SKIPPED if crossing else None
    for row in loss_table(stock, flat, resumed, skipped):
        print(row, file=out)
    if stock.ranks or flat.ranks:
        print("", file=out)
        for row in peak_table(stock, flat):
            print(row, file=out)
        if any(_above(flat.peak(r), stock.peak(r)) for r in PEAK_ROWS):
            print("(at rehearsal shapes the fixed-size buffers -- dispatch chunk cap, optimizer "
                  "buckets and staging -- can outweigh what they save; python -m megatron_flat "
                  "plan predicts the peaks at the real shape)", file=out)
    params = parameter_line(stock, flat)
    if params:
        print("", file=out)
        print(params, file=out)
    ran = what_ran(flat)
    if ran:
        print("", file=out)
        print("flat run built: " + "; ".join(ran), file=out)
    cp_note = cp_attention_note(stock, flat)
    if cp_note:
        print(cp_note, file=out)
    patches = flat.ranks[0].get("patches", []) if flat.ranks else []
    if patches:
        print("CPU workarounds: " + ", ".join(patches), file=out)
    code, last = verdict(stock, flat, opts.rtol, on_cpu.substitutions)
    if code == EXIT_EQUAL and crossing is not None:
        failed = crossing_verdict({"stock": stock, "flat": flat}, resumed, crossing.at,
                                  opts.rtol)
        if failed:
            code, last = EXIT_DIFFER, failed
        else:
            last += f"; checkpoints cross both ways at iteration {crossing.at}"
    if code != EXIT_EQUAL:
        for run in runs:
            if run.exit == EXIT_NOT_RUN:
                continue
            if run.cause is not None:
                print(f"\nthe {run.name} run {run.cause}; each rank's Python stack is in its "
                      f"log ({run.log}); last error lines: "
                      f"{first_error(run.log.read_text(errors='replace')) or '(none found)'}",
                      file=out)
                continue
            if not run.ok:
                error = first_error(run.log.read_text(errors="replace"))
                print(f"\nthe {run.name} run's first error: {error or '(none found)'}", file=out)
    elif opts.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(last, file=out)
    return code


if __name__ == "__main__":
    sys.exit(main())
