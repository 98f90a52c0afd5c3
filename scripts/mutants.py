#!/usr/bin/env python
"""The mutation suite of the asynchronous code: every wait has a test that fails without it.

Each mutant is one small textual change at an anchored place (a wait removed, a wait moved
after the read, a ``record_stream`` dropped, a skip path that updates anyway) with the
narrowest test selection that must fail for it. The suite copies the repository's tracked
files to a temporary directory, applies one mutant there, runs its selection (with delayed
copies, ``FLAT_DELAYED_COPIES=1``, unless the mutant says otherwise) under a timeout, and
prints one row per mutant: killed (the selection failed or hung), survived, or GPU-only (the
CPU model cannot express the race; ``gpu_only`` says why and the GPU check runs it).

    python scripts/mutants.py --check          # every anchor matches exactly once
    python scripts/mutants.py --list           # the mutants and the sites without one
    python scripts/mutants.py [NAME ...]       # run (default: every CPU mutant)

An anchor that no longer matches exactly once is an error, so the suite follows the code.
Sites where no mutant can be written are listed in ``NO_MUTANT`` with the reason.
Every distinct selection first runs on the unmutated copy and must pass (else a kill would
prove nothing). Exit status: 0 when every CPU mutant is killed, 1 when one survives, 2 on a
broken anchor or a selection that fails unmutated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """One single-place bug: ``anchor`` (exact text, once in ``path``) becomes ``replacement``.

    ``tests``: the pytest selection that must fail (paths or node ids, relative to the root);
    ``world``: ranks to run it on (1: plain pytest, N: torchrun); ``delayed``: with delayed
    copies; ``gpu_only``: why only a GPU can kill it (not run on CPU)."""

    name: str
    path: str
    anchor: str
    replacement: str
    tests: Tuple[str, ...]
    world: int = 1
    delayed: bool = True
    gpu_only: str = ""


def _drop(line: str) -> str:
    """A line removed, indentation kept (``pass`` keeps the block valid)."""
    indent = line[: len(line) - len(line.lstrip())]
    return f"{indent}pass  # mutant: {line.strip()}"


def drop(name: str, path: str, line: str, tests: Tuple[str, ...], **kw) -> Mutant:
    """The mutant that removes ``line`` (one whole line, as it stands in ``path``)."""
    return Mutant(name, path, line + "\n", _drop(line) + "\n", tests, **kw)


SPAN_MOVER = ("tests/checkpoint/test_span_mover.py",)
SCO_RACES = ("tests/checkpoint/test_races.py", "tests/checkpoint/test_span_mover.py")
OPT_RACES = ("tests/optim/test_races.py",)
TRANSFER = "megatron_flat/checkpoint/transfer.py"
PIPELINE = "megatron_flat/optim/pipeline.py"

# The producer-stream and record_stream mutants: on CPU the producer (the default stream) is
# inline, so the side stream's copy always sees the finished tensor, and a source tensor stays
# alive while Python holds it; only the CUDA caching allocator reuses its memory early.
_INLINE_PRODUCER = ("the producer stream is inline on CPU: the copy always reads the finished "
                    "tensor")
_ALLOCATOR = ("CPU memory is not reused while Python holds the tensor; on a GPU the caching "
              "allocator hands the block to the next allocation")

MUTANTS: List[Mutant] = [
    # -- checkpoint/transfer.py: SCO's SpanMover -------------------------------------------
    Mutant("transfer.drain-releases-before-copy-landed", TRANSFER,
           "            if wait or event.query():\n",
           "            if True:  # mutant: released before the copy landed\n", SPAN_MOVER),
    Mutant("transfer.drain-wait-skipped", TRANSFER,
           "            if wait:\n                event.synchronize()\n",
           "            if wait:\n                pass  # mutant: no synchronize\n", SPAN_MOVER),
    drop("transfer.offload-ignores-producer", TRANSFER,
         "        d2h.wait_stream(current_stream(src.device))", SCO_RACES,
         gpu_only=_INLINE_PRODUCER),
    drop("transfer.offload-source-not-recorded", TRANSFER,
         "        record_stream(src, d2h)", SCO_RACES, gpu_only=_ALLOCATOR),
    drop("transfer.reload-ignores-consumer", TRANSFER,
         "        h2d.wait_stream(current_stream(span.device))", SCO_RACES,
         gpu_only="the reload buffer is new; on CPU nothing on the current stream can "
                  "still be using it"),
    drop("transfer.reload-before-offload-landed", TRANSFER,
         "        h2d.wait_event(span.offloaded)", SCO_RACES),
    drop("transfer.reload-buffer-not-recorded", TRANSFER,
         "        record_stream(buffer, h2d)", SCO_RACES, gpu_only=_ALLOCATOR),
    drop("transfer.release-ignores-reload", TRANSFER,
         "            span.last_copy = event", SPAN_MOVER),
    Mutant("transfer.synchronize-skips-side-streams", TRANSFER,
           "            d2h.synchronize()\n            h2d.synchronize()\n",
           "            pass  # mutant: side streams not synchronized\n", SCO_RACES),
    # -- checkpoint/offload.py: SCO's reload consumer ---------------------------------------
    Mutant("offload.unpack-without-reload-wait", "megatron_flat/checkpoint/offload.py",
           "        event.wait()\n        with torch.no_grad():\n            return rebuild(",
           "        pass  # mutant: no wait\n"
           "        with torch.no_grad():\n            return rebuild(",
           ("tests/checkpoint/test_races.py",)),
    # -- optim/pipeline.py: OffloadStreamAdamW's slots --------------------------------------
    drop("pipeline.streams-ignore-caller", PIPELINE,
         "            stream.wait_stream(caller)", OPT_RACES,
         gpu_only="on CPU the caller's work (the gradients) is complete when step() starts"),
    drop("pipeline.upload-into-busy-slot", PIPELINE,
         "                self.upload.wait_event(slot.free)", OPT_RACES),
    drop("pipeline.update-before-upload", PIPELINE,
         "                self.compute.wait_event(slot.uploaded)", OPT_RACES),
    drop("pipeline.writeback-before-update", PIPELINE,
         "                self.writeback.wait_event(slot.updated)", OPT_RACES,
         gpu_only="only copies are delayed on CPU; the update runs inline, so the write-back "
                  "always reads the updated slot"),
    Mutant("pipeline.caller-ignores-writeback", PIPELINE,
           "        caller.wait_stream(self.writeback)\n        self.writeback.synchronize()\n",
           "        pass  # mutant: caller does not wait for the write-back\n", OPT_RACES),
]

# The skip decision: every rank agrees on a non-finite gradient before the offloaded step.
MUTANTS += [
    Mutant("optimizer.non-finite-check-reads-grad", "megatron_flat/megatron/optimizer.py",
           '    attr = getattr(inner, "grad_attr", "grad")  # precision-aware: decoupled_grad\n',
           '    attr = "grad"  # mutant: decoupled_grad ignored\n',
           ("tests/optim/test_megatron_offload_world2.py::"
            "test_inf_gradient_skips_the_step_everywhere[distopt-bf16]",), world=2,
           delayed=False),
]

# Waits and synchronisations in the covered packages that have no mutant, and why.
NO_MUTANT: Dict[str, str] = {
    "megatron_flat/runtime/streams.py": "the stream/event layer itself: every call above goes "
                                        "through it, so each mutant above also mutates its use",
    "megatron_flat/optim/pipeline.py: Pipeline.synchronize": "a host wait for code outside the "
                                                             "step (checkpoint save); the save "
                                                             "tests read the state after it",
}


# --------------------------------------------------------------------------- running
def check_anchors(mutants: Sequence[Mutant], root: Path = ROOT) -> List[str]:
    """Problems with the anchors (empty = every anchor matches exactly once and changes it)."""
    problems = []
    names = set()
    for m in mutants:
        if m.name in names:
            problems.append(f"{m.name}: duplicate name")
        names.add(m.name)
        path = root / m.path
        if not path.exists():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text().count(m.anchor)
        if count != 1:
            problems.append(f"{m.name}: anchor found {count} times in {m.path}")
        if m.anchor == m.replacement:
            problems.append(f"{m.name}: the replacement changes nothing")
        for test in m.tests:
            if not (root / test.split("::")[0]).exists():
                problems.append(f"{m.name}: test {test} does not exist")
    return problems


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def _run(m: Mutant, python: str, timeout: float, mutate: bool) -> Tuple[str, float]:
    """Run ``m``'s selection on a fresh copy of the tree, mutated or not: ("failed" |
    "passed" | "timeout" | "no test", seconds)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flat-mutant-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if mutate:
            path = tree / m.path
            path.write_text(path.read_text().replace(m.anchor, m.replacement, 1))
        env = dict(os.environ, PYTHONPATH=str(tree), TORCHDYNAMO_DISABLE="1",
                   PYTHONWARNINGS="ignore")
        for name in ("FLAT_JUNIT_DIR", "FLAT_JUNIT_TAG", "FLAT_DELAYED_COPIES"):
            env.pop(name, None)  # a mutant's failing run must not count as the suite's
        if m.delayed:
            env["FLAT_DELAYED_COPIES"] = "1"
        pytest = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        if m.world == 1:
            cmd = [python, *pytest]
        else:
            torchrun = str(Path(python).with_name("torchrun"))
            cmd = [torchrun, "--standalone", "--nproc-per-node", str(m.world), *pytest]
        try:
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {0: "passed", 5: "no test"}.get(done.returncode, "failed"), seconds


