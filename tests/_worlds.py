"""Parametrising one test over several world sizes (files named ``*_worlds.py``).

Each case carries the ``world(N)`` mark of its size, so a torchrun session of N ranks runs
exactly the cases of N (tests/conftest.py deselects the others); ``tests/_megatron_use.py``
lists every ``*_worlds.py`` file for each size here (its ``WORLD_SIZES``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import pytest

_MARKS = {2: pytest.mark.world(2), 4: pytest.mark.world(4)}

WORLDS = [pytest.param(n, marks=mark, id=f"world{n}") for n, mark in _MARKS.items()]


def per_world(table: Dict[int, Iterable[str]]) -> List:
    """``(world, name)`` cases of ``table`` (world size -> case names), each marked with its
    world size and named ``world<N>-<name>``."""
    return [pytest.param(world, name, marks=_MARKS[world], id=f"world{world}-{name}")
            for world, names in table.items() for name in names]
