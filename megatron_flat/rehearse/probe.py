"""What a Megatron-LM checkout's own parser makes of a launch line, without running it.

    python -m megatron_flat.rehearse.probe SCRIPT [ARGS...]

``python -m megatron_flat rehearse`` runs this once before the two runs, so the substitutions
it announces (``megatron_flat.rehearse.line``) follow the checkout's real defaults and flag names
rather than a table of one release's. It imports SCRIPT's ``megatron.training.arguments``
(SCRIPT's directory first on ``sys.path``, as the rehearsal's runs have it), parses ARGS with
``parse_args(ignore_unknown_args=True)`` — unknown flags such as ``--flat-*`` are left to the
runs — and prints one line ``PROBE <json>``:

* ``values``: every parsed setting (``dest`` -> value; values that are not JSON become their
  ``str``);
* ``options``: every option string the parser knows -> the number of values it takes (0, 1,
  or -1 for a variable number).

Exit status 0; 1 (with the error on stderr) when the parser cannot be imported or refuses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

MARK = "PROBE "


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _arity(action: argparse.Action) -> int:
    if action.nargs == 0:
        return 0
    if action.nargs is None or action.nargs == "?":
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    return -1  # "*", "+", REMAINDER


def probe(script: Path, argv: List[str]) -> Dict[str, Any]:
    """``{"values": ..., "options": ...}`` of ``argv`` under SCRIPT's checkout's parser."""
    sys.path.insert(0, str(script.resolve().parent))
    sys.argv = [str(script)] + list(argv)
    from megatron_flat.cpu import backend as cpu, training as cpu_training

    cpu_training.shim_python()
    cpu.enable_cpu_backend()
    cpu_training.enable_cpu_training()

    parsers: List[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        parsers.append(self)
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = recording
    try:
        from megatron.training import arguments

        namespace = arguments.parse_args(ignore_unknown_args=True)
    finally:
        argparse.ArgumentParser.parse_known_args = original
    options: Dict[str, int] = {}
    if parsers:
        for action in parsers[0]._actions:
            for option in action.option_strings:
                options[option] = _arity(action)
    return {"values": {k: _plain(v) for k, v in vars(namespace).items()}, "options": options}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print("usage: python -m megatron_flat.rehearse.probe SCRIPT [ARGS...]",
              file=sys.stderr)
        return 2
    try:
        found = probe(Path(argv[0]), argv[1:])
    except SystemExit as exc:  # argparse refused the line
        print(f"the checkout's parser refused the line (exit {exc.code})", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - reported, the rehearsal decides
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(MARK + json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
