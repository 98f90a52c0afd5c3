"""Monkey-patches, declared and applied one way.

Every replacement megatron-flat makes of another library's attribute (Megatron-Core's seams,
torch's functions) is a :class:`Patch`: the owner (a dotted path, resolved when applied, so a
module is imported only when its patch is), the attribute, what must be found there, why the
patch exists, and ``wrap``, which turns the attribute's current value into the replacement.

:func:`apply` and :func:`revert` keep one registry, keyed by owner and attribute: it is the only
"already patched" mark (nothing is written onto the patched functions), so applying twice is a
no-op and reverting restores exactly what was there, including "nothing of its own" for an
attribute a class inherited. A patch something else has set the attribute over since is
*displaced*: it is not reverted (that would drop the other), and applying it again wraps what
is there now. A patch is refused with one :class:`PatchError` naming the owner,
the attribute and what was expected when the attribute is missing or fails ``check``: a
release that moved a seam stops the run at install, not in the middle of a step.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Patch", "PatchError", "apply", "applied", "is_applied", "original", "path_of",
           "resolve", "revert"]

_MISSING = object()


class PatchError(RuntimeError):
    """A seam a patch needs is not where (or not what) the patch expects."""


@dataclass(frozen=True)
class Patch:
    """One declared monkey-patch.

    ``owner``: a dotted path to a module, or to a class inside one
    (``"megatron.core.tensor_parallel.random.CheckpointFunction"``); ``attribute``: the name
    replaced on it; ``wrap(original) -> replacement``; ``expects``: what must be there, in
    words (shown when ``check`` fails); ``why``: the reason, for ``applied()`` and the docs;
    ``check(original) -> bool`` (default: callable); ``static``: install the replacement as
    a ``staticmethod`` (autograd Functions' ``forward``/``backward``); ``classmethod_``: the
    attribute is a class's own ``classmethod``: ``wrap`` gets its function and the
    replacement is installed as a ``classmethod``; ``missing_ok``: the attribute may be
    absent (``wrap`` then gets None and the patch defines it; reverting deletes it again)."""

    owner: str
    attribute: str
    wrap: Callable[[Any], Any] = field(compare=False)
    expects: str
    why: str
    check: Callable[[Any], bool] = field(default=callable, compare=False)
    static: bool = False
    classmethod_: bool = False
    missing_ok: bool = False

    @property
    def key(self) -> Tuple[str, str]:
        return self.owner, self.attribute


@dataclass
class _Record:
    patch: Patch
    owner: Any
    own: Any  # the owner's own entry before the patch (vars(owner)), or _MISSING
    served: Any  # what getattr(owner, attribute) gave before the patch (what wrap got)
    installed: Any  # what apply() set (the raw staticmethod for static patches)


_lock = threading.RLock()
_records: Dict[Tuple[str, str], _Record] = {}


def resolve(path: str) -> Any:
    """The module or class at dotted ``path`` (the longest importable module prefix, then
    attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import any module of {path!r}")


def path_of(obj: Any) -> str:
    """The dotted path :func:`resolve` finds ``obj`` (a module or a module-level class) at."""
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return obj.__name__


def _current(record: _Record) -> Any:
    return vars(record.owner).get(record.patch.attribute, _MISSING)


def apply(patch: Patch) -> Any:
    """Put ``patch`` in place (once: a patch in place stays as it is); returns the replacement
    as the owner now serves it. A patch displaced since (something set the attribute over
    it) wraps what is there now."""
    with _lock:
        try:
            owner = resolve(patch.owner)
        except (ImportError, AttributeError) as error:
            raise PatchError(f"{patch.owner} (for {patch.attribute}, {patch.why}) cannot be "
                             f"found: {error}") from None
        record = _records.get(patch.key)
        # In place on this very owner: nothing to do (a module loaded anew is a new owner).
        if record is not None and record.owner is owner and _current(record) is record.installed:
            if record.patch != patch:
                # One seam, one patch: a second one would be a silent no-op here, and its
                # revert would take the first one out.
                raise PatchError(f"{patch.owner}.{patch.attribute} is already patched by "
                                 f"megatron-flat ({record.patch.why}); a second patch there "
                                 f"({patch.why}) must go through the first")
            return getattr(owner, patch.attribute)
        original = getattr(owner, patch.attribute, _MISSING)
        if patch.classmethod_:
            own = vars(owner).get(patch.attribute)
            original = own.__func__ if isinstance(own, classmethod) else _MISSING
        if original is _MISSING and patch.missing_ok:
            original = None
        elif original is _MISSING or not patch.check(original):
            found = "nothing" if original is _MISSING else type(original).__name__
            raise PatchError(f"{patch.owner}.{patch.attribute} is not {patch.expects} (found "
                             f"{found}); megatron-flat patches it because {patch.why}")
        replacement = patch.wrap(original)
        installed = (staticmethod(replacement) if patch.static else
                     classmethod(replacement) if patch.classmethod_ else replacement)
        own = vars(owner).get(patch.attribute, _MISSING)
        setattr(owner, patch.attribute, installed)
        _records[patch.key] = _Record(patch, owner, own, original, installed)
        return getattr(owner, patch.attribute)


def revert(patch: Patch) -> bool:
    """Take ``patch`` out: the owner's own entry is what it was before :func:`apply`. False
    (and the patch stays recorded) when something replaced the attribute on top of it since:
    restoring would drop that too; False too, touching nothing, when another patch holds the
    seam."""
    with _lock:
        record = _records.get(patch.key)
        if record is None:
            return True
        if record.patch != patch:
            return False  # another patch holds this seam: never take it out
        if _current(record) is not record.installed:
            return False
        if record.own is _MISSING:
            delattr(record.owner, patch.attribute)
        else:
            setattr(record.owner, patch.attribute, record.own)
        del _records[patch.key]
        return True


def is_applied(patch: Patch) -> bool:
    """Whether ``patch`` is in place (applied and not displaced)."""
    with _lock:
        record = _records.get(patch.key)
        return record is not None and _current(record) is record.installed


def original(patch: Patch) -> Optional[Any]:
    """What ``patch`` wrapped (as the owner served it before), or None when not applied."""
    with _lock:
        record = _records.get(patch.key)
        return None if record is None else record.served


def applied() -> List[Patch]:
    """The patches in place, in the order they were applied."""
    with _lock:
        return [r.patch for r in _records.values()]
