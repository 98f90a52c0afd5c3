"""The planner's flat terms against the memory meter, as a table (CPU, one process).

Runs the cases of ``tests/plan/test_validation_flat.py`` — each tiny Megatron MoE GPT shape
with one technique on (PipelinedLLEP, Ring-DTP, SCO, OffloadStreamAdamW), one step — and
prints one row per compared figure: shape, technique (with its knobs), component, the
planner's prediction, the meter's measurement and the prediction's error. What each figure
includes is stated in that test module's docstring. ``--json PATH`` also writes the rows and
what each technique reported (chunks per layer, buckets, restored boundaries). Run::

    TORCHDYNAMO_DISABLE=1 python benchmarks/planner_check.py --json results/planner_check.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CASES_FILE = os.path.join(HERE, "..", "tests", "plan", "test_validation_flat.py")


def load_cases():
    """The validation module (one definition of the cases, the planner call and the meter)."""
    spec = importlib.util.spec_from_file_location("test_validation_flat", CASES_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def run(cases, techniques):
    """Measure every case of the chosen techniques: ``[(case, rows, facts)]``."""
    out = []
    for case in cases.CASES:
        if techniques and case.technique not in techniques:
            continue
        got = cases.measure_case(case)
        out.append((case, cases.compare(case, cases.plan(case), got), got.facts))
    return out


def format_table(results, tolerance: float, known) -> str:
    """One line per figure; "!" marks a miss, "known problem" a case listed in the test
    module's ``KNOWN_PROBLEMS`` (the technique, not the planner, departs from docs/architecture.md)."""
    header = (f"{'shape':26s} {'technique':44s} {'component':36s} {'predicted':>11s} "
              f"{'measured':>11s} {'error':>7s}")
    lines = [header, "-" * len(header)]
    for case, rows, _ in results:
        technique = case.name.split("/", 1)[1]
        for row in rows:
            flag = "" if abs(row.error) <= tolerance else \
                "  known problem" if case.name in known else "  !"
            lines.append(f"{case.shape:26s} {technique:44s} {row.component:36s} "
                         f"{row.predicted:>11,d} {row.measured:>11,d} {row.error:>+7.1%}{flag}")
    return "\n".join(lines)


def as_json(results, tolerance: float, seconds: float, known) -> dict:
    return {
        "tolerance": tolerance,
        "seconds": round(seconds, 1),
        "rows": [{"shape": case.shape, "technique": case.technique, "dtype": case.dtype,
                  "knobs": case.knobs, "component": row.component,
                  "predicted": row.predicted, "measured": row.measured,
                  "error": row.error} for case, rows, _ in results for row in rows],
        "facts": {case.name: facts for case, _, facts in results},
        "known_problems": {case.name: known[case.name] for case, _, _ in results
                           if case.name in known},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--technique", nargs="*", choices=["dispatch", "vocab", "sco", "optimizer"],
                   help="only these techniques (default: all)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args()

    import torch.distributed as dist

    from megatron_flat.cpu.backend import enable_cpu_backend
    from megatron_flat.testing.distributed import init_distributed

    init_distributed()
    enable_cpu_backend()
    cases = load_cases()
    start = time.perf_counter()
    results = run(cases, set(args.technique or ()))
    seconds = time.perf_counter() - start
    print("planner (flat terms) vs memory meter: tiny Megatron MoE GPT, CPU, world of one; "
          "error = predicted / measured - 1")
    print(format_table(results, cases.TOLERANCE, cases.KNOWN_PROBLEMS))
    rows = [row for _, rs, _ in results for row in rs]
    within = sum(abs(row.error) <= cases.TOLERANCE for row in rows)
    print(f"{within} of {len(rows)} figures within {cases.TOLERANCE:.0%} ({seconds:.0f} s)")
    for case, _, _ in results:
        if case.name in cases.KNOWN_PROBLEMS:
            print(f"known problem, {case.name}: {cases.KNOWN_PROBLEMS[case.name]}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(as_json(results, cases.TOLERANCE, seconds, cases.KNOWN_PROBLEMS), f,
                      indent=2, default=str)
        print(f"wrote {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
