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
``cpu.flash_attention`` and the CPU backend's attention run) and the CUDA one (fp16 and
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

Causal self-attention without mask or bias. Attention dropout (the CUDA kernel only; the
CPU kernel has none): the first pass keeps the Philox seed and offset its kernel drew, so the
backward regenerates the same mask, and how far it advanced the generator, so the re-run
advances it as far without the kernel and every later dropout mask (the re-run starts from
the first pass's RNG state, restored by the checkpoint) is unchanged. The caller decides when a no-grad call is a
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
    ``kernel_forwards`` counts the attention kernels this store's calls ran, ``replays``
    the re-runs served without one and ``stock_reruns`` the re-runs that found nothing kept
    and ran the kernel as stock.
    """

    def __init__(self, host: Optional[ReplayHost] = None) -> None:
        self.host = host
        self._kept: Dict[Hashable, Deque[Any]] = {}
        self.kernel_forwards = 0
        self.replays = 0
        self.stock_reruns = 0  # re-runs that found nothing kept and ran the kernel as stock

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
    backward from them, the stock call through autograd (the same kernel), and what a
    replayed call does to the RNG in place of the kernel."""

    def forward(self, q, k, v, scale, dropout_p) -> Tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, meta, scale, dropout_p):
        raise NotImplementedError

    def stock(self, q, k, v, scale, dropout_p) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale)

    def replayed(self, meta: Any, device: torch.device) -> None:
        """Advance the RNG as the skipped kernel would have (nothing without dropout)."""


class _CpuKernel(_Kernel):
    """torch's CPU flash kernel (what ``F.scaled_dot_product_attention`` runs on CPU)."""

    def forward(self, q, k, v, scale, dropout_p):
        out, lse = _FORWARD(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()

    def backward(self, grad_out, q, k, v, out, lse, meta, scale, dropout_p):
        return _BACKWARD(grad_out, q, k, v, out, lse, 0.0, True, scale=scale)


class _CudaFlashKernel(_Kernel):
    """torch's CUDA flash kernel (``SDPBackend.FLASH_ATTENTION``; fp16/bf16). Its backward
    takes, besides (Q, K, V, O, LSE), the sequence bounds and the Philox seed and offset the
    forward returned (its dropout mask): kept as ``meta``, with how far the forward moved
    the device's generator (its Philox offset), which a replayed call moves it instead."""

    def forward(self, q, k, v, scale, dropout_p):
        generator = device_generator(q.device)
        start = generator.get_offset()
        (out, lse, cum_q, cum_k, max_q, max_k, seed, offset,
         _) = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True,
                                                                 False, scale=scale)
        drawn = generator.get_offset() - start
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset, drawn)

    def backward(self, grad_out, q, k, v, out, lse, meta, scale, dropout_p):
        cum_q, cum_k, max_q, max_k, seed, offset, _ = meta
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
            True, seed, offset, scale=scale)

    def stock(self, q, k, v, scale, dropout_p):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  scale=scale)

    def replayed(self, meta, device):
        drawn = meta[-1]
        if drawn:
            generator = device_generator(device)
            generator.set_offset(generator.get_offset() + drawn)


def device_generator(device: torch.device) -> torch.Generator:
    """The device's default generator: what the flash kernel draws from (Megatron's RNG
    tracker swaps its states in and out of it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


_KERNELS = {"cpu": _CpuKernel(), "cuda": _CudaFlashKernel()}


class _Replayed(torch.autograd.Function):
    """O from the first pass as the re-run's output; the backend's backward on what stock's
    autograd node would have saved (Q, K, V, O, LSE and the backend's ``meta``)."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, scale, kernel, meta, dropout_p):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.kernel, ctx.meta, ctx.dropout_p = scale, kernel, meta, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(grad_out, q, k, v, out, lse, ctx.meta, ctx.scale,
                                         ctx.dropout_p)
        return dq, dk, dv, None, None, None, None, None, None


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> _Kernel:
    kernel = _KERNELS.get(q.device.type)
    if kernel is None:
        raise ValueError(f"attention replay runs torch's CPU or CUDA flash kernel; got "
                         f"{q.device} tensors")
    if dropout_p and q.device.type != "cuda":
        raise ValueError(f"attention replay: torch's CPU flash kernel has no dropout; got "
                         f"dropout_p={dropout_p}")
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
                    key: Hashable = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of ``[b, heads, s, d]`` tensors (module docstring): stock without
    ``store``; with one, a no-grad call keeps (O, LSE) under ``key`` and a grad-enabled call
    replays the oldest kept pair of ``key`` when there is one. CPU tensors run torch's CPU
    flash kernel, CUDA ones (fp16/bf16) its CUDA flash kernel, stock and replayed alike;
    ``dropout_p`` (CUDA only) is the attention dropout."""
    if store is None:
        if q.device.type == "cuda":
            return _KERNELS["cuda"].stock(q, k, v, scale, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale)
    kernel = _kernel(q, k, v, dropout_p)
    if not torch.is_grad_enabled():
        out, lse, meta = kernel.forward(q, k, v, scale, dropout_p)
        store.kernel_forwards += 1
        store.keep(key, out, lse, meta=meta)
        return out
    entry = store.take_with_meta(key)
    if entry is None:
        store.kernel_forwards += 1
        store.stock_reruns += 1
        return kernel.stock(q, k, v, scale, dropout_p)
    (out, lse), meta = entry
    if out.shape != q.shape[:-1] + v.shape[-1:]:
        raise RuntimeError(f"attention replay: the kept output {tuple(out.shape)} does not "
                           f"fit this call's query {tuple(q.shape)} (key {key!r}): the re-runs "
                           "did not come in the first passes' order")
    store.replays += 1
    kernel.replayed(meta, q.device)
    return _Replayed.apply(q, k, v, out, lse, scale, kernel, meta, dropout_p)
