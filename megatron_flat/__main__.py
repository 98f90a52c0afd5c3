"""``python -m megatron_flat <command> [...]``: one entry point, one module per command.

A command is a module with ``main(argv, prog) -> int``; add one by adding a row to
``COMMANDS`` (imported only when run, so commands stay independent).
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "plan": ("megatron_flat.plan.cli",
             "predict the memory peaks, pick the knobs, find the longest context that fits"),
    "patch": ("megatron_flat.patch",
              "teach a Megatron-LM checkout's pretrain_gpt.py the --flat-* flags "
              "(--check, --revert, --dry-run)"),
    "rehearse": ("megatron_flat.rehearse.command",
                 "run a Megatron-LM launch line on CPU, stock and flat: losses side by side, "
                 "peaks, a verdict"),
}


def _usage() -> str:
    rows = "\n".join(f"  {name:8s}{help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: python -m megatron_flat <command> [options]\n\ncommands:\n{rows}\n"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"python -m megatron_flat: unknown command {name!r}\n\n{_usage()}", end="",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"python -m megatron_flat {name}")


if __name__ == "__main__":
    sys.exit(main())
