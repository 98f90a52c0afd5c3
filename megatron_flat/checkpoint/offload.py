"""Selective checkpoint offload (SCO): checkpoint boundaries in the host pool.

With activation checkpointing, what lives from a region's forward to its
backward is the region's input (the boundary). :class:`SelectiveCheckpointOffload`
runs ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` unchanged
and only changes where the boundary waits: in host-pool memory instead of on
the device. See architecture.md §2.3.

Mechanism
    torch's non-reentrant checkpoint saves the region's positional tensor
    inputs as autograd ``SavedTensor`` objects through the saved-tensor hooks
    active *around* the call (its own hooks, pushed afterwards, only cover the
    region's inner activations). SCO wraps the call in
    ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``, so ``pack``
    receives exactly the boundary tensors and ``unpack`` is called once per
    recompute, when backward first needs the region. Arguments and keyword
    arguments are flattened with ``torch.utils._pytree`` and passed
    positionally, so tensors in kwargs and in lists/tuples/dicts are
    boundaries too (the containers are rebuilt for ``function``).

    Recompute, RNG handling (CPU and device generators stashed at forward and
    restored for the recompute, ``preserve_rng_state``), autocast state,
    ``context_fn``, ``determinism_check`` and early stop are torch's own, so
    dropout recomputes identically and results are bitwise those of plain
    ``torch.utils.checkpoint``: SCO only moves bytes. Extra RNG state (e.g.
    Megatron's CUDA RNG tracker) goes through ``context_fn``.

Offload
    The boundary tensors of one call are grouped by storage into byte spans
    (:mod:`.spans`): the same tensor passed twice or views of one another
    share one span, one copy, and come back as views of one buffer. Each span
    is copied into the host pool on a side stream when torch saves it; SCO
    then holds only the host copy, so the device bytes are freed as soon as
    nothing else references them (the layer stack's intermediate inputs: yes;
    a tensor the caller keeps: no, but its host copy is still what backward
    uses). A span that does not fit in the pool (budget spent, or no free
    block) stays on the device as plain checkpoint would keep it, with a
    one-time warning; never an error or a different result.

Backward and prefetch
    When backward first needs region ``r`` (its first unpack), SCO makes sure
    ``r``'s spans are on the device (a prefetch hit, or a synchronous reload)
    and issues reloads, on the other side stream, for up to ``prefetch``
    predecessors of ``r``. The predecessor of a region is the region whose
    output ``r`` received as input (dataflow, recorded per region), not the
    previous call in time, so several forward passes alive at once
    (pipeline microbatches, interleaved in any order) keep separate chains.
    Order assumption: the backward of a region is followed by the backward of
    its predecessor (true for sequential stacks: the autograd engine runs a
    single device's graph in reverse creation order). Then at most
    ``prefetch + 1`` regions' restored boundaries are on the device at once.
    When the order differs, prefetch is only a wasted or early copy (it holds
    device memory until its region runs or its graph is freed) and a miss
    reloads synchronously: correctness never depends on the order. Each
    reload waits for the offload copy's event. After the unpack, host bytes
    go back to the pool once the reload copy completes, unless the graph is
    retained (``retain_graph=True``), in which case they stay until the graph
    is freed.

Limits
    Calls made while other saved-tensor hooks are active (inside another
    checkpoint's forward or recompute, ``save_on_cpu``) run as plain
    checkpoint (counted in ``stats.plain_fallbacks``). Tensors offloaded by
    default: dense strided tensors on the device (CUDA when available, else the
    CPU stand-in), not ``nn.Parameter``; pass ``offload=`` to choose.
    In-place changes to an input after the forward: backward fails with torch's
    "modified by an inplace operation" error, as in plain checkpoint, for a
    boundary kept on the device and for an offloaded one alike (on a GPU its
    offload copy may still be reading the tensor when it is changed).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any, Callable, Container, ContextManager, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import noop_context_fn

from megatron_flat.checkpoint.spans import ViewMeta, plan_spans, rebuild, span_bytes
from megatron_flat.checkpoint.transfer import HostSpan, SpanMover
from megatron_flat.runtime import Event, HostPool
from megatron_flat.runtime.streams import synchronize_on_drop

__all__ = ["SCOStats", "SelectiveCheckpointOffload", "default_offload_policy"]

ContextFn = Callable[[], tuple[ContextManager, ContextManager]]


def default_offload_policy(t: torch.Tensor, device: torch.device) -> bool:
    """Offload dense strided tensors on ``device`` that are not ``nn.Parameter``."""
    if type(t) is not torch.Tensor or t.numel() == 0 or t.device.type != device.type:
        return False
    return not (
        t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg()
    )


def _policy_on(device: torch.device, t: torch.Tensor) -> bool:
    return default_offload_policy(t, device)


@dataclass(frozen=True)
class SCOStats:
    """Counters since creation (``max_restored_on_device`` since the last reset).

    A *boundary* is what one checkpoint call saves: its tensor inputs.
    """

    checkpoints: int = 0  # calls recorded by SCO (grad enabled, SCO hooks in charge)
    boundaries_offloaded: int = 0  # calls whose offloadable tensors all went to the host pool
    boundaries_kept: int = 0  # calls with an offloadable tensor kept on device (no room)
    tensors_offloaded: int = 0
    tensors_kept: int = 0  # offloadable but kept on device for lack of room
    tensors_skipped: int = 0  # saved as is because the offload policy excluded them
    bytes_offloaded: int = 0  # span bytes copied to the host pool
    bytes_kept: int = 0  # span bytes of offloadable tensors kept on device
    restored_on_device: int = 0  # calls whose reloaded boundary is on the device now
    max_restored_on_device: int = 0  # most at once
    prefetched: int = 0  # reloads issued ahead of use
    prefetch_hits: int = 0  # first uses that found the boundary already reloaded
    reloads_on_demand: int = 0  # first uses that had to reload then (prefetch misses)
    plain_fallbacks: int = 0  # calls run as plain checkpoint (other saved-tensor hooks active)
    host_bytes_in_use: int = 0
    peak_host_bytes: int = 0


class _Counters:
    """Mutable counters behind :class:`SCOStats`; finalizers update them too."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.values = {f.name: 0 for f in fields(SCOStats)}

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.values[name] += delta

    def restored(self, delta: int) -> None:
        with self.lock:
            v = self.values
            v["restored_on_device"] += delta
            v["max_restored_on_device"] = max(v["max_restored_on_device"], v["restored_on_device"])


