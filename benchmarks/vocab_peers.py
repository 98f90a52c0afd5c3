"""The peers of Ring-DTP in ``benchmarks/vocab.py``: Liger's fused linear cross-entropy
(``liger-kernel``) and Cut Cross-Entropy (``cut-cross-entropy``).

Both are optional extras of the benchmark, never of the package::

    pip install --no-deps liger-kernel cut-cross-entropy    # triton comes with torch/megatron

A peer that does not import is reported as not run, with the reason. Both are single-device
methods: they need the whole ``V x H`` output layer on the rank (no tensor parallelism), so
at P > 1 they run, like ``dense``, on this rank's tokens against the whole weight.

On CPU their Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here
before Triton compiles anything), one program after another in NumPy:

* the meter stays faithful: a program's blocks are NumPy arrays (on a GPU, registers and
  shared memory), never torch tensors, so what the meter sees is what the peer allocates
  with torch, as on a GPU; the interpreter's copies of the kernel arguments are views of
  the same CPU storages;
* the ledger counts each kernel launch as one op (``ledger.foreign_kernel``) and hides the
  interpreter's own copies; matmuls the peer runs through torch (Liger's chunk GEMMs) are
  counted by the dispatcher as usual, FLOPs inside Triton kernels (all of Cut
  Cross-Entropy's) are added from its algorithm: ``2·N·V·H`` forward, ``6·N·V·H`` backward
  (logits recomputed, then dE and dC);
* Triton's ``libdevice`` has no interpreter implementation (its functions are stubs that
  return None): Cut Cross-Entropy's ``log1p`` is replaced by ``log(1 + x)`` for x in
  (0, 1], an absolute difference of at most one fp32 ulp of 1 in the log-sum-exp;
* the interpreter is slow (a Liger row takes milliseconds, a Cut Cross-Entropy backward
  tens of seconds at 1,024 x 625): ``vocab.py`` caps the peers' sizes (``--peer-max-tokens``,
  ``--cce-max-logits``) and says which rows were not run;
* Cut Cross-Entropy's backward takes half-precision inputs only (an assertion in its
  kernel), and bf16 ``tl.dot`` is wrong in the interpreter: its row runs in fp16 whatever
  ``--dtype`` is, so its errors are fp16's.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from megatron_flat.runtime.ledger import foreign_kernel

PEERS = ("liger", "cce")
INSTALL = "pip install --no-deps liger-kernel cut-cross-entropy"

_LOADED: dict[str, tuple[Optional[Callable], str]] = {}
_FLOPS: list[int] = [0]  # FLOPs of the Triton kernels of the peer call in progress


def _count_launches(interpreted: bool) -> None:
    """Every Triton kernel launch counts as one op of the open ledgers (once)."""
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction as Kernel
    else:
        from triton.runtime.jit import JITFunction as Kernel
    if getattr(Kernel.run, "_flat_counted", False):
        return
    original = Kernel.run

    def run(self, *args, **kwargs):
        with foreign_kernel(flops=_FLOPS[0]):
            _FLOPS[0] = 0  # the call's analytic FLOPs go to its first kernel
            return original(self, *args, **kwargs)

    run._flat_counted = True
    Kernel.run = run


# Triton reads TRITON_INTERPRET when it decorates a kernel: vocab.py sets it on CPU before
# it imports this module.
try:  # a jit function needs triton.language among its module's globals
    import triton
    import triton.language as tl

    @triton.jit
    def _log1p(a):
        return tl.log(1.0 + a)
except Exception:  # no triton: load() reports the peers as not importable
    _log1p = None


def _log1p_for_the_interpreter() -> None:
    import cut_cross_entropy.tl_utils as tl_utils

    tl_utils.tl_log1p = _log1p


def _interpreter_missing() -> str:
    """Why Triton's kernels cannot run here on CPU ("" when they can): Triton decides at
    import whether its own library functions are interpreted."""
    try:
        import triton.language.standard as standard
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as e:
        return f"triton not importable ({type(e).__name__}: {e})"
    if not isinstance(standard.max, InterpretedFunction):
        return ("Triton was imported before TRITON_INTERPRET=1 was set: set it in the "
                "environment to run the peers on CPU")
    return ""


def load(device: torch.device) -> dict[str, tuple[Optional[Callable], str]]:
    """``{peer: (run or None, why not / note)}``; ``run(x, w, labels) -> per-token loss``."""
    if _LOADED:
        return _LOADED
    interpreted = device.type != "cuda"
    if interpreted:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        why = _interpreter_missing()
        if why:
            _LOADED.update({name: (None, why) for name in PEERS})
            return _LOADED
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )

        def liger(x, w, labels):
            out = LigerFusedLinearCrossEntropyFunction.apply(
                x, w, labels, None, None, -100, 0.0, 0.0, "none")
            return out[0] if isinstance(out, tuple) else out

        _LOADED["liger"] = (liger, "")
    except Exception as e:  # not installed, or a Triton it cannot use
        _LOADED["liger"] = (None, f"liger-kernel not importable ({type(e).__name__}: {e}); "
                                  + INSTALL)
    try:
        from cut_cross_entropy import linear_cross_entropy

        if interpreted:
            _log1p_for_the_interpreter()

        def cce(x, w, labels):
            n, h = x.shape
            _FLOPS[0] = 2 * n * w.shape[0] * h  # the forward's dots
            loss = linear_cross_entropy(x, w, labels, reduction="none")
            if loss.requires_grad:
                loss.register_hook(_backward_flops(6 * n * w.shape[0] * h))
            return loss

        _LOADED["cce"] = (cce, "fp16 (its backward takes half inputs only)")
    except Exception as e:
        _LOADED["cce"] = (None, f"cut-cross-entropy not importable ({type(e).__name__}: {e}); "
                                + INSTALL)
    if any(run for run, _ in _LOADED.values()):
        _count_launches(interpreted)
    return _LOADED


def _backward_flops(flops: int) -> Callable:
    def hook(grad):
        _FLOPS[0] = flops
        return grad
    return hook
