"""The three hooks that ``patches/apply.py`` wires into Megatron-LM's ``pretrain_gpt.py``.

* ``flat_extra_args(previous)`` — the ``extra_args_provider``: ``previous`` (Megatron-LM's own,
  e.g. ModelOpt's, or ``None``) then every ``--flat-*`` flag.
* ``flat_install(args)`` — ``megatron_flat.install(args)`` once the arguments are parsed and
  before the model is built (0.19-era scripts call it right after ``parse_and_validate_args``).
* ``flat_model_provider(model_provider)`` — for 0.16-era scripts, where ``pretrain()`` parses
  the arguments itself: calls ``flat_install(get_args())`` on the first model build, then
  delegates.

Importing this module does not import Megatron-LM; ``megatron.training`` is imported only
when a wrapped model provider runs without an injected ``get_args``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, Optional

from megatron_flat.config import add_flat_args

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def flat_extra_args(previous: Optional[ExtraArgsProvider] = None) -> ExtraArgsProvider:
    """An ``extra_args_provider`` that applies ``previous`` (if any), then ``add_flat_args``.

    ``previous`` may return the parser (Megatron-LM's contract) or ``None`` (it then added
    its flags in place). ``add_flat_args`` is a no-op on a parser that already has the
    flags, so ``previous`` may itself be ``add_flat_args``.
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if previous is not None:
            returned = previous(parser)
            parser = parser if returned is None else returned
        return add_flat_args(parser)

    provider.previous = previous  # type: ignore[attr-defined]
    return provider


def flat_install(args: argparse.Namespace) -> Any:
    """Turn megatron-flat on for parsed Megatron-LM ``args``: ``megatron_flat.install(args)``
    (looked up on the package at call time, so it can be replaced in tests)."""
    import megatron_flat

    return megatron_flat.install(args)


def _megatron_get_args() -> argparse.Namespace:
    from megatron.training import get_args

    return get_args()


def flat_model_provider(
    model_provider: Callable[..., Any],
    *,
    get_args: Optional[Callable[[], argparse.Namespace]] = None,
) -> Callable[..., Any]:
    """Wrap ``model_provider`` so its first call runs ``flat_install(get_args())`` first.

    Later calls (one per virtual pipeline stage, the inference or upcycling copies) only
    delegate. The wrapper takes ``(*args, **kwargs)`` and carries ``model_provider``'s
    attributes (``__name__``, ``__doc__``, ``__wrapped__`` for ``inspect.signature``).
    ``get_args`` defaults to ``megatron.training.get_args``.
    """
    installed = False

    @functools.wraps(model_provider)
    def provider(*args: Any, **kwargs: Any) -> Any:
        nonlocal installed
        if not installed:
            flat_install((get_args or _megatron_get_args)())
            installed = True
        return model_provider(*args, **kwargs)

    return provider


__all__ = ["flat_extra_args", "flat_install", "flat_model_provider"]
