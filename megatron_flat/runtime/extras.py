"""Optional accelerators: transformer-engine, NVIDIA apex and triton.

None is required. Each is detected once, lazily, and a failed import of any kind (not
installed, or installed without a working CUDA stack — TE raises OSError/RuntimeError
then) counts as absent, so CPU machines import and run megatron-flat unchanged and GPU
machines pick the extras up when they are really usable.
"""

from __future__ import annotations

import functools
import importlib
from typing import Dict

_MODULES = {
    "transformer_engine": "transformer_engine.pytorch",
    "apex": "apex",
    "triton": "triton",
}


@functools.lru_cache(maxsize=None)
def available(name: str) -> bool:
    """Whether the optional extra ``name`` (a key of ``_MODULES``) imports cleanly here."""
    if name not in _MODULES:
        raise ValueError(f"unknown extra {name!r}; known: {', '.join(_MODULES)}")
    try:
        importlib.import_module(_MODULES[name])
    except Exception:  # any failure means "not usable here", never a crash at import
        return False
    return True


def report() -> Dict[str, bool]:
    """Every optional extra and whether it is usable in this process."""
    return {name: available(name) for name in _MODULES}
