"""The three hooks that ``patches/apply.py`` wires into Megatron-LM's ``pretrain_gpt.py``.

* ``flat_extra_args(previous)`` — the ``extra_args_provider``: ``previous`` (Megatron-LM's own,
  e.g. ModelOpt's, or ``None``) then every ``--flat-*`` flag.
* ``flat_install(args)`` — ``megatron_flat.install(args)`` once the arguments are parsed and
  before the model is built (0.19-era scripts call it right after ``parse_and_validate_args``).
* ``flat_model_provider(model_provider)`` — for 0.16-era scripts, where ``pretrain()`` parses
  the arguments itself: calls ``flat_install(get_args())`` on the first model build, then
  delegates.

``--help``: Megatron-LM answers it at its *first* parse, which is not the one given
``extra_args_provider`` (``inprocess_restart.maybe_wrap_for_inprocess_restart`` parses with the
stock parser before ``pretrain()`` / ``parse_and_validate_args`` run). So when the command line
asks for help, importing this module makes every ``megatron.training.arguments.parse_args``
call add the ``--flat-*`` flags (:func:`show_flat_flags_in_help`), and the help lists them.

Otherwise importing this module does not import Megatron-LM; ``megatron.training`` is imported
only when a wrapped model provider runs without an injected ``get_args``, or for ``--help``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
from typing import Any, Callable, Optional, Sequence

from megatron_flat.config import add_flat_args
from megatron_flat.runtime import patching

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


def help_requested(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (``sys.argv``) asks argparse for help (before a ``--`` separator)."""
    rest = list(argv[1:])
    if "--" in rest:
        rest = rest[:rest.index("--")]
    return any(a in ("-h", "--help") for a in rest)


def _flat_flags_always(stock: Callable) -> Callable:
    @functools.wraps(stock)
    def parse_args(extra_args_provider: Optional[ExtraArgsProvider] = None, *args: Any,
                   **kwargs: Any) -> argparse.Namespace:
        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            parser = flat_extra_args(extra_args_provider)(parser)
            _escape_help_percents(parser)
            return parser

        return stock(provider, *args, **kwargs)

    return parse_args


def show_flat_flags_in_help(arguments: Any = None) -> bool:
    """Make ``arguments.parse_args`` (``megatron.training.arguments`` by default) always add
    the ``--flat-*`` flags, so whichever parse answers ``--help`` lists them (a
    ``runtime.patching`` patch). Idempotent; returns False when Megatron-LM's arguments
    module cannot be imported."""
    if arguments is None:
        try:
            arguments = importlib.import_module("megatron.training.arguments")
        except ImportError:
            return False
    if getattr(arguments, "parse_args", None) is None:
        return False
    patching.apply(patching.Patch(
        patching.path_of(arguments), "parse_args", _flat_flags_always, expects="a function",
        why="the parse that answers --help must list the --flat-* flags"))
    return True


_PERCENT = re.compile(r"%%|%\(|%")


def _escape_lone_percents(text: str) -> str:
    """``text`` with every "%" that is neither "%%" nor the start of "%(name)s" doubled."""
    return _PERCENT.sub(lambda m: m.group(0) if len(m.group(0)) == 2 else "%%", text)


def _escape_help_percents(parser: argparse.ArgumentParser) -> None:
    # argparse %-formats every help string; a literal "%" not written "%%" (Megatron-LM
    # 0.19.0's --moe-paged-stash-buffer-size-factor-cuda: "10%).") makes --help raise.
    for action in parser._actions:
        if isinstance(action.help, str) and "%" in action.help:
            action.help = _escape_lone_percents(action.help)


if help_requested(sys.argv):
    show_flat_flags_in_help()


__all__ = ["flat_extra_args", "flat_install", "flat_model_provider", "help_requested",
           "show_flat_flags_in_help"]
