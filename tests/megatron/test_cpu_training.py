"""The rehearsal's workarounds for Megatron-LM's training code apply only where needed."""

import sys
import typing

import pytest

from megatron_flat.cpu import training as cpu_training


def test_every_workaround_says_why():
    for patch in cpu_training.WORKAROUNDS:
        assert len(patch.reason) > 40, patch.name


def test_typing_override_shim_only_when_missing(monkeypatch):
    patch = next(p for p in cpu_training.WORKAROUNDS if p.name == "typing.override")
    if hasattr(typing, "override") and not getattr(typing.override, "__module__", "") == \
            "megatron_flat.cpu.training":
        assert not patch.needed()  # Python 3.12+: nothing to shim
    # Recorded first, so the shim set below is undone after the test.
    monkeypatch.setattr(typing, "override", None, raising=False)
    monkeypatch.delattr(typing, "override")
    assert patch.needed()
    patch.apply()

    class Base:
        def f(self):
            return 1

    class Child(Base):
        @typing.override
        def f(self):
            return 2

    assert Child().f() == 2 and Child.f.__override__ is True


_UTILS = """
import torch


def get_device_arch_version():
    return torch.cuda.get_device_properties(torch.device("cuda:0")).major
"""
_ARGUMENTS = """
import os

from megatron.training.utils import get_device_arch_version


def validate_args(tp, cp):
    if (tp > 1 or cp > 1) and get_device_arch_version() < 10:
        assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "set it to 1"
    return True
"""


def test_device_arch_version_answered_for_the_cpu(tmp_path, monkeypatch):
    """validate_args (TP or CP > 1) asks get_device_arch_version(), which reads cuda:0: the
    patch answers for the CPU in the module defining it (already loaded) and in every module
    importing it by name later; a stand-in megatron.training mirrors Megatron-LM's layout."""
    patch = next(p for p in cpu_training.WORKAROUNDS if p.name == "device architecture on CPU")
    package = tmp_path / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(_UTILS)
    (package / "arguments.py").write_text(_ARGUMENTS)
    monkeypatch.syspath_prepend(str(tmp_path))  # megatron is a namespace package
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the import hook: this test's
    monkeypatch.setattr(cpu_training, "_IMPORT_FIXES", [])
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    try:
        from megatron.training import utils

        with pytest.raises((AssertionError, RuntimeError)):  # stock: no CUDA here
            utils.get_device_arch_version()
        assert patch.needed()
        patch.apply()
        assert utils.get_device_arch_version() == cpu_training.CPU_ARCH_VERSION
        from megatron.training import arguments  # imported after the patch: hooked

        assert arguments.validate_args(tp=1, cp=2)
    finally:
        for name in [n for n in sys.modules if n.startswith("megatron.training")]:
            del sys.modules[name]