def run_mutant(m: Mutant, python: str, timeout: float) -> Tuple[str, float]:
    """("killed" | "killed (timeout)" | "survived" | "error: ...", seconds) for one mutant."""
    outcome, seconds = _run(m, python, timeout, mutate=True)
    return {"failed": "killed", "timeout": "killed (timeout)", "passed": "survived",
            "no test": "error: the selection ran no test"}[outcome], seconds


def baseline_problems(chosen: Sequence[Mutant], python: str, timeout: float) -> List[str]:
    """Each distinct selection must pass on the unmutated tree, or a kill proves nothing."""
    problems, seen = [], set()
    for m in chosen:
        key = (m.tests, m.world, m.delayed)
        if key in seen:
            continue
        seen.add(key)
        outcome, _ = _run(m, python, timeout, mutate=False)
        if outcome != "passed":
            problems.append(f"{' '.join(m.tests)} (world {m.world}): {outcome} without a mutant")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: every CPU mutant)")
    p.add_argument("--check", action="store_true", help="only check the anchors")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    problems = check_anchors(MUTANTS)
    if problems:
        print("broken mutants (the code moved; update scripts/mutants.py):")
        print("\n".join(f"  {x}" for x in problems))
        return 2
    if args.check:
        print(f"{len(MUTANTS)} mutants, every anchor matches once")
        return 0
    if args.list:
        for m in MUTANTS:
            where = f"GPU only: {m.gpu_only}" if m.gpu_only else " ".join(m.tests)
            print(f"{m.name:45s} {m.path:40s} {where}")
        for site, why in NO_MUTANT.items():
            print(f"{'(no mutant)':45s} {site}: {why}")
        return 0
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown mutants: {', '.join(unknown)}")
    chosen = [known[n] for n in args.names] if args.names else \
        [m for m in MUTANTS if not m.gpu_only]
    broken = baseline_problems(chosen, args.python, args.timeout)
    if broken:
        print("selections that do not pass on the unmutated tree:")
        print("\n".join(f"  {x}" for x in broken))
        return 2
    survivors = 0
    print(f"{'mutant':45s} {'result':18s} {'seconds':>8s}  selection")
    for m in chosen:
        result, seconds = run_mutant(m, args.python, args.timeout)
        survivors += result == "survived" or result.startswith("error")
        print(f"{m.name:45s} {result:18s} {seconds:8.1f}  {' '.join(m.tests)}", flush=True)
    for m in MUTANTS:
        if m.gpu_only and m not in chosen:
            print(f"{m.name:45s} {'GPU only':18s} {'':>8s}  {m.gpu_only}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
