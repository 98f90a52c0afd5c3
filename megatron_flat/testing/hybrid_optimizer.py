"""Megatron's own optimizer CPU offload (``--optimizer-cpu-offload``), built as Megatron builds it.

``hybrid_device_adamw(params, lr, offload_fraction=1.0)`` returns Megatron-Core's
``HybridDeviceOptimizer`` over ``params`` with the arguments ``get_megatron_optimizer`` passes
for ``--optimizer adam --optimizer-cpu-offload`` (torch's AdamW on the CPU with its fused CPU
kernel, the device optimizer for what is not offloaded, fp32 updates, pinned host copies,
copies overlapped on side streams): the baseline that benchmarks compare OffloadStreamAdamW
with. Its optimizer state and fp32 masters live in host memory and its step runs on the CPU.

On CUDA that is the real thing. On a CPU-only machine HybridDeviceOptimizer cannot run as is:
it offloads only parameters whose ``is_cuda`` is true and calls ``torch.cuda`` streams and
``pin_memory()``. :func:`hybrid_device_adamw` then gives it parameters that stand in for device
tensors (``is_cuda`` true, ``pin_memory()`` a plain host copy) and, while the optimizer exists,
the CPU view of ``torch.cuda`` in its module (inline streams). Its own code runs unchanged, so
the bytes it holds are measured exactly; its time means nothing there.
:func:`host_bytes` counts what it holds in host memory.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, List

import torch

__all__ = ["DeviceStandIn", "host_bytes", "hybrid_device_adamw"]


class DeviceStandIn(torch.Tensor):
    """A CPU tensor that HybridDeviceOptimizer takes for a device tensor (CPU runs only)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def pin_memory(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        # The host copy HybridDeviceOptimizer makes of a device param: a plain CPU tensor.
        return self.as_subclass(torch.Tensor).clone()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Results are plain tensors, except the copies HybridDeviceOptimizer makes of a
        # device param before pinning them (detach, clone, cpu), which must stay stand-ins.
        out = super().__torch_function__(func, types, args, kwargs or {})
        name = getattr(func, "__name__", "")
        if name in ("detach", "clone", "cpu") and isinstance(out, torch.Tensor):
            return out
        if isinstance(out, DeviceStandIn):
            return out.as_subclass(torch.Tensor)
        return out


def _module():
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    return hybrid_optimizer


def hybrid_device_adamw(params: List[torch.Tensor], lr: float, *, offload_fraction: float = 1.0,
                        weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8):
    """Megatron's HybridDeviceOptimizer over ``params`` as ``--optimizer-cpu-offload`` builds
    it. On CPU, ``params`` must be :class:`DeviceStandIn` tensors (see :func:`stand_in`)."""
    module = _module()
    cuda = torch.cuda.is_available()
    restore = None
    if not cuda:
        from megatron_flat.cpu import backend as cpu

        if getattr(module, "torch", None) is torch:
            module.torch = cpu.torch_proxy()
            restore = functools.partial(setattr, module, "torch", torch)
    try:
        optimizer = module.HybridDeviceOptimizer(
            [{"params": list(params)}],
            offload_fraction=offload_fraction,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            overlap_cpu_optimizer_d2h_h2d=True,
            pin_cpu_grads=cuda,
            pin_cpu_params=cuda,
            param_update_in_fp32=True,
            lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
            bias_correction=True, fused=True,  # Megatron's CPU optimizer kernel
        )
    except Exception:
        if restore is not None:
            restore()
        raise
    if restore is not None:
        optimizer._flat_restore_torch = restore  # the CPU view stays for its steps
    return optimizer


def stand_in(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors as :class:`DeviceStandIn` leaves (CPU), sharing their storage; their
    ``.grad`` is carried over."""
    out = []
    for t in tensors:
        s = torch.Tensor._make_subclass(DeviceStandIn, t.detach(), t.requires_grad)
        if t.grad is not None:
            s.grad = t.grad
        out.append(s)
    return out


def host_bytes(optimizer) -> int:
    """Bytes of host (CPU) tensors the optimizer holds: host copies of the params, fp32
    masters, host gradients and AdamW state, each storage counted once."""
    seen, total = set(), 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.is_cuda and not isinstance(t, DeviceStandIn):
            return
        if isinstance(t, DeviceStandIn):
            return  # a device param (stand-in)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()

    for sub in optimizer.sub_optimizers:
        for group in sub.param_groups:
            for p in group["params"]:
                add(p)
        for state in sub.state.values():
            for v in state.values():
                add(v)
    for g in optimizer.cpu_copy_map_grad.values():
        add(g)
    for p in optimizer.param_to_fp32_param.values():
        add(p)
    return total
