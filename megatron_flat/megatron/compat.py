"""The one place that knows which megatron-core release is installed.

Differences between supported releases (0.16.1 and 0.19.x) are gated here, each with the
version and the reason, so the rest of ``megatron_flat.megatron`` stays release-agnostic.
Importing this module does not import megatron-core; ``version()`` does, lazily.
"""

from __future__ import annotations

import functools
from typing import Tuple

SUPPORTED = ((0, 16), (0, 19))


@functools.lru_cache(maxsize=None)
def version() -> Tuple[int, int, int]:
    """The installed megatron-core version as (major, minor, patch)."""
    from megatron.core import package_info

    return (package_info.MAJOR, package_info.MINOR, int(str(package_info.PATCH).split("rc")[0]))


def minor() -> Tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    return version()[:2]


def check_supported() -> None:
    """Raise a clear error on a megatron-core release this package was not built for."""
    mm = minor()
    if not (SUPPORTED[0] <= mm <= SUPPORTED[1]):
        raise RuntimeError(
            f"megatron-flat supports megatron-core {SUPPORTED[0][0]}.{SUPPORTED[0][1]} to "
            f"{SUPPORTED[1][0]}.{SUPPORTED[1][1]}; found {'.'.join(map(str, version()))}"
        )
