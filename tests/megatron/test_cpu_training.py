"""The rehearsal's workarounds for Megatron-LM's training code apply only where needed."""

import typing

from megatron_flat.megatron import cpu_training


def test_every_workaround_says_why():
    for patch in cpu_training.PATCHES:
        assert len(patch.reason) > 40, patch.name


def test_typing_override_shim_only_when_missing(monkeypatch):
    patch = next(p for p in cpu_training.PATCHES if p.name == "typing.override")
    if hasattr(typing, "override") and not getattr(typing.override, "__module__", "") == \
            "megatron_flat.megatron.cpu_training":
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
