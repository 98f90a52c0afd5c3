"""Run Megatron-LM's training code (``megatron.training``) on a CPU-only torch with gloo.

``cpu.backend`` makes Megatron-Core's model, dispatchers and optimizers run on CPU; a real
``pretrain_gpt.py`` launch also goes through Megatron-LM's initialisation and training loop,
which assume a GPU in a few more places. ``enable_cpu_training()`` covers those, for the
rehearsal (``python -m megatron_flat rehearse``) only: it changes process-wide state
(``Tensor.cuda`` becomes the identity) and is meant for a process that exists to rehearse.

Each workaround is a ``cpu.backend.Workaround`` that names what it changes and why, declares
its monkey-patches through ``runtime.patching``, and applies when the installed code has what
it patches (feature detection, not version numbers: a Megatron-LM checkout without
``megatron.legacy.fused_kernels`` simply has nothing to stub). Applied workarounds are listed
by ``cpu.backend.applied_workarounds()`` with the Megatron-Core ones. Modules Megatron-LM
imports later are patched as they load (:func:`on_import`), each through the same mechanism.

Call :func:`shim_python` before Megatron-LM is imported and :func:`enable_cpu_training` after
``cpu.backend.enable_cpu_backend()`` and before the training script runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import typing
from typing import List

import torch

from megatron_flat.cpu import backend as cpu
from megatron_flat.cpu.backend import Workaround
from megatron_flat.runtime import patching


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------- Python
def _needs_override() -> bool:
    return not hasattr(typing, "override")


def _override(method):
    # PEP 698's decorator only marks the method for type checkers.
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


def _override_patches() -> List[patching.Patch]:
    return [patching.Patch("typing", "override", lambda _: _override,
                           expects="absent (Python < 3.12)", missing_ok=True,
                           why="Megatron-LM's training code imports it")]


# ---------------------------------------------------------------------------- torch.compile
def _dynamo_disabled() -> bool:
    return os.environ.get("TORCHDYNAMO_DISABLE") == "1"


def _eager_compile(model=None, **kwargs):
    # With TORCHDYNAMO_DISABLE=1 (the rehearsal's default) a compiled function runs eagerly
    # anyway; returning it unchanged skips importing the compiler (about 2 s per process:
    # Megatron-Core's fused kernels are decorated with torch.compile at import).
    return model if model is not None else (lambda fn: fn)


def _eager_compile_patches() -> List[patching.Patch]:
    return [patching.Patch("torch", "compile", lambda _: _eager_compile, expects="a function",
                           why="under TORCHDYNAMO_DISABLE=1 compiling is the identity")]


# ---------------------------------------------------------------------------- torch.cuda
class _OneDevice(cpu.CudaOnCpu):
    """``torch.cuda`` as Megatron-LM's initialisation must see it to set up model parallelism
    and seed the RNG tracker: available, one device (which is the CPU)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1


class _TorchWithOneDevice(cpu.TorchWithCpuCuda):
    def __init__(self):
        super().__init__()
        self.cuda = _OneDevice()


class _CpuViewFinder(importlib.abc.MetaPathFinder):
    """Gives every ``megatron.*`` module imported from now on the CPU view of ``torch.cuda``
    (``megatron.training.initialize``: the one-device view)."""

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            _give_cpu_view(module)
            for fix in _IMPORT_FIXES:
                fix(module)

        loader.exec_module = exec_module
        return spec


_ONE_DEVICE = "megatron.training.initialize"
_ARGUMENTS = "megatron.training.arguments"
_VIEW_WHY = "Megatron-LM calls torch.cuda unconditionally"


def _view_of(name: str):
    """The CPU view of torch a module gets: initialisation sees one device, the argument
    checks a compute capability (``_CAPABLE`` holds the modules that answer it)."""
    if name == _ONE_DEVICE:
        return _TorchWithOneDevice
    if name in _CAPABLE:
        return _TorchWithCapability
    return None


def _give_cpu_view(module) -> None:
    name = module.__name__
    view = _view_of(name)
    patch = cpu.module_torch_patch(name, _VIEW_WHY, view)
    if patching.is_applied(patch):
        if view is None or isinstance(module.torch, view):
            return
        patching.revert(patch)  # a plain view given before this module's view was known
    if getattr(module, "torch", None) is torch or (
            view is not None and isinstance(getattr(module, "torch", None),
                                            cpu.TorchWithCpuCuda)):
        patching.apply(patch)


