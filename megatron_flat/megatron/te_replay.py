"""Attention replay in transformer-engine's fused attention (its F16/BF16 backend).

TE's ``DotProductAttention`` runs its fused backend through ``FusedAttnFunc``, whose forward
calls the name ``fused_attn_fwd`` of the module that defines it (TE 1.12 to 2.2:
``transformer_engine.pytorch.attention``; 2.3 on: ``...attention.dot_product_attention
.backends``). The call returns ``(out, aux)`` (2.9 on, with ``return_max_logit``, also the
max logit), ``aux = [stats, rng_state]``: the softmax statistics (the log-sum-exp, fp32) and
the ``[seed, offset]`` its dropout drew. ``FusedAttnFunc`` saves (q, k, v, out, *aux) for
``fused_attn_bwd`` and derives nothing else from them. So replay sits at that one name:

- in a checkpoint's no-grad first pass the call runs, and what it returned is kept in the
  attention's store (SCO's host pool under ``--flat-attn-replay``) with how far the call
  moved the device's generator (TE draws its Philox offset on every call, dropout or not);
- in the re-run the kept results come back without the kernel and the generator is moved
  as far, so ``FusedAttnFunc`` saves what stock saves, its backward is stock's, and every
  later draw in the region (dropout masks, the next layer's kernel) is stock's.

Calls are keyed by their index inside the ``DotProductAttention`` forward that made them
(``enable`` wraps that forward; Megatron's ``TEDotProductAttention`` reaches it through
``super().forward``). A call runs as stock, kept and replayed by nobody, when it is fp8 (its
forward rescales O and moves the quantizers' amaxes), when its ``aux`` carries more than the
statistics and the RNG state (an attention bias or a softmax offset: inputs, not results),
or outside a checkpoint's two passes. Under CP, TE's context-parallel attention calls the
kernel by its own global (``...dot_product_attention.context_parallel``, swapped too) once per
ring step: each step's partial output and statistics are kept under its call index, the
re-run's ring exchanges K/V as stock's and merges the kept partials, so its outputs and what
its backward saves are bitwise stock's; the host keeps every step's partial O + LSE (up to CP
times one layer's pair on the last rank of the ring: ``plan.peaks.replay_slot``). A TE
attention whose first pass runs no fused kernel (TE chose its flash-attn or unfused backend)
says so once; its re-run recomputes as stock.

Version-gated here only; nothing imports transformer-engine unless it is asked to.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from typing import Any, Callable, List, Optional

import torch

from megatron_flat.runtime import patching

__all__ = ["attention_class", "attentions", "disable", "enable", "enabled", "kernel_module",
           "unsupported"]

# Where each TE release keeps FusedAttnFunc and the fused_attn_fwd it calls, newest first.
_KERNEL_MODULES = ("transformer_engine.pytorch.attention.dot_product_attention.backends",
                   "transformer_engine.pytorch.attention")
# Where TE 2.3+ keeps its context-parallel attention, which calls the kernel once per ring
# step (or once after its all-to-all) by the same global name; before 2.3 it shares the
# module above.
_CP_MODULES = ("transformer_engine.pytorch.attention.dot_product_attention.context_parallel",)
# A TE built for another CUDA or torch fails its import with these as well as ImportError:
# either way its attention is not there to replay (a fallback, not an error).
_IMPORT_ERRORS = (ImportError, OSError, RuntimeError)
_lock = threading.Lock()
_frames = threading.local()
_patched: dict = {}  # what enable swapped ("kernels", "cls", "forward") and was given


def _imported(name: str) -> Optional[Any]:
    """The module ``name``, or None when it does not import."""
    try:
        return importlib.import_module(name)
    except _IMPORT_ERRORS:
        return None


def _calling_kernel(names) -> List[Any]:
    """Of the modules ``names``, those that import and hold a global ``fused_attn_fwd``."""
    modules = (_imported(name) for name in names)
    return [m for m in modules if callable(getattr(m, "fused_attn_fwd", None))]


def kernel_module() -> Optional[Any]:
    """The TE module whose ``FusedAttnFunc`` calls its global ``fused_attn_fwd``; None when
    transformer-engine is not importable or keeps them nowhere this module knows."""
    found = [m for m in _calling_kernel(_KERNEL_MODULES) if hasattr(m, "FusedAttnFunc")]
    return found[0] if found else None


ATTENTION_PATH = "transformer_engine.pytorch.DotProductAttention"


def attention_class() -> Optional[type]:
    """TE's ``DotProductAttention`` (what Megatron's ``TEDotProductAttention`` subclasses)."""
    return getattr(_imported("transformer_engine.pytorch"), "DotProductAttention", None)


def _cp_modules() -> List[Any]:
    """TE's context-parallel modules that call ``fused_attn_fwd`` by their own global."""
    return _calling_kernel(_CP_MODULES)


