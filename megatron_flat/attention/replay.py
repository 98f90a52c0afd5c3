"""Attention replay: under full recompute, the core attention's re-run returns the output of
its first forward instead of running the kernel again.

Full recompute runs every layer's forward twice: once without autograd (the step's forward,
which keeps only the layer's input) and again inside the backward, with autograd, to rebuild
what the layer's backward needs. The core attention is most of that second forward at long
context, and it is deterministic: the re-run's O and log-sum-exp (LSE) are bitwise those of
the first run, given the same Q, K, V, which the re-run rebuilds bitwise from the same
input. So the first run keeps (O, LSE); the re-run takes them back and returns O without the
kernel, saving (Q, K, V, O, LSE) for the backward, which runs the backend's own backward on
exactly what stock's autograd node would have saved. Loss and every gradient are bitwise
stock's; one attention forward per layer per step instead of two.

This module is the kernel-level part, for torch's flash kernels: the CPU one (what
``testing.flash_attention`` and the CPU backend's attention run) and the CUDA one (fp16 and
bf16; its backward also takes the forward's sequence bounds and Philox words, kept beside
the pair):

- :class:`ReplayStore` keeps (O, LSE) per key (a layer) in first-in, first-out order, so
  several microbatches in flight (1F1B, where the forwards of later microbatches run before
  the backward of the first) each get their own back, in the order the re-runs come. With
  a :class:`~megatron_flat.attention.replay_host.ReplayHost` the pairs wait in its host
  pool and come back one layer ahead; without one they stay on the device (device bytes
  L·(O + LSE) per microbatch in flight: for tests and short contexts only).
- :func:`flash_attention` is the core attention: stock (``F.scaled_dot_product_attention``)
  without a store; with one, a no-grad call runs the kernel and keeps its result, and a
  grad-enabled call with something kept replays it (a grad-enabled call with nothing kept,
  e.g. a run without recompute, runs stock).

Causal self-attention without dropout, mask or bias: the first pass consumes no random
numbers, so nothing is advanced in the re-run. The caller decides when a no-grad call is a
recompute region's first pass (a no-grad forward that never re-runs, e.g. evaluation, must
not keep anything: :meth:`ReplayStore.clear` drops what is kept).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, Hashable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_flat.attention.replay_host import HostKept, ReplayHost

__all__ = ["ReplayStore", "flash_attention"]

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class ReplayStore:
    """(O, LSE) of first passes, per key, until their re-runs take them.

    ``host``: the host tier the pairs wait in (shared by every store of a model, so that
    a re-run can start the previous layer's reload); None keeps them on the device.
    ``kernel_forwards`` counts the attention kernels this store's calls ran and
    ``replays`` the re-runs served without one.
    """

    def __init__(self, host: Optional[ReplayHost] = None) -> None:
        self.host = host
        self._kept: Dict[Hashable, Deque[Any]] = {}
        self.kernel_forwards = 0
        self.replays = 0

    def keep(self, key: Hashable, *tensors: torch.Tensor, meta: Any = None) -> bool:
        """Keep ``tensors`` (the call's (O, LSE), or one pair per context-parallel slot) for
        ``key``'s next re-run, with ``meta`` (what else the backend's backward takes, kept as
        is: a few scalars and RNG words); False when the host pool had no room (that re-run
        then runs the kernel)."""
        kept = tensors if self.host is None else self.host.offload(tensors)
        if kept is None:
            return False
        self._kept.setdefault(key, deque()).append((kept, meta))
        return True

    def take_with_meta(self, key: Hashable) -> Optional[Tuple[Tuple[torch.Tensor, ...], Any]]:
        """The oldest kept (tensors, meta) of ``key``, on the device; None when none."""
        queue = self._kept.get(key)
        if not queue:
            return None
        kept, meta = queue.popleft()
        if not queue:
            del self._kept[key]
        if isinstance(kept, HostKept):
            return self.host.take(kept), meta
        return kept, meta

    def take(self, key: Hashable) -> Optional[Tuple[torch.Tensor, ...]]:
        """The oldest kept tensors of ``key``, on the device; None when none."""
        entry = self.take_with_meta(key)
        return None if entry is None else entry[0]

    def peek(self, key: Hashable) -> Optional[Tuple[torch.Tensor, ...]]:
        """The pair the next :meth:`take` of ``key`` returns, left in place (device tier
        only: a pair in the host pool has no device tensors to show)."""
        if self.host is not None:
            raise RuntimeError("ReplayStore.peek: the pairs are in the host pool")
        queue = self._kept.get(key)
        return queue[0][0] if queue else None

    def kept_bytes(self) -> int:
        """Bytes kept now (on the device, or in the host pool with a host tier)."""
        return sum(kept.nbytes if isinstance(kept, HostKept)
                   else sum(t.numel() * t.element_size() for t in kept)
                   for q in self._kept.values() for kept, _ in q)

    def __len__(self) -> int:
        return sum(len(q) for q in self._kept.values())

    def clear(self) -> None:
        self._kept.clear()


class _Kernel:
    """One backend's flash kernel: its forward with the statistics its backward needs, its
    backward from them, and the stock call through autograd (the same kernel)."""

    def forward(self, q, k, v, scale) -> Tuple[torch.Tensor, torch.Tensor, tuple]:
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, meta, scale):
        raise NotImplementedError

    def stock(self, q, k, v, scale) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class _CpuKernel(_Kernel):
    """torch's CPU flash kernel (what ``F.scaled_dot_product_attention`` runs on CPU)."""

    def forward(self, q, k, v, scale):
        out, lse = _FORWARD(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()

    def backward(self, grad_out, q, k, v, out, lse, meta, scale):
        return _BACKWARD(grad_out, q, k, v, out, lse, 0.0, True, scale=scale)


class _CudaFlashKernel(_Kernel):
    """torch's CUDA flash kernel (``SDPBackend.FLASH_ATTENTION``; fp16/bf16). Its backward
    takes, besides (Q, K, V, O, LSE), the sequence bounds and the Philox seed and offset the
    forward returned: kept as ``meta`` (dropout is 0 here, so they select no random
    numbers; kept anyway, as the stock node keeps them)."""

    def forward(self, q, k, v, scale):
        (out, lse, cum_q, cum_k, max_q, max_k, seed, offset,
         _) = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                                 scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, grad_out, q, k, v, out, lse, meta, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = meta
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True,
            seed, offset, scale=scale)

    def stock(self, q, k, v, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


_KERNELS = {"cpu": _CpuKernel(), "cuda": _CudaFlashKernel()}


class _Replayed(torch.autograd.Function):
    """O from the first pass as the re-run's output; the backend's backward on what stock's
    autograd node would have saved (Q, K, V, O, LSE and the backend's ``meta``)."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, scale, kernel, meta):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.kernel, ctx.meta = scale, kernel, meta
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(grad_out, q, k, v, out, lse, ctx.meta, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Kernel:
    kernel = _KERNELS.get(q.device.type)
    if kernel is None:
        raise ValueError(f"attention replay runs torch's CPU or CUDA flash kernel; got "
                         f"{q.device} tensors")
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention replay on CUDA runs the flash kernel, which takes fp16 or "
                         f"bf16; got {q.dtype}")
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"attention replay takes [b, heads, s, d] query, key and value with "
                         f"matching batch and heads; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    return kernel


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: Optional[float] = None, store: Optional[ReplayStore] = None,
                    key: Hashable = None) -> torch.Tensor:
    """Causal attention of ``[b, heads, s, d]`` tensors (module docstring): stock without
    ``store``; with one, a no-grad call keeps (O, LSE) under ``key`` and a grad-enabled call
    replays the oldest kept pair of ``key`` when there is one. CPU tensors run torch's CPU
    flash kernel, CUDA ones (fp16/bf16) its CUDA flash kernel, stock and replayed alike."""
    if store is None:
        if q.device.type == "cuda":
            return _KERNELS["cuda"].stock(q, k, v, scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    kernel = _kernel(q, k, v)
    if not torch.is_grad_enabled():
        out, lse, meta = kernel.forward(q, k, v, scale)
        store.kernel_forwards += 1
        store.keep(key, out, lse, meta=meta)
        return out
    entry = store.take_with_meta(key)
    if entry is None:
        store.kernel_forwards += 1
        return kernel.stock(q, k, v, scale)
    (out, lse), meta = entry
    if out.shape != q.shape[:-1] + v.shape[-1:]:
        raise RuntimeError(f"attention replay: the kept output {tuple(out.shape)} does not "
                           f"fit this call's query {tuple(q.shape)} (key {key!r}): the re-runs "
                           "did not come in the first passes' order")
    store.replays += 1
    return _Replayed.apply(q, k, v, out, lse, scale, kernel, meta)
