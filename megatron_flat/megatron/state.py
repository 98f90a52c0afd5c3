"""What every piece of the Megatron glue shares: the FlatConfig in force and the one error.

A leaf: it imports nothing of the glue, so ``install`` (which wires the techniques) imports
the glue and the glue imports this, and imports run one way. ``install.install`` is the only
writer of the installed FlatConfig; everyone else reads it with :func:`installed`.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_flat.config import FlatConfig

_INSTALLED: Optional[FlatConfig] = None


class FlatConfigError(ValueError):
    """The FlatConfig does not fit the Megatron configuration; lists every reason."""


def installed() -> Optional[FlatConfig]:
    """The FlatConfig installed in this process, or None."""
    return _INSTALLED


def set_installed(flat: Optional[FlatConfig]) -> None:
    """Record ``flat`` as installed (``install.install``), or forget it (None: tests)."""
    global _INSTALLED
    _INSTALLED = flat


def setting(source: Any, *names: str, default: Any = None) -> Any:
    """First attribute of ``source`` found under ``names`` (Megatron-LM's args use other
    names than TransformerConfig for a few settings); ``default`` when none is, or when
    ``source`` is None."""
    for name in names:
        if source is not None and hasattr(source, name):
            return getattr(source, name)
    return default
