"""Online log-sum-exp: fold logit strips into a per-token state, one strip at a time.

Per token the state is ``(m, z, t)``: ``m`` the running maximum of the logits seen so far,
``z`` the running sum of ``exp(logit - m)``, ``t`` the target's logit (0 until the strip
holding the target is folded). Folding a strip ``Y`` (``[N, S]``, its columns being vocab
ids ``start .. start + S - 1``)::

    m' = max(m, max_j Y_j)
    z' = z * exp(m - m') + sum_j exp(Y_j - m')
    t' = Y[label - start]   where start <= label < start + S, else t

After every strip of the vocabulary has been folded, exactly once and in any order,
``m + log z`` is the log-sum-exp of the row and ``m + log z - t`` its cross-entropy.
Two states over disjoint vocab ranges combine with :func:`merge` (same rule, a strip of
one "logit" ``m_b`` with weight ``z_b``), which is how Ring-DTP joins a partial state that
travelled the ring with the one a rank just folded.

Everything here is pure: tensors in, a new state out; :func:`fold` may reuse the strip's
buffer as scratch when told to (``overwrite=True``), so folding costs no second strip.
The state dtype is the accumulation dtype (float32, or float64 for float64 strips); strips
of any float dtype are upcast on the fly.

Empty rows and ``-inf``: a state that has seen only ``-inf`` logits (or nothing) has
``m = -inf, z = 0``; folding keeps it finite-safe (no ``-inf - -inf`` NaN), and
:func:`logsumexp` of such a row is ``-inf``. ``+inf`` or NaN logits propagate NaN/inf as in
:func:`torch.logsumexp`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = [
    "LSEState",
    "accumulation_dtype",
    "init_state",
    "fold",
    "merge",
    "logsumexp",
    "cross_entropy",
]


class LSEState(NamedTuple):
    """Per-token online log-sum-exp state; three ``[N]`` tensors of the accumulation dtype."""

    m: torch.Tensor  # running max
    z: torch.Tensor  # running sum of exp(logit - m)
    t: torch.Tensor  # target logit (0 until found)

    def pack(self) -> torch.Tensor:
        """``[3, N]`` tensor (one buffer to send over the ring)."""
        return torch.stack((self.m, self.z, self.t))

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "LSEState":
        return cls(packed[0], packed[1], packed[2])


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 inputs; float64 stays float64."""
    if not dtype.is_floating_point:
        raise TypeError(f"expected a floating dtype, got {dtype}")
    return torch.promote_types(dtype, torch.float32)


def init_state(
    n: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> LSEState:
    """The state of ``n`` tokens before any strip: ``m = -inf, z = 0, t = 0``."""
    return LSEState(
        torch.full((n,), float("-inf"), device=device, dtype=dtype),
        torch.zeros(n, device=device, dtype=dtype),
        torch.zeros(n, device=device, dtype=dtype),
    )


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` replaced by 0, so ``x - m`` never computes ``-inf - -inf``."""
    return torch.where(torch.isneginf(m), torch.zeros((), dtype=m.dtype, device=m.device), m)


def fold(
    state: LSEState,
    logits: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    start: int = 0,
    *,
    overwrite: bool = False,
) -> LSEState:
    """Fold a strip ``logits [N, S]`` (vocab ids ``start .. start+S-1``) into ``state``.

    ``labels [N]`` (integer vocab ids; any id outside the strip is left alone, so
    ``ignore_index`` needs no special case) selects the target logit. With
    ``overwrite=True`` and ``logits`` already of the state dtype, the strip's buffer is
    used as scratch and holds garbage afterwards. Returns a new state; ``state`` is not
    modified. An empty strip (``S == 0``) returns ``state`` unchanged.
    """
    m, z, t = state
    if logits.dim() != 2 or logits.shape[0] != m.shape[0]:
        raise ValueError(f"logits must be [N={m.shape[0]}, S], got {tuple(logits.shape)}")
    width = logits.shape[1]
    if width == 0:
        return state
    y = logits if overwrite and logits.dtype == m.dtype else logits.to(m.dtype, copy=True)

    if labels is not None:
        local = labels - start
        hit = (local >= 0) & (local < width)
        picked = y.gather(1, torch.where(hit, local, 0).unsqueeze(1)).squeeze(1)
        t = torch.where(hit, picked, t)

    m_new = torch.maximum(m, y.amax(dim=1))
    shift = _finite_or_zero(m_new)
    # z * exp(m - m'): m = -inf gives exp(-inf) = 0 (z is 0 there anyway).
    z_new = z * torch.exp(m - shift)
    y.sub_(shift.unsqueeze(1)).exp_()
    z_new = z_new + y.sum(dim=1)
    return LSEState(m_new, z_new, t)


def merge(a: LSEState, b: LSEState, b_has_target: Optional[torch.Tensor] = None) -> LSEState:
    """Combine two states folded over disjoint vocab ranges (commutative up to rounding).

    The target logit is ``a.t + b.t`` (each is 0 unless its range held the target); pass
    ``b_has_target`` (bool ``[N]``) to take ``b.t`` where it is set and ``a.t`` elsewhere
    instead.
    """
    m = torch.maximum(a.m, b.m)
    shift = _finite_or_zero(m)
    z = a.z * torch.exp(a.m - shift) + b.z * torch.exp(b.m - shift)
    t = a.t + b.t if b_has_target is None else torch.where(b_has_target, b.t, a.t)
    return LSEState(m, z, t)


def logsumexp(state: LSEState) -> torch.Tensor:
    """``m + log z`` per token (``-inf`` for a token that has seen no finite logit)."""
    return state.m + torch.log(state.z)


def cross_entropy(state: LSEState) -> torch.Tensor:
    """``m + log z - t`` per token; meaningful once every strip has been folded."""
    return logsumexp(state) - state.t
