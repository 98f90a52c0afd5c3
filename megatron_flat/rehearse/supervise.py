"""One rehearsal run, supervised: it ends, and it ends with its cause.

``supervise(command, ...)`` starts the run (torchrun and its ranks) in a session of its own and
watches it until it exits, or until one of:

- *stall*: for ``stall_seconds`` the log gained no line and the whole process tree used less
  than ``IDLE_CPU_SHARE`` of one core (ranks waiting for a collective a peer never reaches, or
  for a checkpoint writer that died, sit near idle). When the log's last lines are a Python
  traceback (a child process that died printed its error: the async checkpoint writer, a
  data-loader worker) the window is ``ERROR_STALL_S`` instead: the run ends within seconds;
- *time limit*: ``timeout`` seconds of wall clock.

Then every rank's Python stack is dumped (``faulthandler`` on ``DUMP_SIGNAL``, registered by
the rank worker into ``stack_dir/stack-rank<N>.txt``), and the processes this run started are
ended: the session's process group, then any descendant left (SIGTERM, SIGKILL after
``KILL_GRACE_S``). Nothing else is touched. A rank that exits with an error is torchrun's to
handle (it ends the other ranks at once); if the run is still alive ``RANK_GRACE_S`` after a
rank exited, it is ended the same way.

The process tree is read from ``/proc`` (Linux); elsewhere only the time limit and the process
group apply.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

__all__ = ["DUMP_SIGNAL", "STALL_S", "Outcome", "derived_timeout", "descendants", "read_stacks",
           "supervise", "where"]

DUMP_SIGNAL = signal.SIGUSR1
IDLE_CPU_SHARE = 0.10  # of one core, averaged over the stall window
STALL_S = 30.0  # the default stall window (``--stall-seconds``)
ERROR_STALL_S = 5.0  # the window once the log's last lines are a traceback
KILL_GRACE_S = 5.0
RANK_GRACE_S = 10.0
STACK_WAIT_S = 5.0  # the most a dump may take on a loaded machine
STACK_SETTLED_S = 0.3  # a dump file unchanged this long is complete
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
EXIT_STOPPED = 124  # the exit code reported for a run the supervisor ended


@dataclass
class Outcome:
    """How a run ended: its exit code; ``cause`` None when it ended by itself, else why the
    supervisor ended it ("stopped making progress ...", "timed out after ..."); ``stacks``:
    rank -> the Python stack dumped before it was ended."""

    code: int
    cause: Optional[str] = None
    stacks: Dict[int, str] = field(default_factory=dict)


def derived_timeout(iterations: int, nproc: int) -> float:
    """A run's wall-clock limit from its line: five minutes to start, and a minute per
    iteration and rank (a CPU rehearsal's iteration of a shrunk model takes seconds)."""
    return 300.0 + 60.0 * max(1, iterations) * max(1, nproc)


def _stat(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: split after its closing parenthesis
    return text[text.rindex(")") + 2:].split()


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie has exited


def descendants(pid: int) -> Set[int]:
    """The processes below ``pid`` (children, their children, ...), from ``/proc``."""
    parents: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields:
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found: Set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cpu_seconds(pids: Set[int]) -> float:
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


def _end(proc: subprocess.Popen, tree: Set[int]) -> None:
    """SIGTERM the run's process group and what is left of its tree; SIGKILL after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in tree | descendants(proc.pid):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=KILL_GRACE_S)
            left = [p for p in tree if _alive(p)]
            if not left:
                return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _ends_in_traceback(log: Path, size: int, tail: int = 4096) -> bool:
    """Whether the log ends with a Python traceback: after its last ``Traceback`` header come
    indented frames and, last, the exception line (a process printed its error and died)."""
    with log.open("rb") as f:
        f.seek(max(0, size - tail))
        text = f.read().decode(errors="replace")
    at = text.rfind("Traceback (most recent call last):")
    if at < 0:
        return False
    lines = [line for line in text[at:].splitlines()[1:] if line.strip()]
    # the frames are indented; then the exception line ("RuntimeError: ...") ends the log
    unindented = [line for line in lines if not line.startswith(" ")]
    return (0 < len(unindented) <= 3 and lines[-1] is unindented[-1]
            and (":" in lines[-1] or lines[-1].strip().isidentifier()))


def read_stacks(stack_dir: Path) -> Dict[int, str]:
    stacks = {}
    for path in sorted(stack_dir.glob("stack-rank*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            stacks[int(path.stem.rsplit("rank", 1)[1])] = text
    return stacks


def where(stacks: Dict[int, str]) -> str:
    """Each rank's innermost frame of its main thread (the first thread faulthandler lists is
    the one the signal interrupted: the main thread), e.g. "rank 0 at barrier
    (torch/distributed/distributed_c10d.py:4811)"."""
    parts = []
    for rank, text in sorted(stacks.items()):
        frames = []
        for block in text.split("\n\n"):
            frames = [line.strip() for line in block.splitlines()
                      if line.strip().startswith("File ")]
            if frames:
                break
        if frames:  # faulthandler lists the innermost frame first
            top = frames[0]  # File "path", line N in name
            try:
                path = top.split('"')[1]
                line = top.split("line ")[1].split()[0]
                name = top.rsplit(" in ", 1)[1]
                short = "/".join(Path(path).parts[-3:])
                parts.append(f"rank {rank} at {name} ({short}:{line})")
            except IndexError:
                parts.append(f"rank {rank}: {top}")
    return "; ".join(parts) if parts else "no rank's stack could be dumped"


def supervise(command: Sequence[str], *, log: Path, env: Dict[str, str], timeout: float,
              stall_seconds: float, stack_dir: Path, poll_s: float = 0.5) -> Outcome:
    """Run ``command`` (its output appended to ``log``) under the watch described above. If the
    supervisor itself is interrupted (Ctrl-C, SIGTERM) the run is ended before it returns:
    the run lives in a session of its own, so the terminal's signal does not reach it."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        return _watch(command, log=log, env=env, timeout=timeout, stall_seconds=stall_seconds,
                      stack_dir=stack_dir, poll_s=poll_s)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _watch(command: Sequence[str], *, log: Path, env: Dict[str, str], timeout: float,
           stall_seconds: float, stack_dir: Path, poll_s: float) -> Outcome:
    start = time.monotonic()
    with log.open("a") as sink:
        proc = subprocess.Popen(list(command), stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    tree: Set[int] = set()
    try:
        cause = _wait(proc, tree, log, timeout, stall_seconds, poll_s, start)
    except BaseException:  # interrupted: the run must not outlive the supervisor
        _end(proc, tree)
        raise
    if cause is None:
        return Outcome(proc.returncode)
    ranks = [pid for pid in tree if _parent(pid) == proc.pid]
    for pid in ranks:  # each rank's Python stack, before anything is ended
        try:
            os.kill(pid, DUMP_SIGNAL)
        except (ProcessLookupError, PermissionError):
            pass
    stacks = _await_stacks(stack_dir, len(ranks))
    _end(proc, tree)
    return Outcome(EXIT_STOPPED, cause, stacks)


def _await_stacks(stack_dir: Path, count: int) -> Dict[int, str]:
    """The ranks' dumps once ``count`` of them are written whole, or what there is after
    ``STACK_WAIT_S``. faulthandler writes a dump in many small writes, so a file that merely
    exists may hold a thread header and no frame yet: a dump counts as whole once its file
    has not changed for ``STACK_SETTLED_S``."""
    deadline = time.monotonic() + STACK_WAIT_S
    sizes: Dict[Path, int] = {}
    settled_since: Optional[float] = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        current = {path: path.stat().st_size for path in stack_dir.glob("stack-rank*.txt")}
        whole = sum(1 for size in current.values() if size > 0) >= count
        if current != sizes or not whole:
            sizes, settled_since = current, (now if whole else None)
        elif settled_since is not None and now - settled_since >= STACK_SETTLED_S:
            break
        time.sleep(0.05)
    return read_stacks(stack_dir)


def _parent(pid: int) -> Optional[int]:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _wait(proc: subprocess.Popen, tree: Set[int], log: Path, timeout: float,
          stall_seconds: float, poll_s: float, start: float) -> Optional[str]:
    """Poll until the run exits (None) or must be ended (the cause); ``tree`` collects every
    process seen below it."""
    last_size, last_progress = 0, start
    window = stall_seconds
    cpu_mark, cpu_at = 0.0, start
    ranks: Set[int] = set()
    rank_exited_at: Optional[float] = None
    while True:
        if proc.poll() is not None:
            return None
        now = time.monotonic()
        children = descendants(proc.pid)
        tree |= children
        ranks |= {pid for pid in children if _parent(pid) == proc.pid}
        if rank_exited_at is None and any(not _alive(p) for p in ranks):
            rank_exited_at = now
        size = log.stat().st_size if log.exists() else 0
        cpu = _cpu_seconds(children | {proc.pid})
        if size != last_size:
            last_size, last_progress = size, now
            cpu_mark, cpu_at = cpu, now
            window = ERROR_STALL_S if _ends_in_traceback(log, size) else stall_seconds
            window = min(window, stall_seconds)
        elif now - cpu_at >= window:
            if (cpu - cpu_mark) / (now - cpu_at) >= IDLE_CPU_SHARE:
                last_progress = now  # busy without logging: still working
            cpu_mark, cpu_at = cpu, now
        if now - start > timeout:
            return f"timed out after {timeout:g} s"
        if now - last_progress >= window:
            return (f"stopped making progress (no log line and under {IDLE_CPU_SHARE:.0%} of "
                    f"a core for {window:g} s" + (" after a traceback)" if window < stall_seconds
                                                  else ")"))
        if rank_exited_at is not None and now - rank_exited_at > RANK_GRACE_S:
            return f"kept running {RANK_GRACE_S:g} s after one of its ranks exited"
        time.sleep(poll_s)