def unsupported() -> Optional[str]:
    """Why TE's attention cannot replay in this process (a fallback reason), or None."""
    if attention_class() is None:
        return "transformer-engine's attention: transformer_engine.pytorch is not importable"
    if kernel_module() is None:
        return ("transformer-engine's attention: this release keeps FusedAttnFunc's "
                "fused_attn_fwd in none of " + ", ".join(_KERNEL_MODULES))
    return None


def enabled() -> bool:
    return bool(_patched)


def enable(store: Callable[[Any], Any], warn_once: Callable[[str, str], None]) -> None:
    """Swap TE's ``fused_attn_fwd`` (where ``FusedAttnFunc`` looks it up) and wrap its
    ``DotProductAttention.forward``. ``store(attention)``: the store for the call starting
    (``replay_wiring.current_store``); ``warn_once(key, message)``: the run's one warning per
    key. Passed in, not imported: the wiring imports this module. Idempotent.
    ``RuntimeError`` when :func:`unsupported`."""
    with _lock:
        if _patched:
            return
        reason = unsupported()
        if reason is not None:
            raise RuntimeError(f"attention replay: {reason}")
        cls = attention_class()
        modules = [kernel_module()] + _cp_modules()
        patches = [patching.Patch(patching.path_of(m), "fused_attn_fwd", _replaying,
                                  expects="transformer-engine's fused attention kernel",
                                  why="attention replay keeps the first pass's O and LSE")
                   for m in modules]
        # The class as Megatron reaches it (TE's own module path may differ by release).
        patches.append(patching.Patch(ATTENTION_PATH, "forward", _wrap_forward,
                                      expects="a method",
                                      why="attention replay marks which call is replayed"))
        _patched.update(cls=cls, forward=cls.forward, store=store, warn=warn_once,
                        kernels=[(m, m.fused_attn_fwd) for m in modules], patches=patches)
        for patch in patches:
            patching.apply(patch)


def disable() -> None:
    """Restore TE's own ``fused_attn_fwd`` and forward (stores stay with their modules)."""
    with _lock:
        if not _patched:
            return
        for patch in reversed(_patched["patches"]):
            patching.revert(patch)
        _patched.clear()


class _Frame:
    """One ``DotProductAttention`` forward in progress: its store (None: not replaying), which
    pass it is in and how many fused kernels it has called. The pass is read here, outside
    ``FusedAttnFunc``: an autograd Function's forward always runs with grad off."""

    def __init__(self, module: Any, store: Any) -> None:
        self.module, self.store, self.calls = module, store, 0
        self.first_pass = not torch.is_grad_enabled()


def _wrap_forward(forward):
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        frame = _Frame(self, _patched["store"](self))
        stack = _frames.__dict__.setdefault("stack", [])
        stack.append(frame)
        try:
            result = forward(self, *args, **kwargs)
        finally:
            stack.pop()
        if frame.store is not None and frame.calls == 0 and frame.first_pass:
            _patched["warn"]("te-backend",
                             "megatron-flat: --flat-attn-replay: transformer-engine ran no "
                             "fused attention kernel (it chose its flash-attn or unfused "
                             "backend); those layers recompute attention as stock does "
                             "(NVTE_FUSED_ATTN=1 NVTE_FLASH_ATTN=0 selects the fused one)")
        return result

    return wrapped


def _frame() -> Optional[_Frame]:
    stack = getattr(_frames, "stack", None)
    return stack[-1] if stack else None


