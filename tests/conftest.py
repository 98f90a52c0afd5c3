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
    """tests/_megatron_use.py, loaded by path (tests are imported in importlib mode)."""
    import importlib.util
    import sys

    module = sys.modules.get("_megatron_use")
    if module is None:
        spec = importlib.util.spec_from_file_location(
            "_megatron_use", os.path.join(os.path.dirname(__file__), "_megatron_use.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["_megatron_use"] = module
        spec.loader.exec_module(module)
    return module


def _megatron_scope():
    scope = os.environ.get("FLAT_MEGATRON", "")
    if scope not in ("", "involved", "free"):
        raise pytest.UsageError(f"FLAT_MEGATRON={scope!r}: expected 'involved' or 'free'")
    return scope


def pytest_configure(config):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if _megatron_scope() == "free":
        _megatron_use().block_megatron()
    config.addinivalue_line(
        "markers", "inline_copies(reason): measures memory (or behaviour) with copies done as "
        "they are issued; FLAT_DELAYED_COPIES=1 runs it without delaying them")
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


def pytest_collection_modifyitems(config, items):
    world = launched_world()
    scope = _megatron_scope()
    kind = {}  # test file -> involves megatron-core (files named on the command line are
    #            collected without pytest_ignore_collect: their tests are filtered here)
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("world")
        wanted = None if marker is None else int(marker.args[0])
        ok = wanted == world
        if ok and scope:
            if item.path not in kind:
                kind[item.path] = _megatron_use().involves_megatron(item.path)
            ok = kind[item.path] == (scope == "involved")
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def megatron_cpu():
    """Megatron-Core importable and runnable here: process group up, CPU patches on."""
    from megatron_flat.megatron.cpu import enable_cpu_backend
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
