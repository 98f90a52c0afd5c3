"""A rehearsal never hangs: injected faults end it within a bound, with the cause, and leave no
process of it running.

The synthetic checkout's ``--fault`` (``rehearsal_checkout.py``) strikes after the first
iteration of the stock run, so the rehearsal ends there (the flat run is not started): a rank
killed by a signal (torchrun ends the other), every rank waiting for a checkpoint writer that
died (a stand-in for Megatron's async writer without ``psutil``), and a rank that never
reaches the next collective. The stall window is 5 s for the lost collective (``--stall-seconds``;
30 by default); the dead writer's traceback shortens the default window by itself.
The missing package caught before launch is ``test_preflight.py``'s.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_flat.rehearse import supervise

sys.path.insert(0, str(Path(__file__).parent))
import rehearsal_checkout as checkout  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 90  # start-up (two ranks importing Megatron) + one iteration + the 5 s window


def _rehearse_with(tmp_path, fault):
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    work = tmp_path / "work"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    line = checkout.LINE + ["--flat-dispatch", "pipelined", "--fault", fault]
    # the dead writer's traceback shortens the default window to ERROR_STALL_S by itself
    stall = [] if fault == "dead-writer" else ["--stall-seconds", "5"]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "megatron_flat", "rehearse", "--nproc-per-node", "2", *stall,
         "--work-dir", str(work), "--", str(script), *line],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    return done, work, time.monotonic() - start


def _nothing_left_of(work):
    """No process whose command line names this rehearsal's checkout is still running."""
    needle = str(work.parent / "mlm")
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd and supervise._alive(int(entry)):
                left.append(cmd[:120])
    return left


@pytest.mark.rehearsal(smoke=True)  # ~10 s each: both megatron-core versions run them
@pytest.mark.parametrize("fault", ["kill-rank", "dead-writer", "lost-collective"])
def test_a_fault_ends_the_rehearsal_with_its_cause(tmp_path, fault):
    done, work, seconds = _rehearse_with(tmp_path, fault)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr[-3000:]
    assert seconds < BOUND_S, (seconds, out)
    assert "flat run: not started (the stock run did not complete)" in out
    last = out.splitlines()[-1]
    log = work / "stock.log"
    assert last.startswith("rehearsal: the stock run ") and last.endswith(f"its log: {log}")
    if fault == "kill-rank":  # torchrun ends the other rank; the report names the signal
        assert last == f"rehearsal: the stock run failed (exit 1); its log: {log}", last
        assert "the stock run's first error: rank 1: Signal 9 (SIGKILL) received by PID" in out
    else:  # the ranks wait at near-zero CPU: a stall, each rank's stack dumped
        assert "stopped making progress" in last, last
        assert re.search(r"rank 0 at \w+ \(.+:\d+\); rank 1 at \w+", last), last
        text = log.read_text()
        assert "-- rank 0's Python stack --" in text and "-- rank 1's Python stack --" in text
    if fault == "dead-writer":  # ended ERROR_STALL_S after the writer's error, which is quoted
        assert f"for {supervise.ERROR_STALL_S:g} s after a traceback" in last, last
        assert "RuntimeError: synthetic checkpoint writer: psutil is not installed" in out
    if fault == "lost-collective":  # rank 1 is where it stopped; rank 0 in a collective
        assert re.search(r"rank 1 at wait \(", last), last
    assert _nothing_left_of(work) == []


def test_the_time_limit_ends_a_run_that_keeps_working(tmp_path):
    """A run that logs nothing but keeps a core busy is not a stall: the wall-clock limit ends
    it, with each rank's stack."""
    log = tmp_path / "busy.log"
    log.write_text("")
    stack_dir = tmp_path / "stacks"
    stack_dir.mkdir()
    worker = (
        "import faulthandler, os, signal, sys\n"
        f"sink = open(os.path.join({str(stack_dir)!r}, 'stack-rank0.txt'), 'w')\n"
        "faulthandler.register(signal.SIGUSR1, file=sink, all_threads=True)\n"
        "def spin():\n"
        "    while True:\n"
        "        pass\n"
        "spin()\n")
    parent = ("import subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', {worker!r}])\n")
    start = time.monotonic()
    outcome = supervise.supervise([sys.executable, "-c", parent], log=log, env=dict(os.environ),
                                  timeout=6, stall_seconds=2, stack_dir=stack_dir, poll_s=0.2)
    assert time.monotonic() - start < 6 + supervise.STACK_WAIT_S + 2 * supervise.KILL_GRACE_S
    assert outcome.code == supervise.EXIT_STOPPED
    assert outcome.cause == "timed out after 6 s"
    assert supervise.where(outcome.stacks).startswith("rank 0 at spin ("), outcome.stacks


def test_a_dump_written_in_pieces_is_read_whole(tmp_path):
    """faulthandler writes a dump in many small writes: a rank's file may hold its thread
    header and no frame yet when the other rank's dump is complete. The stacks are read once
    every file has settled, so the report names each rank where it stopped."""
    import threading

    (tmp_path / "stack-rank0.txt").write_text(
        'Thread 0x1 (most recent call first):\n  File "a/b/c.py", line 3 in barrier\n')
    late = tmp_path / "stack-rank1.txt"
    late.write_text("Thread 0x2 (most recent call first):\n")

    def rest():
        time.sleep(0.15)
        with late.open("a") as f:
            f.write('  File "d/e/f.py", line 7 in wait\n')

    writer = threading.Thread(target=rest)
    writer.start()
    stacks = supervise._await_stacks(tmp_path, 2)
    writer.join()
    assert supervise.where(stacks) == "rank 0 at barrier (a/b/c.py:3); rank 1 at wait (d/e/f.py:7)"


def test_derived_time_limit_grows_with_iterations_and_ranks():
    assert supervise.derived_timeout(3, 2) == 300 + 60 * 3 * 2
    assert supervise.derived_timeout(10, 4) > supervise.derived_timeout(3, 2)


def test_an_interrupted_supervisor_ends_its_run(tmp_path):
    """The run lives in a session of its own (the terminal's Ctrl-C does not reach it), so the
    supervisor ends it when it is itself interrupted: SIGTERM here."""
    marker = f"sleep 3{os.getpid() % 1000:03d}"  # a command line no other process has
    supervisor = (
        "import sys\n"
        "from pathlib import Path\n"
        "from megatron_flat.rehearse import supervise\n"
        f"d = Path({str(tmp_path)!r})\n"
        f"supervise.supervise(['bash', '-c', {marker + ' & ' + marker + '; wait'!r}],\n"
        "    log=d / 'run.log', env={'PATH': '/usr/bin:/bin'}, timeout=600, stall_seconds=600,\n"
        "    stack_dir=d)\n")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", supervisor], env=env)

    def sleepers():
        return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if _cmdline(pid) == marker and supervise._alive(pid)]

    deadline = time.monotonic() + 30
    while len(sleepers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(sleepers()) == 2
    proc.terminate()
    assert proc.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sleepers() == []


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
