"""The last line of ``make test``: tests passed, failed and skipped over every JUnit report.

    python scripts/junit_summary.py DIR

Single-process reports (``junit-single-*.xml``) count as they are. A multi-rank session
writes one report per rank (``junit-world<N>-<tag>-rank<R>.xml``) and every rank runs the
same tests, so each test counts once per session with its worst outcome over the ranks: a
test that fails on rank 1 only is a failure, however rank 0 saw it. A rank whose report is
missing (the process died before pytest wrote it) is named and counts as a failure.
Prints the test files that took longest (seconds of test time: a session's file counts its
slowest rank; single-process files their workers' sum, so more than wall time under xdist),
for keeping CI within its time, then ``make test: P passed, F failed, S skipped``; the exit
status is 1 when any test failed or a report is missing, else 0 (the test script's own
status decides ``make test``; this is a summary that must not hide a rank's failure).
"""

from __future__ import annotations

import glob
import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Dict, Iterable, List, Tuple

__all__ = ["outcomes", "summarize", "file_seconds", "main"]

# worse outcomes win when ranks disagree
_RANK = {"passed": 0, "skipped": 1, "failed": 2}
_SESSION = re.compile(r"^junit-(world(\d+)(?:-.+)?)-rank(\d+)\.xml$")


def outcomes(path: str) -> Dict[str, str]:
    """``{test id: passed | failed | skipped}`` of one JUnit report."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            outcome = "failed"
        elif "skipped" in kinds:
            outcome = "skipped"
        else:
            outcome = "passed"
        if _RANK[outcome] >= _RANK.get(out.get(key, "passed"), 0):
            out[key] = outcome  # a test reported twice (an error in teardown): the worse
    return out


def summarize(paths: Iterable[str]) -> Tuple[Dict[str, int], List[str]]:
    """(counts of passed / failed / skipped, problems) over the reports ``paths``."""
    sessions: Dict[str, dict] = {}  # {session: {"world": N, rank: outcomes}}
    singles: List[Dict[str, str]] = []
    for path in sorted(paths):
        match = _SESSION.match(os.path.basename(path))
        if match:
            world = int(match.group(2))
            ranks = sessions.setdefault(match.group(1), {"world": world})
            ranks[int(match.group(3))] = outcomes(path)
        else:
            singles.append(outcomes(path))
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    problems = []
    for report in singles:
        for outcome in report.values():
            counts[outcome] += 1
    for session, ranks in sorted(sessions.items()):
        world = ranks.pop("world")
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            problems.append(f"{session}: no report from rank(s) {missing}")
        worst: Dict[str, str] = {}
        for report in ranks.values():
            for key, outcome in report.items():
                if _RANK[outcome] >= _RANK[worst.get(key, "passed")]:
                    worst[key] = outcome
        for key, outcome in worst.items():
            counts[outcome] += 1
            if outcome == "failed":
                failed_on = sorted(r for r, rep in ranks.items() if rep.get(key) == "failed")
                if 0 not in failed_on:
                    problems.append(f"{session}: {key} failed on rank(s) {failed_on} only")
    return counts, problems


def file_seconds(paths: Iterable[str]) -> Dict[Tuple[str, str], float]:
    """``{(report tag, test module): seconds}``: each test's time summed over a module, per
    report tag (``single-megatron-involved``, ``world4-world4-involved``, ...); the ranks of
    a session run the same tests side by side, so a test counts its slowest rank."""
    tests: Dict[Tuple[str, str, str], float] = {}
    for path in sorted(paths):
        name = os.path.basename(path)
        match = _SESSION.match(name)
        tag = match.group(1) if match else name[len("junit-"):-len(".xml")]
        ranked = match is not None
        for case in ET.parse(path).getroot().iter("testcase"):
            key = (tag, case.get("classname", ""), case.get("name", ""))
            seconds = float(case.get("time") or 0.0)
            if ranked:
                tests[key] = max(tests.get(key, 0.0), seconds)
            else:
                tests[key] = tests.get(key, 0.0) + seconds
    out: Dict[Tuple[str, str], float] = {}
    for (tag, module, _), seconds in tests.items():
        out[(tag, module)] = out.get((tag, module), 0.0) + seconds
    return out


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/junit_summary.py DIR", file=sys.stderr)
        return 2
    paths = glob.glob(os.path.join(argv[0], "junit-*.xml"))
    counts, problems = summarize(paths)
    slowest = sorted(file_seconds(paths).items(), key=lambda kv: -kv[1])[:12]
    if slowest:
        print("slowest test files (test seconds, report):")
        for (tag, module), seconds in slowest:
            print(f"  {seconds:8.1f}  {module}  [{tag}]")
    for problem in problems:
        print(f"  {problem}")
    print(f"make test: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped")
    return 1 if counts["failed"] or any("no report" in p for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
