"""The mutation suite (scripts/mutants.py) follows the code: every anchor matches exactly once,
every mutant changes its line and names existing tests, a moved anchor is reported, and every
wait, stream ordering, record_stream, synchronize and collective in the covered packages has a
mutant or a stated reason (a new one without either is reported)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(_spec)
sys.modules["mutants"] = mutants  # dataclasses resolve their module by name
_spec.loader.exec_module(mutants)


def test_every_anchor_matches_once():
    assert mutants.check_anchors(mutants.MUTANTS) == []


def test_a_moved_anchor_is_an_error():
    moved = mutants.Mutant("moved", mutants.TRANSFER, "no such line\n", "x\n",
                           mutants.SPAN_MOVER)
    twice = mutants.Mutant("twice", mutants.TRANSFER, "\n", "", mutants.SPAN_MOVER)
    problems = mutants.check_anchors([moved, twice])
    assert any("moved: anchor found 0 times" in p for p in problems), problems
    assert any(p.startswith("twice: anchor found") for p in problems), problems


def test_every_cpu_mutant_has_a_selection_and_every_gpu_one_a_reason():
    for m in mutants.MUTANTS:
        assert m.tests, m.name
        assert m.gpu_only == "" or len(m.gpu_only) > 20, m.name
        # a GPU-only mutant names its CUDA selection, or says why it has none
        assert not m.gpu_only or m.gpu_tests or "two GPUs" in m.gpu_only, m.name
    # the suite only grows: 41 CPU-killable mutants, 14 GPU-only ones
    assert sum(not m.gpu_only for m in mutants.MUTANTS) >= 41
    assert sum(bool(m.gpu_only) for m in mutants.MUTANTS) >= 14


def test_every_site_has_a_mutant_or_a_reason():
    found = mutants.sites()
    assert len(found) >= 50 and {s.call for s in found} >= {
        "wait", "wait_stream", "wait_event", "record_stream", "synchronize",
        "all_gather_into_tensor", "all_to_all_single", "batch_isend_irecv"}
    assert mutants.uncovered() == []
    assert mutants.stale_reasons() == []


def test_a_new_wait_without_a_mutant_is_reported(tmp_path):
    package = tmp_path / "megatron_flat" / "vocab"
    package.mkdir(parents=True)
    (package / "new.py").write_text(
        "class Relay:\n    def land(self, work):\n        work.wait()\n")
    missing = mutants.uncovered(mutants.MUTANTS, root=tmp_path, reasons={})
    assert [(s.path, s.line, s.function, s.call) for s in missing] == [
        ("megatron_flat/vocab/new.py", 3, "Relay.land", "wait")]
    reasons = {"megatron_flat/vocab/new.py: Relay": "a reason", "megatron_flat/gone.py": "x"}
    assert mutants.uncovered(mutants.MUTANTS, root=tmp_path, reasons=reasons) == []
    assert mutants.stale_reasons(tmp_path, reasons) == ["megatron_flat/gone.py"]


def test_only_megatron_mutants_depend_on_the_version():
    by = {m.name: m for m in mutants.MUTANTS}
    assert mutants.touches_megatron(by["optimizer.non-finite-check-reads-grad"])
    assert not mutants.touches_megatron(by["ring.hop-not-waited"])
    assert not mutants.touches_megatron(by["transfer.drain-wait-skipped"])


def test_baselines_a_passed_stage_proved_are_not_rerun(tmp_path):
    """``--proven``: a selection whose mode's whole stage passed in this run is not run again
    unmutated; any other selection still is (a python that fails everything shows which ran)."""
    by = {m.name: m for m in mutants.MUTANTS}
    delayed = by["transfer.drain-wait-skipped"]
    plain_world = by["optimizer.non-finite-check-reads-grad"]
    assert mutants._mode(delayed) == "delayed" and delayed.world == 1
    assert mutants._mode(plain_world) == "world2"
    for name in ("python", "torchrun"):  # every selection it is asked to run fails
        (tmp_path / name).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / name).chmod(0o755)
    missing = str(tmp_path / "python")
    assert mutants.baseline_problems([delayed, plain_world], missing, 5.0,
                                     proven=("delayed", "world2")) == []
    problems = mutants.baseline_problems([delayed, plain_world], missing, 5.0,
                                         proven=("delayed",))
    assert len(problems) == 1 and "(world 2)" in problems[0]
    # A stage that ran only the megatron-involved files proves only their selections.
    assert mutants._ran_in_part(plain_world, "involved")
    assert not mutants._ran_in_part(delayed, "involved")


def test_missing_producer_waits_run_with_late_producers(monkeypatch, tmp_path):
    """A mutant whose bug is a missing wait for the compute stream runs its CUDA selection
    with the compute stream late (FLAT_CUDA_PRODUCER_SLEEP_CYCLES), not the copies (a late
    copy would land after the producer anyway and hide the bug); every other GPU run keeps
    the late copies. Each such mutant is GPU-only with a CUDA selection."""
    late = [m for m in mutants.MUTANTS if m.late_producer]
    assert {m.name for m in late} >= {
        "transfer.offload-ignores-producer", "transfer.reload-ignores-consumer",
        "pipeline.streams-ignore-caller", "params.fetch-ignores-slot-user",
        "params.grad-upload-ignores-compute", "params.drain-before-grad-written"}
    assert all(m.gpu_only and m.gpu_tests for m in late)
    seen = {}

    class Done:
        pid = 0

        def __init__(self, cmd, cwd, env, **kw):
            seen[kw.get("start_new_session")] = env

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(mutants, "_copy_tree", lambda tree: None)
    monkeypatch.setattr(mutants.subprocess, "Popen", Done)
    for m, want, other in ((late[0], "FLAT_CUDA_PRODUCER_SLEEP_CYCLES",
                            "FLAT_CUDA_COPY_SLEEP_CYCLES"),
                           (next(m for m in mutants.MUTANTS
                                 if m.gpu_only and m.gpu_tests and not m.late_producer),
                            "FLAT_CUDA_COPY_SLEEP_CYCLES", "FLAT_CUDA_PRODUCER_SLEEP_CYCLES")):
        mutants._run(m, sys.executable, 10, mutate=False, gpu=True)
        env = seen[True]
        assert env[want] == mutants.GPU_SLEEP_CYCLES and other not in env, m.name
