"""The one patch mechanism (megatron_flat.runtime.patching): declared, applied once, reverted
to exactly what was there, refused with the seam named."""

import sys
import types

import pytest

from megatron_flat.runtime import patching


@pytest.fixture
def seam(monkeypatch):
    """A throwaway module ``flat_seam`` with a function, a class with a static method and a
    subclass that inherits it."""
    module = types.ModuleType("flat_seam")

    def double(x):
        return 2 * x

    class Base:
        @staticmethod
        def forward(ctx, x):
            return x + 1

    class Child(Base):
        pass

    module.double, module.Base, module.Child = double, Base, Child
    monkeypatch.setitem(sys.modules, "flat_seam", module)
    yield module
    for patch in patching.applied():
        if patch.owner.startswith("flat_seam"):
            patching.revert(patch)


def _plus_one(original):
    def wrapped(*args):
        return original(*args) + 1
    return wrapped


def test_apply_once_and_revert_to_the_original(seam):
    stock = seam.double
    patch = patching.Patch("flat_seam", "double", _plus_one, expects="a function", why="test")
    patching.apply(patch)
    patching.apply(patch)  # once: not wrapped twice
    assert seam.double(3) == 7 and patching.is_applied(patch)
    assert patching.original(patch) is stock and patch in patching.applied()
    assert patching.revert(patch) and seam.double is stock and not patching.is_applied(patch)
    assert patching.revert(patch)  # reverting what is not applied is a no-op


def test_static_patch_on_an_inherited_attribute_reverts_to_inheriting(seam):
    patch = patching.Patch("flat_seam.Child", "forward", _plus_one, expects="forward",
                           why="test", static=True)
    patching.apply(patch)
    assert seam.Child.forward(None, 1) == 3 and seam.Base.forward(None, 1) == 2
    assert "forward" in vars(seam.Child)
    patching.revert(patch)
    assert "forward" not in vars(seam.Child) and seam.Child.forward(None, 1) == 2


def test_a_patch_wrapped_again_on_top_is_not_reverted(seam):
    patch = patching.Patch("flat_seam", "double", _plus_one, expects="a function", why="test")
    patching.apply(patch)
    ours = seam.double
    seam.double = _plus_one(ours)  # someone else's wrapper, on top of ours
    assert not patching.revert(patch) and not patching.is_applied(patch)
    assert seam.double(1) == 4
    seam.double = ours
    assert patching.is_applied(patch) and patching.revert(patch) and seam.double(1) == 2


def test_a_displaced_patch_wraps_what_is_there_when_applied_again(seam):
    stock = seam.double
    patch = patching.Patch("flat_seam", "double", _plus_one, expects="a function", why="test")
    patching.apply(patch)
    seam.double = lambda x: 10 * x  # replaced outright (not wrapping ours)
    assert not patching.is_applied(patch)
    patching.apply(patch)
    assert seam.double(1) == 11 and patching.is_applied(patch)
    assert patching.revert(patch) and seam.double(1) == 10
    seam.double = stock


def test_a_missing_or_unexpected_seam_is_refused_with_its_name(seam):
    missing = patching.Patch("flat_seam", "triple", _plus_one, expects="a function",
                             why="it counts things")
    with pytest.raises(patching.PatchError, match=r"flat_seam.triple is not a function "
                                                  r"\(found nothing\).*it counts things"):
        patching.apply(missing)
    wrong = patching.Patch("flat_seam", "Base", _plus_one, expects="a module-level function",
                           why="test", check=lambda f: isinstance(f, types.FunctionType))
    with pytest.raises(patching.PatchError, match="found type"):
        patching.apply(wrong)
    nowhere = patching.Patch("flat_seam.Nowhere", "x", _plus_one, expects="x", why="test")
    with pytest.raises(patching.PatchError, match="flat_seam.Nowhere"):
        patching.apply(nowhere)
    assert not any(p.owner.startswith("flat_seam") for p in patching.applied())


def test_one_seam_takes_one_patch_and_another_cannot_revert_it(seam):
    """A second, different patch of a patched seam is refused (it would be a silent no-op),
    and reverting it leaves the first in place."""
    first = patching.Patch("flat_seam", "double", _plus_one, expects="a function", why="first")
    second = patching.Patch("flat_seam", "double", _plus_one, expects="a function",
                            why="second")
    patching.apply(first)
    with pytest.raises(patching.PatchError, match=r"already patched by megatron-flat \(first\)"):
        patching.apply(second)
    assert not patching.revert(second)
    assert patching.is_applied(first) and seam.double(3) == 7
    assert patching.revert(first) and seam.double(3) == 6
