#!/usr/bin/env python3
"""Teach a Megatron-LM checkout's ``pretrain_gpt.py`` the ``--flat-*`` flags.

    python patches/apply.py <Megatron-LM dir> [--revert] [--check] [--dry-run]

The command the README shows. The work is done by ``megatron_flat.patch`` (also
``python -m megatron_flat patch``, which an installed megatron-flat has without this
directory); run from a source checkout, this file finds the package beside it. Loaded as a
module, it exposes that module's names.
"""

import sys
from pathlib import Path

if not __package__:  # run as a script, or loaded by path: the package of this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_flat import patch as _patch  # noqa: E402

globals().update({name: value for name, value in vars(_patch).items()
                  if not name.startswith("__")})

if __name__ == "__main__":
    sys.exit(_patch.run(prog="patches/apply.py"))
