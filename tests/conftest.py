"""Test selection by world size.

Plain ``pytest`` runs the single-process tests. Under ``torchrun --nproc-per-node N -m
pytest`` every rank runs the tests marked ``@pytest.mark.world(N)`` in the same order
(they contain collectives) and nothing else. Tests for another world size are
deselected, not skipped, so a run reports only what it really executed.

``FLAT_MEGATRON=involved`` keeps only the files that may run megatron-core code and
``FLAT_MEGATRON=free`` only the others, with megatron-core made unimportable so the run
proves them free of it (tests/_megatron_use.py; CI's second megatron-core version runs
only the involved files).
"""

import os

import pytest


def launched_world():
    """World size when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _megatron_use():
    """tests/_megatron_use.py (also a script: scripts/test.sh lists files with it)."""
    from tests import _megatron_use

    return _megatron_use


def _megatron_scope():
    scope = os.environ.get("FLAT_MEGATRON", "")
    if scope not in ("", "involved", "free"):
        raise pytest.UsageError(f"FLAT_MEGATRON={scope!r}: expected 'involved' or 'free'")
    return scope


def pytest_configure(config):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if launched_world() is not None:
        # One torchrun session runs every multi-rank file, so Megatron (which imports Triton)
        # is imported before the vocabulary benchmark's file could ask for Triton's CPU
        # interpreter for its peers' kernels; Triton reads this once, at its first import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if _megatron_scope() == "free":
        _megatron_use().block_megatron()
    # make test sets TORCHDYNAMO_DISABLE=1: compiled functions run eagerly, so torch.compile may
    # return them unchanged and no test process imports the compiler with Megatron-Core.
    from megatron_flat.cpu import training as cpu_training

    cpu_training.eager_compile()
    config.addinivalue_line(
        "markers", "inline_copies(reason): measures memory (or behaviour) with copies done as "
        "they are issued; FLAT_DELAYED_COPIES=1 runs it without delaying them")
    config.addinivalue_line(
        "markers", "rehearsal(smoke=False, runs=2): an end-to-end rehearsal (Megatron-LM runs "
        "in subprocesses: runs of them); FLAT_REHEARSALS=smoke keeps only the ones marked "
        "smoke=True")
    config.addinivalue_line(
        "markers", "end_to_end(smoke=False): a whole job run in the test's own process (the "
        "demo's sweep); FLAT_REHEARSALS=smoke keeps only the ones marked smoke=True, as for "
        "rehearsals")
    junit_dir = os.environ.get("FLAT_JUNIT_DIR")
    if junit_dir:
        world = launched_world()
        tag = os.environ.get("FLAT_JUNIT_TAG")  # one torchrun per test file: keep each report
        name = ("-".join(["single"] + ([tag] if tag else [])) if world is None else "-".join(
            [f"world{world}"] + ([tag] if tag else []) + [f"rank{os.environ['RANK']}"]))
        config.option.xmlpath = os.path.join(junit_dir, f"junit-{name}.xml")


def pytest_ignore_collect(collection_path, config):
    """Under FLAT_MEGATRON, test files of the other kind are not even imported (a free run
    must not import an involved file, which may import megatron-core at module level)."""
    scope = _megatron_scope()
    name = collection_path.name
    if scope and name.startswith("test_") and name.endswith(".py"):
        return _megatron_use().involves_megatron(collection_path) != (scope == "involved")
    return None


def _rehearsals() -> str:
    """FLAT_REHEARSALS: ``all`` (default) or ``smoke`` (CI's second megatron-core version runs
    the end-to-end rehearsals in full with the first version and one smoke rehearsal here)."""
    mode = os.environ.get("FLAT_REHEARSALS", "all")
    if mode not in ("all", "smoke"):
        raise pytest.UsageError(f"FLAT_REHEARSALS={mode!r}: expected 'all' or 'smoke'")
    return mode


_END_TO_END = ("rehearsal", "end_to_end")


def _wanted_rehearsal(item, mode: str) -> bool:
    marks = [m for name in _END_TO_END for m in item.iter_markers(name)]
    if mode == "all" or not marks:
        return True
    # pytest.param(..., marks=rehearsal(smoke=True)) comes before the function's own marker
    return any(m.kwargs.get("smoke", False) for m in marks)


def pytest_collection_modifyitems(config, items):
    world = launched_world()
    scope = _megatron_scope()
    rehearsals = _rehearsals()
    kind = {}  # test file -> involves megatron-core (files named on the command line are
    #            collected without pytest_ignore_collect: their tests are filtered here)
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("world")
        wanted = None if marker is None else int(marker.args[0])
        ok = wanted == world and _wanted_rehearsal(item, rehearsals)
        if ok and scope:
            if item.path not in kind:
                kind[item.path] = _megatron_use().involves_megatron(item.path)
            ok = kind[item.path] == (scope == "involved")
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # The rehearsals first, those with the most runs first: they take most of the
    # single-process stage, and pytest-xdist hands tests out in this order, so a long one
    # last would keep one worker busy after the other ran out of tests.
    items[:] = sorted(keep, key=lambda item: -_rehearsal_runs(item))


def _rehearsal_runs(item) -> int:
    marker = item.get_closest_marker("rehearsal")
    return 0 if marker is None else int(marker.kwargs.get("runs", 2))


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _megatron_parallel_state_up() -> bool:
    import sys

    state = sys.modules.get("megatron.core.parallel_state")
    return bool(state is not None and state.model_parallel_is_initialized())


def _release_megatron_models() -> None:
    """Free the wrapped models a file left behind (called when the file is done with them).

    Megatron's ``DistributedDataParallel`` registers a hook on each parameter's gradient
    accumulator whose closure holds the wrapper; the accumulators stay alive through
    ``grad_accs`` and through the last step's autograd graph, which modules keep (the MoE
    dispatcher keeps its routing probabilities). That cycle runs through C++ autograd nodes,
    which the cyclic collector cannot see, so the model, its process-group collections and
    every gloo group they name (two spinning transport threads each) would live until the
    process exits: one file of layouts left ~400 threads behind. ``megatron_flat.release``
    cuts it (and gives back what megatron-flat held for the model) for every wrapper still
    alive; the collector then frees the rest."""
    import gc
    import sys

    module = sys.modules.get("megatron.core.distributed.distributed_data_parallel")
    if module is not None:
        from megatron_flat.megatron.release import release

        wrapper = module.DistributedDataParallel

        def alive():  # wrappers not yet emptied (an emptied one has no modules to release)
            return [obj for obj in gc.get_objects()
                    if isinstance(obj, wrapper) and "_modules" in obj.__dict__]

        for obj in alive():
            release(obj)
        gc.collect()
        # one still referenced (a module global of the test file) is emptied instead
        for obj in alive():
            obj.__dict__.clear()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _file_leaves_no_groups(request):
    """Under torchrun one pytest session runs every multi-rank file of a world size in turn
    (scripts/test.sh), so a file must leave the process as it found it: no process group it
    made still alive (a live gloo group keeps transport threads spinning and would let a later
    file pass or hang on the earlier file's state) and Megatron's parallel state torn down.
    A file that leaks fails here, naming itself; the leak is then cleaned up so the files
    after it still test their own code. The file's Megatron layouts share one pool of process
    groups (testing.distributed.layout_group_pool), destroyed before the check."""
    from megatron_flat.testing.distributed import layout_group_pool

    if launched_world() is None:
        with layout_group_pool():
            yield
        return
    import torch.distributed as dist

    from megatron_flat.testing.distributed import destroy_gloo_groups_since, live_groups

    before, threads = live_groups(), _native_threads()
    with layout_group_pool():  # the file's layouts share their groups; closed before the check
        yield
    _release_megatron_models()
    if os.environ.get("FLAT_THREAD_REPORT"):
        with open(os.environ["FLAT_THREAD_REPORT"] + os.environ["RANK"], "a") as f:
            f.write(f"{request.node.nodeid} THREADS {threads} -> {_native_threads()} "
                    f"groups {len(live_groups())}\n")

    leaked = live_groups() - before - {dist.GroupMember.WORLD}
    state_up = _megatron_parallel_state_up()
    if not leaked and not state_up:
        return
    if state_up:
        import sys

        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    destroy_gloo_groups_since(before)
    pytest.fail(f"this file left {len(leaked)} process group(s) alive"
                f"{' and Megatron parallel state initialised' if state_up else ''} "
                f"(native threads {threads} -> {_native_threads()}); tear them down "
                "(megatron_flat.testing.distributed.megatron_layout does)", pytrace=False)


@pytest.fixture(scope="session")
def megatron_cpu():
    """Megatron-Core importable and runnable here: process group up, CPU patches on."""
    from megatron_flat.cpu.backend import enable_cpu_backend
    from megatron_flat.testing.distributed import init_distributed

    init_distributed()
    enable_cpu_backend()
    return True


@pytest.fixture(scope="session")
def dist_world():
    """The default process group (gloo on CPU) for tests that don't need Megatron.

    Under torchrun it joins the launched job; under plain pytest it is a world of one.
    Returns the world size.
    """
    from megatron_flat.testing.distributed import init_distributed

    return init_distributed()


@pytest.fixture(autouse=True)
def _delayed_copies_when_asked(request):
    """``FLAT_DELAYED_COPIES=1``: every test runs with delayed copies (runtime.streams): a
    side-stream copy lands only when a wait makes it due and its destination reads as poison
    until then, so a missing wait fails the test instead of passing by luck. Tests marked
    ``inline_copies`` (memory measured when copies finish as they are issued) run as usual."""
    if (os.environ.get("FLAT_DELAYED_COPIES") != "1"
            or request.node.get_closest_marker("inline_copies") is not None):
        yield
        return
    from megatron_flat.runtime.streams import delayed_copies

    with delayed_copies():
        yield


@pytest.fixture
def benchmark_script():
    """Load ``benchmarks/<name>.py`` as a module (its ``main`` reads ``sys.argv``)."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent

    def load(name: str):
        spec = importlib.util.spec_from_file_location(
            f"{name}_benchmark", root / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def pytest_sessionfinish(session, exitstatus):
    """Tear the process groups down before the interpreter exits.

    Gloo groups still alive while the interpreter finalises can abort the process
    ("terminate called without an active exception") after every test has passed. Local
    only: no collective, so a rank whose peers already left does not wait for them.

    Under torchrun, a ``-k``/``-m`` selection that leaves a file nothing to run exits 0:
    torchrun reports any nonzero rank as a failure, so pytest's "no tests" (5) would read
    as one. Without a selection, an empty file stays an error.
    """
    import sys

    option = session.config.option
    if (launched_world() is not None and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED
            and (getattr(option, "keyword", "") or getattr(option, "markexpr", ""))):
        session.exitstatus = pytest.ExitCode.OK

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    dist.destroy_process_group()
