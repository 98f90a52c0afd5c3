"""OffloadStreamAdamW: AdamW with host-resident state, updated on the device bucket by bucket.

architecture.md §2.4. The fp32 master weights and both moments live in host memory (a
:class:`~megatron_flat.runtime.HostPool`, pinned on CUDA); the model's parameters stay
where they are, in their own dtype. A step streams buckets (``bucket_numel`` elements,
planned by :mod:`megatron_flat.optim.buckets`) through ``num_slots`` device staging slots
(:mod:`megatron_flat.optim.pipeline`):

    upload   master, exp_avg, exp_avg_sq (host → device); a grad only when it is not fp32
             on the update's device (then cast to fp32 into the slot)
    update   torch's own AdamW kernel on the slot's views (fp32 grads where they are)
    write-back  master, exp_avg, exp_avg_sq (device → host), and the new master into the
             model parameter (cast to its dtype)

Memory
    Device: exactly ``num_slots x largest bucket x 12`` bytes of staging (allocated by
    :meth:`prepare`; fp32 gradients on the update's device are read in place, others are
    staged as fp32 from the first step that has them: ``x 16``), plus the update kernel's
    scratch while it runs: none for ``fused=True``, 4 bytes per element of the bucket for
    ``foreach`` (torch's ``sqrt(exp_avg_sq)`` temporary), 8 bytes per element of the largest
    piece for the single-tensor kernel (``sqrt`` and the division, live together). Host: 8
    bytes per element (exp_avg, exp_avg_sq) plus 4 bytes per element of low-precision
    parameters (their fp32 master). An fp32 parameter is its own master: it is uploaded from
    where it lives and written back in place, and no host copy of it is kept.

Kernel
    A group's ``foreach``/``fused`` settings pick torch's AdamW kernel. Both None (the
    default) means the fused kernel on CUDA — one launch per bucket and group, no scratch —
    and torch's own default elsewhere (the single-tensor loop on CPU); anything else is
    passed to torch as given. :attr:`kernels` names what each group runs.

Exactness
    The update calls ``torch.optim.adamw.adamw`` — the functional kernel behind
    ``torch.optim.AdamW.step`` — with the group's hyperparameters and the kernel above.
    A parameter's pieces get its step count, so every element sees exactly the arithmetic
    of ``torch.optim.AdamW`` with the same kernel run unbucketed on the same device:
    results are bitwise equal (on CUDA by default that is ``torch.optim.AdamW(...,
    fused=True)``). Split points are aligned (see buckets.py) so that holds for the fused
    CPU kernel too (for ``bucket_numel >= 64``).

Skipping a step
    ``pre_step_check`` (constructor argument or attribute): a callable run by
    :meth:`step` after the closure and the gradient checks, before anything is touched.
    Global operations go there — gradient-norm clipping, an inf/nan check over all
    gradients — and they finish before any bucket is uploaded (gradients are read after
    it, so it may clip them in place or replace them). If it returns False the step is
    skipped and every byte of optimizer state and every parameter is left unchanged
    (``skipped_steps`` counts). Bad input (sparse or misshapen gradients, a negative lr
    set by hand) raises before anything is touched too.

State dict (:meth:`state_dict`), the same shape as ``torch.optim.AdamW``'s::

    {"state": {i: {"step": fp32 0-d CPU tensor,
                   "exp_avg": fp32 CPU tensor shaped like param i,
                   "exp_avg_sq": same,
                   "master": same, only when param i is not float32}},
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                       "foreach", "fused", ..., "params": [i, ...]}]}

    ``i`` numbers the parameters in param-group order; parameters that were never
    stepped have no entry. Tensors are compact copies (safe to ``torch.save``). Nothing
    about buckets or slots is stored, so it loads into an optimizer with any
    ``bucket_numel``/``num_slots``/device, and it is interchangeable with
    ``torch.optim.AdamW``'s state dict for fp32 parameters. :meth:`load_state_dict`
    copies values into the host buffers (no parameter is touched; for a low-precision
    parameter whose entry has no ``master`` the master is taken from the parameter);
    every entry is validated before anything is written.

Live state
    ``optimizer.state[p]`` holds views of the host buffers (what Megatron's checkpointing
    reads and ``copy_``-s into). A tensor assigned there from outside (for example
    ``zeros_like`` placeholders) is adopted — copied into the host buffer — at the next
    step, ``state_dict`` or ``prepare``. For a low-precision parameter the host master is
    the source of truth after its first step: after changing such a parameter outside the
    optimizer, call :meth:`reload_model_params`.

Planning
    The bucket plan, host buffers and staging slots are made by :meth:`prepare`, called
    by the first ``step``/``state_dict``/``load_state_dict``; if the parameters in
    ``param_groups`` change (Megatron's wrappers swap model params for main params and
    then call ``load_state_dict(state_dict())``), the next of these calls re-plans,
    carrying over the state of parameters that remain (views of the old host buffers
    taken before a re-plan are stale afterwards). ``zero_grad`` is torch's: it clears
    ``.grad`` (not a custom ``grad_attr``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch.optim.adamw import adamw as _adamw_kernel

from megatron_flat.optim.buckets import (
    SPLIT_ALIGN,
    Bucket,
    BucketPlan,
    Segment,
    coalesce,
    plan_buckets,
)
from megatron_flat.optim.host_state import HostState
from megatron_flat.runtime.staging import upload_together
from megatron_flat.runtime.streams import copy
from megatron_flat.optim.pipeline import Slot, StagingPipeline
from megatron_flat.runtime import HostPool

__all__ = ["OffloadStreamAdamW"]

DeviceLike = Union[str, int, torch.device, None]
_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _scalar_dtype() -> torch.dtype:
    """The dtype torch gives a non-fused AdamW 'step' (float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _fused_devices() -> list[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ["cuda"]


def resolve_kernel(group: dict[str, Any], device: torch.device) -> dict[str, Optional[bool]]:
    """The ``foreach``/``fused`` arguments the update passes to torch's AdamW kernel for
    ``group`` on ``device``: both unset means fused on CUDA, torch's default elsewhere."""
    foreach, fused = group.get("foreach"), group.get("fused")
    if foreach is None and fused is None and device.type == "cuda":
        return {"foreach": None, "fused": True}
    return {"foreach": foreach, "fused": fused}


def kernel_name(kernel: dict[str, Optional[bool]], device: torch.device) -> str:
    """"fused", "foreach" or "single" (the per-tensor loop): what torch runs for ``kernel``."""
    if kernel["fused"]:
        return "fused"
    if kernel["foreach"] is None:  # torch's default: foreach on CUDA tensors, else the loop
        return "foreach" if device.type == "cuda" else "single"
    return "foreach" if kernel["foreach"] else "single"


def check_hyperparameters(group: dict[str, Any]) -> None:
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    betas = group["betas"]
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2 or not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid betas: {betas!r} (each in [0, 1))")
    if not 0.0 <= wd:
        raise ValueError(f"Invalid weight_decay value: {wd}")
    if group.get("amsgrad", False):
        raise ValueError("OffloadStreamAdamW does not implement amsgrad")
    if group.get("foreach") and group.get("fused"):
        raise ValueError("`fused` and `foreach` cannot be `True` together")


def check_param(p: torch.Tensor) -> None:
    if p.is_sparse or p.layout != torch.strided:
        raise ValueError("OffloadStreamAdamW needs dense (strided) parameters")
    if torch.is_complex(p):
        raise ValueError("OffloadStreamAdamW does not support complex parameters")
    if not torch.is_floating_point(p):
        raise ValueError(f"OffloadStreamAdamW needs floating-point parameters, got {p.dtype}")
    if not p.is_contiguous():
        raise ValueError("OffloadStreamAdamW needs contiguous parameters")


class _Work:
    """What one bucket copies and updates in this step (only segments whose param has a grad).

    ``groups``: per param group present, its segments and their step tensors (filled by
    :meth:`OffloadStreamAdamW._attach_steps` before the pipeline starts).
    """

    __slots__ = ("bucket", "segments", "state_runs", "master_runs", "self_master", "groups")

    def __init__(self, bucket: Bucket, active: list[bool], low: list[bool],
                 group_of: list[int]) -> None:
        segs = bucket.segments
        keep = [active[s.param_index] for s in segs]
        self.bucket = bucket
        self.segments = [s for s, k in zip(segs, keep) if k]
        self.state_runs = coalesce(segs, keep)
        self.master_runs = coalesce(segs, [k and low[s.param_index] for s, k in zip(segs, keep)])
        self.self_master = [s for s in self.segments if not low[s.param_index]]
        by_group: dict[int, list[Segment]] = {}
        for seg in self.segments:
            by_group.setdefault(group_of[seg.param_index], []).append(seg)
        self.groups: list[tuple[int, list[Segment], list[torch.Tensor]]] = [
            (gi, group_segs, []) for gi, group_segs in by_group.items()
        ]


class OffloadStreamAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in host memory (module docstring).

    Args:
        params: parameters or param-group dicts, as for any torch optimizer. Dense,
            contiguous, floating point (not complex), any dtype and device.
        lr, betas, eps, weight_decay: AdamW hyperparameters (per group overridable).
        bucket_numel: elements per bucket (>= 1). Staging is ``num_slots x largest
            bucket x 12`` bytes on the device (fp32 master and moments; fp32 gradients on
            the device are read in place), ``x 16`` once a gradient of another dtype or
            device must be staged.
        num_slots: device staging slots (>= 1); 2 overlaps upload and write-back on CUDA.
        device: where updates run; None = the first CUDA parameter's device, else CUDA
            when available, else CPU.
        foreach, fused: torch AdamW's kernel choice (both None: fused on CUDA, torch's
            default elsewhere; see :attr:`kernels`).
        host_pool: a shared :class:`HostPool` for the host state; None = a private pool
            sized exactly. No room in the pool → pageable memory, one warning.
        pre_step_check: ``() -> bool`` run before any update; False skips the step.
        grad_attr: the attribute holding each parameter's gradient ("grad"). Any float
            dtype with the parameter's element count is accepted, so "main_grad" takes
            Megatron's fp32 gradient buffers for bf16 parameters (``.grad`` must match
            the parameter's dtype; an attribute need not).
    """

    #: Name of a low-precision parameter's fp32 master in ``state[p]`` and the state dict.
    master_key = "master"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        bucket_numel: int = 100_000_000,
        num_slots: int = 2,
        device: DeviceLike = None,
        *,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        host_pool: Optional[HostPool] = None,
        pre_step_check: Optional[Callable[[], bool]] = None,
        grad_attr: str = "grad",
    ) -> None:
        for name, value in (("bucket_numel", bucket_numel), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if host_pool is not None and not isinstance(host_pool, HostPool):
            raise TypeError(f"host_pool must be a HostPool, got {type(host_pool).__name__}")
        if not isinstance(grad_attr, str) or not grad_attr:
            raise TypeError(f"grad_attr must be an attribute name, got {grad_attr!r}")
        self.grad_attr = grad_attr
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            amsgrad=False, maximize=False, foreach=foreach, fused=fused,
        )
        check_hyperparameters(defaults)
        self.bucket_numel = bucket_numel
        self.num_slots = num_slots
        self.pre_step_check = pre_step_check
        self.skipped_steps = 0
        self._host_pool = host_pool
        self._params: tuple[torch.Tensor, ...] = ()
        self._layout: tuple[int, ...] = ()
        self._plan: Optional[BucketPlan] = None
        self._host: Optional[HostState] = None
        self._pipeline: Optional[StagingPipeline] = None
        self._warned_fallback = False
        self._views_in_state_dict = 0
        super().__init__(params, defaults)
        self.device = self._resolve_device(device)
        if any(g["fused"] for g in self.param_groups):
            self._check_fused_device()

    # -- construction helpers -----------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, plus validation; groups added after planning trigger a re-plan."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = tuple(group["betas"])
        try:
            check_hyperparameters(group)
            params = group["params"]
            if len(set(params)) != len(params):
                raise ValueError("a parameter group holds the same parameter twice")
            for p in params:
                check_param(p)
            if group["fused"] and hasattr(self, "device"):
                self._check_fused_device()
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def _resolve_device(self, device: DeviceLike) -> torch.device:
        if device is not None:
            resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            if resolved.type == "cuda" and resolved.index is None:
                resolved = torch.device("cuda", torch.cuda.current_device())
            if resolved.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be cpu or cuda, got {resolved}")
            return resolved
        for p in self._all_params():
            if p.is_cuda:
                return p.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_fused_device(self) -> None:
        if self.device.type not in _fused_devices():
            raise ValueError(f"fused=True has no AdamW kernel on {self.device.type}")

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    # -- planning ---------------------------------------------------------------

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan (plans on first use)."""
        self.prepare()
        assert self._plan is not None
        return self._plan

    @property
    def kernels(self) -> list[str]:
        """Per param group, the AdamW kernel the update runs: "fused", "foreach", "single"."""
        return [kernel_name(resolve_kernel(g, self.device), self.device)
                for g in self.param_groups]

    @property
    def staging_bytes(self) -> int:
        """Device staging bytes: ``num_slots x largest bucket x 12``, 16 once gradients are
        staged (plans on first use)."""
        self.prepare()
        assert self._pipeline is not None
        return self._pipeline.nbytes

    @property
    def host_bytes(self) -> int:
        """Bytes of host state buffers (pool or fallback; plans on first use)."""
        self.prepare()
        assert self._host is not None
        return self._host.nbytes

    @property
    def host_pinned(self) -> bool:
        """True when every host buffer is pinned (page-locked) memory (plans on first use)."""
        self.prepare()
        assert self._host is not None
        return all(self._host.pinned.values())

    @property
    def host_fallbacks(self) -> list[str]:
        """Host buffers that are pageable memory because the pool had no room."""
        self.prepare()
        assert self._host is not None
        return list(self._host.fallbacks)

    def close(self) -> None:
        """Give back the host state and the staging slots once the copies in flight have
        ended (``megatron_flat.release``); the state is dropped and the optimizer refuses
        to step or plan again. Idempotent."""
        if self._pipeline is not None:
            self._pipeline.synchronize()
        if self._host is not None:
            self._host.release()
        self._host = self._pipeline = self._plan = None
        self.state.clear()
        self._params = ()
        self._closed = True

    def prepare(self) -> None:
        """Plan buckets and allocate host buffers and staging, if not done for these params.

        Idempotent. Re-plans when the parameters in ``param_groups`` changed, carrying
        over the state of parameters still present; state of removed ones is dropped.
        """
        if getattr(self, "_closed", False):
            raise RuntimeError("OffloadStreamAdamW: closed (its model was released)")
        params = tuple(self._all_params())
        layout = tuple(len(g["params"]) for g in self.param_groups)
        if (self._plan is not None and layout == self._layout
                and all(a is b for a, b in zip(params, self._params))):
            return
        if len(set(params)) != len(params):
            raise ValueError("a parameter appears more than once in param_groups")
        for p in params:
            check_param(p)
        # Keep the state of parameters that remain (compact copies), then rebuild.
        if self._host is not None:
            self._pipeline.synchronize()
            kept = set(params)
            carried = {
                p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                for p, st in self.state.items()
                if p in kept and st
            }
            self.state = defaultdict(dict, carried)
            self._host.release()
            self._host = self._pipeline = None
        self._params = params
        self._layout = layout
        self._low = [p.dtype != torch.float32 for p in params]
        self._plan = plan_buckets([p.numel() for p in params], self.bucket_numel, align=SPLIT_ALIGN)
        offsets = self._plan.param_offsets
        low_idx = [i for i, low in enumerate(self._low) if low]
        if low_idx:
            self._master_base = offsets[low_idx[0]]
            master_numel = offsets[low_idx[-1]] + params[low_idx[-1]].numel() - self._master_base
        else:
            self._master_base, master_numel = 0, 0
        self._host = HostState(self._plan.flat_numel, master_numel, self._host_pool)
        self._pipeline = StagingPipeline(self.device, self.num_slots, self._plan.largest_numel)
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._views = [self._param_views(i) for i in range(len(params))]
        # Each copy's non_blocking is what it is on a GPU (pinned host memory or device data),
        # passed on CPU too, where the pool stands for pinned memory: CPU copies are done at
        # once either way, and the cost ledger counts a blocking copy as a host sync.
        cuda = self.device.type == "cuda"
        self._nb_host = {k: pinned if cuda else k not in self._host.fallbacks
                         for k, pinned in self._host.pinned.items()}
        self._nb_param = [not cuda or p.is_cuda or p.is_pinned() for p in params]
        if self._host.fallbacks and not self._warned_fallback:
            self._warned_fallback = True
            warnings.warn(
                "OffloadStreamAdamW: the host pool could not hold "
                f"{', '.join(self._host.fallbacks)}; using pageable host memory instead "
                "(correct, but host-device copies are slower)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._reconcile()

    def _param_views(self, i: int) -> dict[str, torch.Tensor]:
        p, off, n = self._params[i], self._plan.param_offsets[i], self._params[i].numel()
        views = {
            "exp_avg": self._host.exp_avg[off : off + n].view(p.shape),
            "exp_avg_sq": self._host.exp_avg_sq[off : off + n].view(p.shape),
        }
        if self._low[i]:
            m = off - self._master_base
            views["master"] = self._host.master[m : m + n].view(p.shape)
        return views

    # -- state ------------------------------------------------------------------

    def _reconcile(self, init: Optional[list[bool]] = None) -> None:
        """Make ``self.state`` hold host views: adopt foreign tensors, init where asked.

        ``init[i]``: parameter i is about to be stepped, so empty state is created
        (step 0, zero moments, master from the parameter) as torch does lazily.
        """
        for i, p in enumerate(self._params):
            st = self.state.get(p)
            if not st:
                if init is None or not init[i]:
                    continue
                st = self.state[p]
            views = self._views[i]
            for key in _STATE_KEYS:
                value = st.get(key)
                if value is views[key]:
                    continue
                if value is None:
                    views[key].zero_()
                else:
                    views[key].copy_(value.detach().reshape(views[key].shape))
                st[key] = views[key]
            if self._low[i]:
                value = st.get(self.master_key)
                if value is not views["master"]:
                    source = p if value is None else value
                    views["master"].copy_(source.detach().reshape(p.shape))
                    st[self.master_key] = views["master"]
            else:
                st.pop(self.master_key, None)  # an fp32 parameter is its own master
            step = st.get("step")
            if not (torch.is_tensor(step) and step.device.type == "cpu"
                    and step.dtype == _scalar_dtype() and step.dim() == 0):
                value = 0.0 if step is None else float(step)
                st["step"] = torch.tensor(value, dtype=_scalar_dtype())

    def synchronize(self) -> None:
        """Wait for in-flight pipeline work (``step`` already returns after it)."""
        if self._pipeline is not None:
            self._pipeline.synchronize()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the host master of low-precision parameters from the parameters.

        For after the model's weights were changed outside the optimizer (Megatron calls
        a method of this name after loading a checkpoint without optimizer state).
        Parameters never stepped need nothing: their master is taken at their first step.
        """
        self.prepare()
        for i, p in enumerate(self._params):
            if self._low[i] and self.state.get(p):
                self._views[i]["master"].copy_(p.detach())

    @contextlib.contextmanager
    def state_dict_views(self) -> Iterator[None]:
        """Inside the block, :meth:`state_dict` holds views of the host state instead of
        compact copies (``step`` is still a copy): for callers that only read it before the
        next step, such as Megatron's distributed optimizer, which keeps only the param
        groups. Saves 8–12 B per parameter of transient host memory per call."""
        self._views_in_state_dict += 1
        try:
            yield
        finally:
            self._views_in_state_dict -= 1

    def state_dict(self) -> dict[str, Any]:
        """AdamW-shaped state dict of compact CPU copies (format: module docstring; views
        inside :meth:`state_dict_views`)."""
        self.prepare()
        self.synchronize()
        self._reconcile()
        packed = super().state_dict()
        views = self._views_in_state_dict > 0
        packed["state"] = {
            k: {n: (v.detach() if views and n != "step" else v.detach().clone())
                if torch.is_tensor(v) else v for n, v in st.items()}
            for k, st in packed["state"].items()
        }
        packed["param_groups"] = deepcopy(packed["param_groups"])
        return packed

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or ``torch.optim.AdamW``.

        Validates every group and entry first (counts, sizes, hyperparameters), then
        copies into the host buffers. Model parameters are not touched.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.prepare()
        self.synchronize()
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size "
                "of optimizer's group"
            )
        id_map = dict(zip(
            chain.from_iterable(s["params"] for s in saved_groups),
            chain.from_iterable(g["params"] for g in groups),
        ))
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            merged = dict(self.defaults)
            merged.update(saved)
            merged["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                merged["param_names"] = group["param_names"]
            merged["betas"] = tuple(merged["betas"])
            check_hyperparameters(merged)
            new_groups.append(merged)
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            if key not in id_map:
                continue
            p = id_map[key]
            for name in (*_STATE_KEYS, self.master_key):
                value = entry.get(name)
                if value is not None and (not torch.is_tensor(value) or value.numel() != p.numel()):
                    raise ValueError(
                        f"state of parameter {key}: {name!r} has "
                        f"{value.numel() if torch.is_tensor(value) else type(value).__name__}"
                        f" elements, the parameter {p.numel()}"
                    )
            if entry and "step" not in entry:
                raise ValueError(f"state of parameter {key} has no 'step'")
            new_state[p] = dict(entry)
        if any(g["fused"] for g in new_groups) and self.device.type not in _fused_devices():
            raise ValueError(f"fused=True has no AdamW kernel on {self.device.type}")
        self.param_groups[:] = new_groups
        self.state = defaultdict(dict, new_state)
        self._reconcile()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- the step -----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW step over the parameters that have a grad (see module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare()
        for group in self.param_groups:
            check_hyperparameters(group)
        active, grads = self._collect_grads()  # validates before the hook runs
        if self.pre_step_check is not None:
            if not self.pre_step_check():
                self.skipped_steps += 1
                return loss
            # Again: the hook may have replaced gradients (clipping in place is seen anyway).
            active, grads = self._collect_grads()
        if not any(active):
            return loss
        self._reconcile(init=active)
        self._grads = grads
        if not all(in_place for _, _, in_place in grads.values()):
            self._pipeline.stage_grads()  # once: these gradients go through a staging slot
        works = []
        for bucket in self._plan.buckets:
            work = _Work(bucket, active, self._low, self._group_of)
            if work.segments:
                works.append(work)
        self._attach_steps(works)
        try:
            self._pipeline.run(works, self._upload, self._update, self._writeback)
        finally:
            self._grads = {}
        for i, p in enumerate(self._params):
            if active[i]:
                self.state[p]["step"] += 1
        return loss

    def _collect_grads(self) -> tuple[list[bool], dict[int, tuple[torch.Tensor, bool, bool]]]:
        """Which parameters have a gradient, and each one flat with its copy mode and whether
        the update reads it in place (fp32 on the update's device: no staging, no copy)."""
        active = [False] * len(self._params)
        grads: dict[int, tuple[torch.Tensor, bool, bool]] = {}
        cuda = self.device.type == "cuda"
        for i, p in enumerate(self._params):
            g = getattr(p, self.grad_attr, None)
            if g is None:
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError("OffloadStreamAdamW does not support sparse gradients")
            if g.numel() != p.numel() or not torch.is_floating_point(g):
                raise RuntimeError(
                    f"{self.grad_attr} of shape {tuple(g.shape)} and dtype {g.dtype} for a "
                    f"parameter of shape {tuple(p.shape)}"
                )
            active[i] = True
            flat = g.detach().reshape(-1)
            in_place = flat.dtype == torch.float32 and flat.device == self.device
            grads[i] = (flat, not cuda or g.is_cuda or g.is_pinned(), in_place)
        return active, grads

    def _flat_param(self, i: int) -> torch.Tensor:
        return self._params[i].detach().view(-1)

    def _upload(self, work: _Work, slot: Slot) -> None:
        base = work.bucket.flat_start
        host = self._host
        for a, b in work.state_runs:
            nb = self._nb_host["exp_avg"]
            copy(slot.exp_avg[a - base : b - base], host.exp_avg[a:b], non_blocking=nb)
            nb = self._nb_host["exp_avg_sq"]
            copy(slot.exp_avg_sq[a - base : b - base], host.exp_avg_sq[a:b], non_blocking=nb)
        mb = self._master_base
        for a, b in work.master_runs:
            copy(
                slot.master[a - base : b - base],
                host.master[a - mb : b - mb], non_blocking=self._nb_host["master"]
            )
        for s in work.self_master:
            o = s.flat_offset - base
            copy(
                slot.master[o : o + s.numel],
                self._flat_param(s.param_index)[s.param_offset : s.param_offset + s.numel],
                non_blocking=self._nb_param[s.param_index],
            )
        for s in work.segments:
            o = s.flat_offset - base
            grad, nb, in_place = self._grads[s.param_index]
            if in_place:
                continue  # the update reads it where it is
            copy(
                slot.grad[o : o + s.numel],
                grad[s.param_offset : s.param_offset + s.numel], non_blocking=nb
            )

    def _attach_steps(self, works: list[_Work]) -> None:
        """Give every segment its parameter's step count, as the tensor torch's kernel takes.

        Each segment gets its own tensor (the kernel increments them in place; the
        parameter's own counter is incremented once after the pipeline). Fused groups
        keep them on the device in fp32, as torch does — made in one copy here, before
        the pipeline starts, from pinned memory and non-blocking, so that the step never
        waits for the device's queue to drain (a pageable upload would).
        """
        count = [float(st["step"]) if (st := self.state.get(p)) else 0.0 for p in self._params]
        fused = [bool(resolve_kernel(g, self.device)["fused"]) for g in self.param_groups]
        values = [count[s.param_index] for w in works for gi, segs, _ in w.groups if fused[gi]
                  for s in segs]
        steps_host = torch.tensor(values, dtype=torch.float32)
        on_device = iter(upload_together({"steps": steps_host}, torch.device(self.device),
                                         dtype=torch.float32)["steps"].unbind(0)
                         if values else ())
        scalar = _scalar_dtype()
        for work in works:
            for gi, segs, steps in work.groups:
                if fused[gi]:
                    steps.extend(next(on_device) for _ in segs)
                else:
                    steps.extend(torch.tensor(count[s.param_index], dtype=scalar) for s in segs)

    def _update(self, work: _Work, slot: Slot) -> None:
        base = work.bucket.flat_start
        for gi, segs, steps in work.groups:
            group = self.param_groups[gi]

            def views(buf: torch.Tensor) -> list[torch.Tensor]:
                return [buf[s.flat_offset - base : s.flat_end - base] for s in segs]

            def grads() -> list[torch.Tensor]:
                out = []
                for s in segs:
                    grad, _, in_place = self._grads[s.param_index]
                    out.append(grad[s.param_offset : s.param_offset + s.numel] if in_place
                               else slot.grad[s.flat_offset - base : s.flat_end - base])
                return out

            beta1, beta2 = group["betas"]
            _adamw_kernel(
                views(slot.master),
                grads(),
                views(slot.exp_avg),
                views(slot.exp_avg_sq),
                [],
                steps,
                **resolve_kernel(group, self.device),
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group.get("maximize", False),
            )

    def _writeback(self, work: _Work, slot: Slot) -> None:
        base = work.bucket.flat_start
        host = self._host
        for a, b in work.state_runs:
            copy(
                host.exp_avg[a:b],
                slot.exp_avg[a - base : b - base], non_blocking=self._nb_host["exp_avg"]
            )
            copy(
                host.exp_avg_sq[a:b],
                slot.exp_avg_sq[a - base : b - base], non_blocking=self._nb_host["exp_avg_sq"]
            )
        mb = self._master_base
        for a, b in work.master_runs:
            copy(
                host.master[a - mb : b - mb],
                slot.master[a - base : b - base], non_blocking=self._nb_host["master"]
            )
        for s in work.segments:
            o = s.flat_offset - base
            copy(
                self._flat_param(s.param_index)[s.param_offset : s.param_offset + s.numel],
                slot.master[o : o + s.numel], non_blocking=self._nb_param[s.param_index]
            )
