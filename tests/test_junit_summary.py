"""scripts/junit_summary.py: make test's last line counts every rank's failures."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "junit_summary.py"
_spec = importlib.util.spec_from_file_location("junit_summary", SCRIPT)
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)


def _report(path: Path, cases: dict) -> None:
    """A pytest-style JUnit file: {name: passed | failed | error | skipped}."""
    body = []
    for name, outcome in cases.items():
        inner = {"passed": "", "failed": "<failure message='x'/>", "error": "<error message='x'/>",
                 "skipped": "<skipped message='x'/>"}[outcome]
        body.append(f"<testcase classname='tests.t' name='{name}'>{inner}</testcase>")
    path.write_text("<testsuites><testsuite name='pytest'>" + "".join(body)
                    + "</testsuite></testsuites>")


def test_a_failure_on_another_rank_counts(tmp_path, capsys):
    _report(tmp_path / "junit-single-megatron-free.xml", {"a": "passed", "b": "skipped"})
    _report(tmp_path / "junit-world4-world4-involved-rank0.xml", {"c": "passed", "d": "passed"})
    _report(tmp_path / "junit-world4-world4-involved-rank1.xml", {"c": "failed", "d": "passed"})
    for rank in (2, 3):
        _report(tmp_path / f"junit-world4-world4-involved-rank{rank}.xml",
                {"c": "passed", "d": "passed"})
    counts, problems = summary.summarize(str(p) for p in tmp_path.iterdir())
    assert counts == {"passed": 2, "failed": 1, "skipped": 1}
    assert problems == ["world4-world4-involved: tests.t::c failed on rank(s) [1] only"]
    assert summary.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "make test: 2 passed, 1 failed, 1 skipped"


def test_sessions_count_each_test_once_and_errors_fail(tmp_path):
    for rank in (0, 1):
        _report(tmp_path / f"junit-world2-w2-free-rank{rank}.xml",
                {"e": "passed", "f": "error" if rank == 0 else "passed", "g": "skipped"})
    _report(tmp_path / "junit-world2-w2-involved-rank0.xml", {"h": "passed"})
    _report(tmp_path / "junit-world2-w2-involved-rank1.xml", {"h": "passed"})
    counts, problems = summary.summarize(str(p) for p in tmp_path.iterdir())
    assert counts == {"passed": 2, "failed": 1, "skipped": 1}
    assert problems == []


def test_a_missing_rank_report_is_named_and_fails(tmp_path):
    _report(tmp_path / "junit-world4-w4-involved-rank1.xml", {"h": "passed"})
    _report(tmp_path / "junit-world4-w4-involved-rank2.xml", {"h": "passed"})
    counts, problems = summary.summarize(str(p) for p in tmp_path.iterdir())
    assert counts == {"passed": 1, "failed": 0, "skipped": 0}
    assert problems == ["world4-w4-involved: no report from rank(s) [0, 3]"]
    assert summary.main([str(tmp_path)]) == 1


def test_all_green_exits_zero(tmp_path, capsys):
    _report(tmp_path / "junit-single.xml", {"a": "passed"})
    assert summary.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "slowest test files (test seconds, report):", "       0.0  tests.t  [single]",
        "make test: 1 passed, 0 failed, 0 skipped"]


def test_file_seconds_count_a_sessions_slowest_rank_and_sum_single_reports(tmp_path):
    def timed(path, times):
        body = "".join(f"<testcase classname='{m}' name='{n}' time='{t}'/>"
                       for (m, n), t in times.items())
        path.write_text(f"<testsuites><testsuite name='pytest'>{body}</testsuite></testsuites>")

    timed(tmp_path / "junit-world2-w2-involved-rank0.xml", {("tests.a", "x"): 3.0,
                                                           ("tests.a", "y"): 1.0})
    timed(tmp_path / "junit-world2-w2-involved-rank1.xml", {("tests.a", "x"): 2.0,
                                                           ("tests.a", "y"): 4.0})
    timed(tmp_path / "junit-single-megatron-free.xml", {("tests.b", "x"): 2.5,
                                                       ("tests.b", "y"): 0.5})
    seconds = summary.file_seconds(str(p) for p in tmp_path.iterdir())
    assert seconds == {("world2-w2-involved", "tests.a"): 7.0,
                       ("single-megatron-free", "tests.b"): 3.0}
