"""Optional extras are detected without ever failing the import of megatron-flat."""

import sys

import pytest

from megatron_flat.runtime import extras


def test_report_names_every_extra():
    assert set(extras.report()) == {"transformer_engine", "apex", "triton"}


def test_absent_and_broken_extras_count_as_unavailable(monkeypatch):
    extras.available.cache_clear()
    monkeypatch.setitem(sys.modules, "apex", None)  # import of apex now raises ImportError
    assert extras.available("apex") is False

    def broken_import(name):  # TE installed without a usable CUDA stack
        raise OSError("libcudart.so: cannot open shared object file")

    extras.available.cache_clear()
    monkeypatch.setattr(extras.importlib, "import_module", broken_import)
    assert extras.available("transformer_engine") is False
    extras.available.cache_clear()


def test_installed_module_is_available(monkeypatch):
    extras.available.cache_clear()
    monkeypatch.setitem(extras._MODULES, "triton", "json")  # any importable module
    assert extras.available("triton") is True
    extras.available.cache_clear()


def test_unknown_extra_is_an_error():
    with pytest.raises(ValueError, match="unknown extra"):
        extras.available("deepspeed")