class _Live:
    """Restored device buffers of one region still alive (shared with their finalizers)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def _buffer_freed(counters: _Counters, live: _Live) -> None:
    with counters.lock:
        live.n -= 1
        if live.n == 0:
            counters.restored(-1)


def _release_spans(mover: SpanMover, spans: list) -> None:
    for span in spans:
        if span is not None:
            mover.release(span)


class _Region:
    """One checkpoint call: its spans in the pool, reload state, and predecessor."""

    __slots__ = (
        "plan",
        "host",
        "pred",
        "n_packed",
        "n_unpacked",
        "restored",
        "live",
        "__weakref__",
    )

    def __init__(self, host: list[Optional[HostSpan]], pred: Optional["_Region"]) -> None:
        self.plan: dict[tuple, tuple[int, ViewMeta]] = {}  # _view_key -> (span, meta), forward only
        self.host = host  # per span: the host copy, or None (kept on device / released)
        self.pred = weakref.ref(pred) if pred is not None else None
        self.n_packed = 0
        self.n_unpacked = 0
        self.restored: Optional[list[Optional[tuple[torch.Tensor, Event]]]] = None
        self.live = _Live()

    def predecessor(self) -> Optional["_Region"]:
        return self.pred() if self.pred is not None else None

    def has_host(self) -> bool:
        return any(span is not None for span in self.host)


class _Packed:
    """What the autograd graph holds for one saved boundary tensor."""

    __slots__ = ("region", "span", "meta", "tensor", "version", "source")

    def __init__(self, region: _Region, span: int, meta: Optional[ViewMeta], tensor,
                 source: Optional[weakref.ref] = None, version: int = 0) -> None:
        self.region = region
        self.span = span
        self.meta = meta
        self.tensor = tensor  # the device tensor itself when kept, else None
        self.version = tensor._version if tensor is not None else version
        # Offloaded: the caller's tensor (weakly), to refuse in-place changes made after the
        # save as plain checkpoint does; on a GPU the offload may still be reading it then.
        self.source = source


def _refuse_if_modified(tensor: torch.Tensor, version: int, where: str) -> None:
    """What plain checkpoint reports when a saved input changed in place after the save."""
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] (a checkpoint input "
            f"{where} by SCO) is at version {tensor._version}; expected version {version} "
            "instead")


def _reload_at_output_grad(sco_ref, region_ref, grad):
    sco, region = sco_ref(), region_ref()
    if sco is not None and region is not None:
        sco._reload_early(region)
    return None


def _view_key(t: torch.Tensor) -> tuple:
    """Identifies what ``t`` addresses, whichever Python object torch hands to ``pack``."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _call_unflattened(function: Callable, spec: pytree.TreeSpec, *leaves: Any) -> Any:
    args, kwargs = pytree.tree_unflatten(list(leaves), spec)
    return function(*args, **kwargs)


