"""The planner's tests share their layout searches.

``search_layouts`` is pure (its result depends only on its arguments) and the slowest call in
these tests (4-11 s on the paper presets); the CLI tests, the layout tests and the query-chunk
tests ask it the same questions many times over. Within one pytest process each distinct call
is computed once and every caller gets its own deep copy, so a test that changes what it got
cannot change another test's answer. Calls with an argument that cannot be a key are not
memoised.
"""

from __future__ import annotations

import copy
import functools

import megatron_flat.plan as plan
from megatron_flat.plan import cli, layouts

_SEARCH = getattr(layouts.search_layouts, "__wrapped__", layouts.search_layouts)
_MEMO: dict = {}


def _key(value):
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    hash(value)  # TypeError: not a key
    return value


@functools.wraps(_SEARCH)
def memoised_search_layouts(*args, **kwargs):
    try:
        key = (_key(args), _key(kwargs))
    except TypeError:
        return _SEARCH(*args, **kwargs)
    if key not in _MEMO:
        _MEMO[key] = _SEARCH(*args, **kwargs)
    return copy.deepcopy(_MEMO[key])


for _module in (layouts, cli, plan):
    _module.search_layouts = memoised_search_layouts