def _megatron_modules():
    return [m for name, m in list(sys.modules.items())
            if name.startswith("megatron.") and m is not None]


def _install_finder() -> None:
    if not any(isinstance(f, _CpuViewFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CpuViewFinder())


def _cpu_view_everywhere() -> None:
    for module in _megatron_modules():
        _give_cpu_view(module)
    _install_finder()


def _per_module() -> List[patching.Patch]:
    """No patch of its own up front: the workaround's ``then`` patches each module (loaded
    or loading) through ``runtime.patching``."""
    return []


# Per-module fixes run on every megatron.* module loaded so far and on each one loaded later,
# right after it executes (before anything imports names from it).
_IMPORT_FIXES: List = []


def on_import(fix) -> None:
    """Run ``fix(module)`` on every ``megatron.*`` module loaded so far and on each one loaded
    from now on, right after it executes (before anything imports names from it)."""
    if fix not in _IMPORT_FIXES:
        _IMPORT_FIXES.append(fix)
    for module in _megatron_modules():
        fix(module)
    _install_finder()


def _identity(self, *args, **kwargs):
    # get_model() moves the model with module.cuda(device); batches, timers and loss
    # reductions call tensor.cuda(). On CPU everything already is where it would go.
    return self


def _cuda_identity_patches() -> List[patching.Patch]:
    why = "Megatron-LM moves models and batches with .cuda()"
    return [patching.Patch(owner, "cuda", lambda _: _identity, expects="a method", why=why)
            for owner in ("torch.Tensor", "torch.nn.Module")]


# ---------------------------------------------------------------------------- compilation
def _builds_dataset_helper() -> bool:
    return _has_module("megatron.core.datasets.utils")


def _dataset_utils():
    from megatron.core.datasets import utils

    return utils


def compile_helpers():
    """Build ``helpers_cpp`` with Megatron's Makefile for *this* interpreter.

    The Makefile asks ``python3``/``python3-config`` on PATH, which need not be the
    interpreter running the launch (a virtualenv has no ``python3-config``). Nothing is
    built when this interpreter already finds the helper (a megatron-core wheel ships it).
    """
    folder = os.path.dirname(os.path.abspath(_dataset_utils().__file__))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if os.path.exists(os.path.join(folder, "helpers_cpp" + suffix)):
        return
    try:
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"],
                                  check=True, capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise RuntimeError("Megatron-LM compiles its dataset helper (helpers.cpp) with "
                           f"pybind11, which {sys.executable} cannot import: "
                           "pip install pybind11") from None
    done = subprocess.run(["make", "-C", folder, f"LIBEXT={suffix}", f"CPPFLAGS={includes}"])
    if done.returncode != 0:
        raise RuntimeError(f"building Megatron-LM's dataset helper in {folder} failed "
                           f"(make exit {done.returncode}); see the output above")


def _dataset_helper_patches() -> List[patching.Patch]:
    return [patching.Patch("megatron.core.datasets.utils", "compile_helpers",
                           lambda _: compile_helpers, expects="a function",
                           why="its Makefile builds for python3 on PATH")]


def _has_fused_kernels() -> bool:
    return _has_module("megatron.legacy.fused_kernels")


def _no_build(*args, **kwargs):
    # The fused softmax/layernorm CUDA extensions; the CPU runs the unfused paths.
    return None


def _fused_kernel_patches() -> List[patching.Patch]:
    return [patching.Patch("megatron.legacy.fused_kernels", "load", lambda _: _no_build,
                           expects="a function", why="it builds CUDA extensions")]


# ---------------------------------------------------------------------------- validation
# What get_device_arch_version() answers on the CPU: the first architecture (Blackwell) without
# the one-hardware-queue requirement (CUDA_DEVICE_MAX_CONNECTIONS=1) that validate_args asserts
# for TP > 1 or CP > 1; a CPU has no such queues.
CPU_ARCH_VERSION = 10


def _has_training_code() -> bool:
    # find_spec of megatron.training imports only its parent: the training package itself must
    # not be imported here (its import binds get_forward_backward_func, which the rehearsal's
    # probe wraps later).
    return _has_module("megatron.training")


def _cpu_get_device_arch_version():
    """The CPU's answer (``CPU_ARCH_VERSION``); Megatron reads cuda:0's properties."""
    return CPU_ARCH_VERSION


def _answer_arch_in(module) -> None:
    # Defined in megatron.training.utils (0.16) or .utils.common_utils (0.19) and bound by name
    # wherever it is imported (arguments.py): every binding is replaced as its module loads.
    if not module.__name__.startswith("megatron.training"):
        return
    if callable(getattr(module, "get_device_arch_version", None)):
        patching.apply(patching.Patch(
            module.__name__, "get_device_arch_version", lambda _: _cpu_get_device_arch_version,
            expects="a function", why="it reads cuda:0's properties"))


def _cpu_arch_version() -> None:
    on_import(_answer_arch_in)


class _CapableDevice(cpu.CudaOnCpu):
    """``torch.cuda`` for ``validate_args``: it asks the compute capability before allowing
    ``--moe-grouped-gemm``; the CPU backend's reference grouped GEMM runs on any CPU."""

    @staticmethod
    def get_device_capability(device=None):
        return (CPU_ARCH_VERSION, 0)


class _TorchWithCapability(cpu.TorchWithCpuCuda):
    def __init__(self):
        super().__init__()
        self.cuda = _CapableDevice()


_CAPABLE: set = set()


def _cpu_capability() -> None:
    _CAPABLE.add(_ARGUMENTS)
    for module in _megatron_modules():  # later ones get it from the import hook
        _give_cpu_view(module)


WORKAROUNDS: List[Workaround] = [
    Workaround("typing.override", "Megatron-LM's training code from 0.19 on imports Python "
               "3.12's typing.override; on Python 3.11 it is an identity decorator.",
               _override_patches, _needs_override),
    Workaround("torch.compile is eager", "TORCHDYNAMO_DISABLE=1 (the rehearsal's default) "
               "runs compiled functions eagerly; torch.compile returns them unchanged, so no "
               "process imports the compiler for Megatron's import-time decorators.",
               _eager_compile_patches, _dynamo_disabled),
    Workaround("torch.cuda view for megatron.*", "Megatron-LM's initialisation, training loop, "
               "timers and batch code call torch.cuda unconditionally; initialisation sees one "
               "available device, so it builds the model-parallel groups and seeds the RNG "
               "tracker (it skips both when no GPU is visible).",
               _per_module, then=_cpu_view_everywhere),
    Workaround(".cuda() is the identity", "get_model() moves the model with .cuda(); batches, "
               "timers and loss reductions move tensors with .cuda().",
               _cuda_identity_patches),
    Workaround("dataset helper for this interpreter", "Megatron's Makefile builds helpers_cpp "
               "for python3 on PATH, which need not be the interpreter running the launch.",
               _dataset_helper_patches, _builds_dataset_helper),
    Workaround("no fused kernels", "megatron.legacy.fused_kernels.load builds CUDA extensions.",
               _fused_kernel_patches, _has_fused_kernels),
    Workaround("device architecture on CPU", "validate_args asks get_device_arch_version() "
               "(cuda:0's properties) whenever TP or CP > 1, to require "
               "CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell; the CPU answers "
               f"{CPU_ARCH_VERSION}, an architecture without that requirement.",
               _per_module, _has_training_code, then=_cpu_arch_version),
    Workaround("grouped-GEMM capability check on CPU", "validate_args asks "
               "torch.cuda.get_device_capability() before allowing --moe-grouped-gemm; the CPU "
               f"answers ({CPU_ARCH_VERSION}, 0), and its reference grouped GEMM runs the "
               "experts.",
               _per_module, _has_training_code, then=_cpu_capability),
]


_BEFORE_IMPORT = ("typing.override", "torch.compile is eager")


def shim_python() -> List[str]:
    """The Python-level shims, needed before Megatron-LM is imported; returns those applied."""
    return cpu.apply_workarounds([w for w in WORKAROUNDS if w.name in _BEFORE_IMPORT])


def eager_compile() -> List[str]:
    """Only the "torch.compile is eager" workaround (where TORCHDYNAMO_DISABLE=1): for a
    process that imports Megatron-Core without running Megatron-LM (the test sessions)."""
    return cpu.apply_workarounds([w for w in WORKAROUNDS if w.name == "torch.compile is eager"])


def enable_cpu_training() -> List[str]:
    """Apply every needed workaround (idempotent); returns the names applied now or before.

    A no-op on a machine with CUDA: the rehearsal hides GPUs, and a GPU run needs none."""
    if cpu.cuda_present():
        return []
    return cpu.apply_workarounds(WORKAROUNDS)


__all__ = ["WORKAROUNDS", "eager_compile", "enable_cpu_training", "on_import", "shim_python"]