_FP8_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def _is_fp8(arguments: dict) -> bool:
    """An fp8 call: TE's fp8 backend, or fp8 (or Float8Tensor) inputs."""
    if "FP8" in str(arguments.get("fused_attention_backend", "")):
        return True
    q = arguments.get("q")
    if not isinstance(q, torch.Tensor):
        return True  # not a tensor this module knows how to check: leave it to TE
    if type(q) is not torch.Tensor and "Float8" in type(q).__name__:
        return True
    return q.dtype in _FP8_DTYPES or q.dtype == torch.uint8


def _replaying(original):
    """``original`` (TE's ``fused_attn_fwd`` as one module binds it) with replay."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fused_attn_fwd(*args, **kwargs):
        return _fused_attn_fwd(original, signature, *args, **kwargs)

    return fused_attn_fwd


def _fused_attn_fwd(original, signature, *args, **kwargs):
    """TE's ``fused_attn_fwd`` with replay (module doc)."""
    frame = _frame()
    if frame is None or frame.store is None:
        return original(*args, **kwargs)
    store, index = frame.store, frame.calls
    frame.calls += 1
    arguments = signature.bind(*args, **kwargs).arguments
    if _is_fp8(arguments):
        _patched["warn"]("te-fp8",
                         "megatron-flat: --flat-attn-replay: transformer-engine's fp8 attention "
                         "is not replayed (its forward rescales the output); those layers "
                         "recompute attention as stock does")
        return original(*args, **kwargs)
    q = arguments["q"]
    if frame.first_pass:  # run, keep what it returned
        mark = _rng_mark(q.device)
        result = original(*args, **kwargs)
        store.kernel_forwards += 1
        out, aux, extra = result[0], list(result[1]), list(result[2:])
        if len(aux) == 2 and all(isinstance(t, torch.Tensor) for t in (out, *aux, *extra)):
            store.keep(index, out, *aux, *extra,
                       meta=(len(extra), _rng_drawn(q.device, mark)))
        else:
            _patched["warn"]("te-aux",
                             "megatron-flat: --flat-attn-replay: transformer-engine's attention "
                             f"returned {len(aux)} auxiliary tensors, not the statistics and "
                             "the RNG state (a softmax offset: attention sinks, --softmax-type; "
                             "or an attention bias), which are inputs its backward needs; "
                             "those layers recompute attention as stock does")
        return result
    entry = store.take_with_meta(index)
    if entry is None:  # not kept (no room in the host pool, or aux with inputs): stock
        store.kernel_forwards += 1
        store.stock_reruns += 1
        return original(*args, **kwargs)
    tensors, (n_extra, drawn) = entry
    out = tensors[0]
    if out.shape[:-1] != q.shape[:-1] or out.device != q.device:
        raise RuntimeError(f"attention replay: the kept output {tuple(out.shape)} does not fit "
                           f"this call's query {tuple(q.shape)} (call {index} of "
                           f"{type(frame.module).__name__}): the re-runs did not come in the "
                           "first passes' order")
    store.replays += 1
    _rng_advance(q.device, drawn)
    kept = [t.detach() for t in tensors]
    return (kept[0], kept[1:3], *kept[3:3 + n_extra])


# -- the device generator: moved in the re-run as far as the first pass's kernel moved it ---

def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        from megatron_flat.attention.replay import device_generator as cuda_generator

        return cuda_generator(device)
    return torch.default_generator


def _rng_mark(device: torch.device) -> Any:
    generator = _generator(device)
    # CUDA's Philox generator counts its offset; the CPU one has none (only TE's stand-ins
    # in tests run there): its whole state after the call is kept instead.
    return generator.get_offset() if device.type == "cuda" else None


def _rng_drawn(device: torch.device, mark: Any) -> Any:
    generator = _generator(device)
    if device.type == "cuda":
        return generator.get_offset() - mark
    return generator.get_state()


def _rng_advance(device: torch.device, drawn: Any) -> None:
    generator = _generator(device)
    if device.type == "cuda":
        if drawn:
            generator.set_offset(generator.get_offset() + drawn)
    else:
        # the re-run starts from the first pass's RNG state (Megatron restores it), so the
        # state after the first pass's call is where this call would leave the generator
        generator.set_state(drawn)


def attentions(model: Any) -> List[Any]:
    """TE ``DotProductAttention`` modules in ``model`` (a module or a list of model chunks);
    empty when transformer-engine is not importable."""
    cls = attention_class()
    if cls is None:
        return []
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, cls)]
