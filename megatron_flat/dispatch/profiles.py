"""Synthetic routing profiles for dispatch benchmarks and tests (issue 3).

A profile fixes the ``[N, k]`` expert ids of every token deterministically, so every rank of a
benchmark can build the same routing without a router:

* ``"balanced"``: token i slot j -> expert ``(i + j) % E``.
* ``"r/h"`` (e.g. ``"0.8/16"``): the first ``floor(r * N)`` tokens are *hot* and go to the h hot
  experts ``0 .. h-1``; the others are *cold* and go to the ``E - h`` cold experts ``h .. E-1``:

  - hot token i, slot j  -> ``j % h``                        for ``j < h``
  - cold token i, slot j -> ``h + (i + j) % (E - h)``        for ``j < E - h``

  These are the issue's formulas, used verbatim where they give distinct experts. Megatron's
  top-k never routes a token twice to one expert, so slots the formulas would repeat fall over
  to the other group, by the other group's formula:

  - hot token i, slot ``j >= h``      -> ``h + (i + j) % (E - h)``   (when h < k)
  - cold token i, slot ``j >= E - h`` -> ``(i + j) % h``             (when E - h < k)

  Every token then has k distinct experts whenever ``k <= E``.

``floor(r * N)`` is computed exactly (``r`` is parsed as a decimal fraction, so "0.29" of 100
tokens is 29, not 28).
"""

from __future__ import annotations

from fractions import Fraction

import torch

from megatron_flat.dispatch.plan import check_int

__all__ = ["routing_profile"]


def _parse(profile: str, num_experts: int) -> tuple[Fraction, int]:
    """``"r/h"`` -> (r, h), validated against ``num_experts``."""
    bad = (f"routing profile must be 'balanced' or 'r/h' (hot token fraction r in [0, 1], "
           f"h hot experts, e.g. '0.8/16'), got {profile!r}")
    parts = profile.split("/")
    if len(parts) != 2:
        raise ValueError(bad)
    try:
        r = Fraction(parts[0].strip())
        h = int(parts[1].strip())
    except ValueError:
        raise ValueError(bad) from None
    if not 0 <= r <= 1:
        raise ValueError(f"routing profile {profile!r}: hot fraction r must be in [0, 1], got {r}")
    if not 1 <= h <= num_experts:
        raise ValueError(f"routing profile {profile!r}: hot experts h must be in 1..E-1 "
                         f"(E = {num_experts}), got {h}")
    if h == num_experts and r != 1:
        raise ValueError(f"routing profile {profile!r}: h = E = {num_experts} leaves no cold "
                         f"experts for the cold tokens; need h <= E-1 (or r = 1)")
    return r, h


def routing_profile(profile: str, n_tokens: int, num_experts: int, topk: int) -> torch.Tensor:
    """``[n_tokens, topk]`` int64 expert ids of the synthetic routing ``profile``.

    See the module docstring for the rules. Raises ValueError for an unknown profile string,
    r outside [0, 1], h outside 1..E-1 (h = E only when r = 1, i.e. no cold token),
    ``topk > num_experts`` (no distinct routing exists) or non-positive sizes.
    """
    if not isinstance(profile, str):
        raise ValueError(f"routing profile must be a string, got {profile!r}")
    n = check_int("n_tokens", n_tokens, 0)
    e = check_int("num_experts", num_experts, 1)
    k = check_int("topk", topk, 1)
    if k > e:
        raise ValueError(f"topk ({k}) > num_experts ({e}): a token needs k distinct experts")
    i = torch.arange(n, dtype=torch.long).unsqueeze(1)
    j = torch.arange(k, dtype=torch.long).unsqueeze(0)
    if profile.strip() == "balanced":
        return (i + j) % e
    r, h = _parse(profile, e)
    n_hot = int(r * n)  # exact floor: r * n is a non-negative Fraction
    cold_n = e - h
    hot = torch.where(j < h, j % h, h + (i + j) % max(cold_n, 1))
    cold = torch.where(j < cold_n, h + (i + j) % max(cold_n, 1), (i + j) % h)
    return torch.where(i < n_hot, hot, cold)