def _foreign_hooks_active() -> bool:
    """True when saved-tensor hooks are already in charge (or hooks are disabled)."""
    autograd = torch._C._autograd
    enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", None)
    if enabled is not None and not enabled():
        return True
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _graph_kept() -> bool:
    """Whether the running backward retains the graph (True outside backward).

    Private torch APIs (torch's checkpoint uses the first); without them the host
    bytes are kept until the graph is freed, which is correct, only later.
    """
    task = getattr(torch._C, "_current_graph_task_id", None)
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if task is None or keep is None or task() == -1:
        return True
    return bool(keep())


class SelectiveCheckpointOffload:
    """Activation checkpointing whose boundaries wait in a host pool, not on the device.

    ``host_budget_bytes`` sizes the pool (preallocated once, pinned on CUDA);
    ``prefetch`` is how many predecessor regions are reloaded ahead while a
    region recomputes (0: reload each on demand). ``device`` is the device
    whose memory SCO relieves (default: CUDA when available, else CPU); the
    pool is pinned when it is CUDA. ``pool`` shares an existing
    :class:`~megatron_flat.runtime.HostPool` instead (then ``host_budget_bytes``
    must be None). ``offload(tensor) -> bool`` picks which saved tensors may go
    to the host (default: :func:`default_offload_policy` for ``device``).

    Memory bound (sequential stack, order assumption in the module docstring):
    device bytes held for boundaries between forward and backward are those of
    the spans that did not fit the budget; during backward at most
    ``prefetch + 1`` regions' restored boundaries are on the device.
    Exactness: loss and gradients bitwise equal to
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
    """

    def __init__(
        self,
        host_budget_bytes: Optional[int],
        prefetch: int = 1,
        *,
        pool: Optional[HostPool] = None,
        pin_memory: Optional[bool] = None,
        offload: Optional[Callable[[torch.Tensor], bool]] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if pool is None:
            if host_budget_bytes is None:
                raise ValueError("give host_budget_bytes or pool")
            if pin_memory is None:
                pin_memory = self.device.type == "cuda"
            pool = HostPool(host_budget_bytes, pin_memory=pin_memory)
        elif host_budget_bytes is not None:
            raise ValueError("give host_budget_bytes or pool, not both")
        self.pool = pool
        self.prefetch = prefetch
        if offload is None:
            offload = functools.partial(_policy_on, self.device)
        self._offloadable = offload
        self._mover = SpanMover(pool)
        # Dropped (replaced by another SCO, its model freed) with copies in flight: they land
        # before the pool's pages and the pending host bytes can go.
        synchronize_on_drop(self, self._mover.synchronize)
        self._counters = _Counters()
        self._lock = threading.RLock()
        # storage of a region's output -> that region (dataflow predecessor links)
        self._producers: "weakref.WeakKeyDictionary[torch.UntypedStorage, weakref.ref]" = (
            weakref.WeakKeyDictionary()
        )
        self._warned_full = False
        self._warned_hooks = False
        self._last: Optional[weakref.ref] = None  # the region checkpointed last (forward)

    # -- public ---------------------------------------------------------------

    @property
    def stats(self) -> SCOStats:
        self._mover.drain()
        with self._counters.lock:
            values = dict(self._counters.values)
        pool = self.pool.stats()
        values["host_bytes_in_use"] = pool["used_bytes"]
        values["peak_host_bytes"] = pool["peak_used_bytes"]
        return SCOStats(**values)

    @property
    def mover(self) -> SpanMover:
        """The copies of SCO's pool (its side streams): attention replay's kept outputs share
        them, with the pool and its budget."""
        return self._mover

    def reset_peak(self) -> None:
        """Restart ``max_restored_on_device`` from the current count."""
        with self._counters.lock:
            v = self._counters.values
            v["max_restored_on_device"] = v["restored_on_device"]

    def synchronize(self) -> None:
        """Wait for all offload/reload copies; return host bytes no longer needed."""
        self._mover.synchronize()

    def checkpoint(
        self,
        function: Callable,
        *args: Any,
        use_reentrant: bool = False,
        context_fn: ContextFn = noop_context_fn,
        determinism_check: str = "default",
        debug: bool = False,
        early_stop: bool = True,
        preserve_rng_state: bool = True,
        **kwargs: Any,
    ) -> Any:
        """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``.

        Same keyword options as torch's non-reentrant checkpoint; everything
        else in ``kwargs`` goes to ``function``.
        """
        if use_reentrant:
            raise ValueError("SelectiveCheckpointOffload implements the non-reentrant checkpoint")
        return self.run(
            function,
            args,
            kwargs,
            context_fn=context_fn,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            preserve_rng_state=preserve_rng_state,
        )

    def run(
        self,
        function: Callable,
        args: Sequence[Any] = (),
        kwargs: Optional[dict] = None,
        *,
        offload_args: Optional[Container[int]] = None,
        checkpoint_fn: Optional[Callable[..., Any]] = None,
        context_fn: ContextFn = noop_context_fn,
        determinism_check: str = "default",
        debug: bool = False,
        early_stop: bool = True,
        preserve_rng_state: bool = True,
    ) -> Any:
        """:meth:`checkpoint` with explicit ``args``/``kwargs`` and a selection.

        ``offload_args``: positions in ``args`` whose tensors may be offloaded
        (None: every tensor in ``args`` and ``kwargs``); the others are saved
        as plain checkpoint saves them.

        ``checkpoint_fn``: another checkpoint to run instead of torch's
        non-reentrant one, called as ``checkpoint_fn(function, *args, **kwargs)``
        inside SCO's saved-tensor hooks. It must save the region's inputs with
        ``ctx.save_for_backward`` and run the forward without saving anything
        else (a reentrant checkpoint such as Megatron's ``CheckpointFunction``):
        the inputs are then the only tensors SCO packs, and recompute, RNG
        replay and backward are that checkpoint's own. The torch options
        (``context_fn`` and the rest) do not apply then.
        """
        kwargs = dict(kwargs or {})
        options = dict(
            use_reentrant=False,
            context_fn=context_fn,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            preserve_rng_state=preserve_rng_state,
        )
        if checkpoint_fn is not None:
            plain = functools.partial(checkpoint_fn, function)
        else:
            plain = functools.partial(torch_checkpoint, function, **options)
        if not torch.is_grad_enabled():
            return plain(*args, **kwargs)
        if _foreign_hooks_active():
            self._counters.add(plain_fallbacks=1)
            if not self._warned_hooks:
                self._warned_hooks = True
                warnings.warn(
                    "SCO: checkpoint called while other saved-tensor hooks are active "
                    "(nested checkpoint, save_on_cpu, ...); running plain checkpoint there",
                    stacklevel=3,
                )
            return plain(*args, **kwargs)

        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        eligible = self._eligible(args, kwargs, leaves, offload_args)
        region = self._offload(leaves, eligible)
        with torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, region), self._unpack
        ):
            if checkpoint_fn is not None:
                out = checkpoint_fn(function, *args, **kwargs)
            else:
                inner = functools.partial(_call_unflattened, function, spec)
                out = torch_checkpoint(inner, *leaves, **options)
        region.plan = {}
        hooked = False
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                self._producers[leaf.untyped_storage()] = weakref.ref(region)
                if not hooked and leaf.requires_grad and self.prefetch and region.has_host():
                    # Backward reaches this region once its output's gradient exists: start
                    # the reload then, if no prefetch did (the first region of a backward:
                    # its reload overlaps whatever backward runs after the region's output).
                    leaf.register_hook(functools.partial(_reload_at_output_grad,
                                                         weakref.ref(self), weakref.ref(region)))
                    hooked = True
        self._last = weakref.ref(region)
        return out

    # -- forward --------------------------------------------------------------

    def _eligible(self, args, kwargs, leaves, offload_args) -> list[bool]:
        """Per leaf: a tensor the policy (and ``offload_args``) lets go to the host."""
        if offload_args is None:
            allowed = [True] * len(leaves)
        else:
            allowed = []
            for i, arg in enumerate(args):
                allowed += [i in offload_args] * len(pytree.tree_leaves(arg))
            allowed += [False] * (len(leaves) - len(allowed))
        return [
            ok and isinstance(leaf, torch.Tensor) and self._offloadable(leaf)
            for ok, leaf in zip(allowed, leaves)
        ]

    def _offload(self, leaves: list, eligible: list[bool]) -> _Region:
        """Copy the eligible tensors' spans to the pool; the region records where they went.

        Runs just before torch saves the inputs (its first step), i.e. when the
        boundary is saved; the copies overlap the region's forward.
        """
        tensors = [leaf for leaf, ok in zip(leaves, eligible) if ok]
        skipped = sum(isinstance(leaf, torch.Tensor) for leaf in leaves) - len(tensors)
        pred = None
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                ref = self._producers.get(leaf.untyped_storage())
                cand = ref() if ref is not None else None
                if cand is not None:
                    pred = cand
                    break
        if pred is None:
            # No dataflow link (a residual add, norm or dropout between two regions): the
            # region checkpointed just before, whose backward comes just after this one's.
            last = self._last() if self._last is not None else None
            if last is not None and last.restored is None and last.n_unpacked == 0:
                pred = last
        spans, metas = plan_spans(tensors)
        host: list[Optional[HostSpan]] = []
        for span in spans:
            with torch.no_grad():
                host.append(self._mover.offload(span_bytes(span)))
        region = _Region(host, pred)
        weakref.finalize(region, _release_spans, self._mover, host).atexit = False
        kept_tensors = 0
        for t, (i, meta) in zip(tensors, metas):
            if host[i] is not None:
                region.plan[_view_key(t)] = (i, meta, weakref.ref(t))
            else:
                kept_tensors += 1
        off_bytes = sum(s.nbytes for s, h in zip(spans, host) if h is not None)
        kept_bytes = sum(s.nbytes for s, h in zip(spans, host) if h is None)
        self._counters.add(
            checkpoints=1,
            boundaries_offloaded=int(bool(spans) and kept_bytes == 0),
            boundaries_kept=int(kept_bytes > 0),
            tensors_offloaded=len(tensors) - kept_tensors,
            tensors_kept=kept_tensors,
            tensors_skipped=skipped,
            bytes_offloaded=off_bytes,
            bytes_kept=kept_bytes,
        )
        if kept_bytes and self.pool.capacity_bytes and not self._warned_full:
            self._warned_full = True
            warnings.warn(
                f"SCO: host pool full ({self.pool.capacity_bytes} bytes); checkpoint "
                "boundaries that do not fit stay on the device",
                stacklevel=4,
            )
        return region

    def _pack(self, region: _Region, t: torch.Tensor) -> _Packed:
        entry = region.plan.get(_view_key(t)) if region.plan else None
        region.n_packed += 1
        if entry is None:
            return _Packed(region, -1, None, t)
        return _Packed(region, entry[0], entry[1], None, source=entry[2], version=t._version)

    # -- backward -------------------------------------------------------------

    def _reload(self, region: _Region) -> None:
        restored: list[Optional[tuple[torch.Tensor, Event]]] = []
        for span in region.host:
            if span is None:
                restored.append(None)
                continue
            buffer, event = self._mover.reload(span)
            with self._counters.lock:
                if region.live.n == 0:
                    self._counters.restored(+1)
                region.live.n += 1
            storage = buffer.untyped_storage()
            weakref.finalize(storage, _buffer_freed, self._counters, region.live).atexit = False
            restored.append((buffer, event))
        region.restored = restored

    def _reload_early(self, region: _Region) -> None:
        """Start ``region``'s reload before its first unpack, if it has host spans and no
        reload started yet (a prefetch, or its output's gradient exists)."""
        with self._lock:
            if region.restored is None and region.n_unpacked == 0 and region.has_host():
                self._reload(region)
                self._counters.add(prefetched=1)

    def _prefetch_from(self, region: _Region) -> None:
        pred = region.predecessor()
        for _ in range(self.prefetch):
            if pred is None:
                return
            self._reload_early(pred)
            pred = pred.predecessor()

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        region = packed.region
        with self._lock:
            if region.n_unpacked == 0:
                if region.has_host():
                    if region.restored is None:
                        self._reload(region)
                        self._counters.add(reloads_on_demand=1)
                    else:
                        self._counters.add(prefetch_hits=1)
                self._prefetch_from(region)
            item = None
            if packed.tensor is None:
                if region.restored is None:
                    raise RuntimeError(
                        "SCO: boundary already released (backward through the graph a "
                        "second time? pass retain_graph=True to the first)"
                    )
                item = region.restored[packed.span]
            region.n_unpacked += 1
            if region.n_unpacked == region.n_packed:
                region.n_unpacked = 0
                region.restored = None
                if not _graph_kept():
                    host, region.host = region.host, [None] * len(region.host)
                    _release_spans(self._mover, host)
        if packed.tensor is not None:
            _refuse_if_modified(packed.tensor, packed.version, "kept on the device")
            return packed.tensor
        source = packed.source() if packed.source is not None else None
        if source is not None:
            # Offloaded boundaries too: the offload copy reads the device tensor on a side
            # stream, possibly after the change (a race on a GPU).
            _refuse_if_modified(source, packed.version, "offloaded")
        assert item is not None and packed.meta is not None
        buffer, event = item
        event.wait()
        with torch.no_grad():
            return rebuild(buffer, packed.meta)
