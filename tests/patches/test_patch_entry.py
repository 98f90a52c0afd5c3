"""megatron_flat.megatron.entry: the hooks the patch wires into pretrain_gpt.py."""

import argparse
import functools
import inspect
import subprocess
import sys
import types

import pytest

import megatron_flat
from megatron_flat.config import FlatConfig
from megatron_flat.megatron import entry


def parser():
    return argparse.ArgumentParser(prog="pretrain_gpt.py")


def test_flat_extra_args_alone_adds_the_flags():
    p = entry.flat_extra_args()(parser())
    args = p.parse_args(["--flat-dispatch-max-chunks", "3", "--flat-sco-prefetch", "2"])
    assert args.flat_dispatch_max_chunks == 3 and args.flat_sco_prefetch == 2
    assert entry.flat_extra_args(None)(parser()).parse_args([]).flat_dispatch_max_chunks == 10


def test_flat_extra_args_composes_with_previous_provider():
    calls = []

    def previous(p):
        calls.append(p)
        p.add_argument("--export-te-mcore-model", action="store_true")
        return p

    p = entry.flat_extra_args(previous)(parser())
    args = p.parse_args(["--export-te-mcore-model", "--flat-dispatch-max-chunks", "3"])
    assert len(calls) == 1
    assert args.export_te_mcore_model and args.flat_dispatch_max_chunks == 3


def test_previous_provider_returning_none_or_a_new_parser():
    def in_place(p):
        p.add_argument("--a", type=int, default=1)

    assert entry.flat_extra_args(in_place)(parser()).parse_args(["--a", "5"]).a == 5

    replacement = parser()
    replacement.add_argument("--b", type=int, default=0)
    composed = entry.flat_extra_args(lambda p: replacement)(parser())
    assert composed is replacement
    assert composed.parse_args(["--b", "2", "--flat-sco-prefetch", "4"]).flat_sco_prefetch == 4


def test_previous_may_already_add_the_flat_flags():
    p = entry.flat_extra_args(megatron_flat.add_flat_args)(parser())
    assert p.parse_args(["--flat-dispatch-max-chunks", "7"]).flat_dispatch_max_chunks == 7


def test_flat_install_uses_install_when_present(monkeypatch):
    seen = []
    monkeypatch.setattr(megatron_flat, "install", lambda a: seen.append(a) or "done",
                        raising=False)
    args = argparse.Namespace(flat_dispatch_max_chunks=3)
    assert entry.flat_install(args) == "done" and seen == [args]


def test_flat_install_runs_the_real_install_and_validates():
    from megatron_flat.megatron import install as inst

    inst._reset_for_tests()
    try:
        args = entry.flat_extra_args()(parser()).parse_args(["--flat-dispatch-max-chunks", "3"])
        config = entry.flat_install(args)
        assert isinstance(config, FlatConfig) and config.dispatch_max_chunks == 3
        assert inst.installed() == config
        inst._reset_for_tests()
        args.flat_dispatch_max_chunks = 0
        with pytest.raises(ValueError, match="--flat-dispatch-max-chunks"):
            entry.flat_install(args)
        assert inst.installed() is None
    finally:
        inst._reset_for_tests()


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None):
    """Build one stage."""
    return (model_builder, pre_process, post_process, vp_stage)


def test_flat_model_provider_installs_once_then_delegates(monkeypatch):
    installs = []
    monkeypatch.setattr(entry, "flat_install", installs.append)
    args = argparse.Namespace(flat_dispatch_max_chunks=3)
    wrapped = entry.flat_model_provider(functools.partial(model_provider, "gpt"),
                                        get_args=lambda: args)
    assert installs == []  # nothing at wrap time: the args are not parsed yet
    built = [wrapped(pre_process=True, post_process=False, vp_stage=i) for i in range(3)]
    assert built == [("gpt", True, False, i) for i in range(3)]
    assert installs == [args]


def test_flat_model_provider_keeps_attributes_and_signature():
    wrapped = entry.flat_model_provider(model_provider, get_args=lambda: None)
    assert wrapped.__name__ == "model_provider" and wrapped.__doc__ == "Build one stage."
    assert inspect.signature(wrapped) == inspect.signature(model_provider)
    partial_wrapped = entry.flat_model_provider(functools.partial(model_provider, "gpt"))
    assert list(inspect.signature(partial_wrapped).parameters) == [
        "pre_process", "post_process", "vp_stage"]


def test_flat_model_provider_retries_install_after_a_failure(monkeypatch):
    calls = []

    def flaky(args):
        calls.append(args)
        if len(calls) == 1:
            raise ValueError("bad flag")

    monkeypatch.setattr(entry, "flat_install", flaky)
    wrapped = entry.flat_model_provider(model_provider, get_args=lambda: "args")
    with pytest.raises(ValueError):
        wrapped("gpt")
    wrapped("gpt")
    wrapped("gpt")
    assert calls == ["args", "args"]


def test_flat_model_provider_defaults_to_megatron_get_args(monkeypatch):
    args = argparse.Namespace(flat_dispatch_max_chunks=5)
    stub = types.ModuleType("megatron.training")
    stub.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", stub)
    installs = []
    monkeypatch.setattr(entry, "flat_install", installs.append)
    entry.flat_model_provider(model_provider)("gpt")
    assert installs == [args]


def test_entry_imports_without_megatron_lm():
    code = ("import sys, megatron_flat.megatron.entry; "
            "assert 'megatron.training' not in sys.modules, 'megatron.training imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
