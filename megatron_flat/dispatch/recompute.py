"""Graph-only recompute: a checkpoint's re-run forward skips the dispatch when it may.

Under full recompute (and MoE-module recompute) a reentrant checkpoint runs each MoE layer's
forward twice: once without autograd in the forward pass, and again in backward to rebuild
the region's graph, which it then back-propagates through the region's outputs. PipelinedLLEP's
backward re-dispatches and recomputes every chunk by itself, so on that re-run the layer's
output *values* are needed only if something later in the region keeps them, or a tensor
computed from them, for its own backward: the residual add and dropout after an MoE layer do
not; the next layer's norm does. When they are not needed, the re-run returns an output of
zeros with the real autograd node and does no dispatch, no expert GEMM and no combine: the
layer then costs one dispatched forward plus its chunked backward, fewer FLOPs and all-to-all
bytes than the stock layer's two forwards plus backward.

**The condition**, for one engine call on a re-run (inside :func:`recompute_region`): no tensor
saved for backward after the call, until the re-run ends, is computed from the call's output
by differentiable operations (it would have the call's autograd node among its ancestors).
The region's outputs themselves are only back-propagated through: the contract of whoever
opens the region (megatron-flat opens it in Megatron's reentrant ``CheckpointFunction``).

**Detection.** While a region is open, a saved-tensor pack hook (composed with the hooks that
were active when it opened) looks at every tensor saved for backward; once an engine call
has been *watched* in the region, it checks whether that call's node is an ancestor.
Each engine has a :class:`Verdict`. Its first re-run computes the values and is only watched:
if nothing depended on them the verdict becomes graph-only, else it stays on full values for
good (the safe fallback, with the reason kept). A graph-only re-run is watched too: a saved
tensor that depends on its zeros means the region changed shape between steps; the values
are then already wrong.

**One verdict per group.** Each rank reaches its verdict alone, but the ranks of an
expert-parallel group must run a call the same way (a graph-only call issues none of the
dispatch's all-to-alls). So a call is graph-only only when *every* rank wants it: the engine
carries each rank's wish in the route-counts exchange it makes anyway, and when the ranks
disagree every rank computes values (and those that wanted graph-only drop the wish for good,
with the disagreement as the reason). A violation (zeros kept) is never raised alone: with
peers (an expert-parallel group of more than one rank) it is recorded
(:func:`report_violation`) and goes out with this rank's next exchange, where every rank of
the group raises the same ``RuntimeError`` naming the rank and the tensor; on a single rank
it is raised at once.

**Not seen**: reads of the output that leave autograd (``.item()``, ``.detach()``, a mask
``out > 0`` saved without a node), and saves made under saved-tensor hooks pushed *inside*
the region after the engine call (their hooks shadow this one; a call made while other hooks
are on top is never graph-only). A region doing either after an MoE layer must turn the
mechanism off (``--no-flat-dispatch-graph-only-recompute``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import torch

__all__ = ["Verdict", "RecomputeRegion", "Violation", "current_region", "recompute_region",
           "report_violation", "take_violation", "violation_message", "windowed"]

_state = threading.local()  # .stack: the open regions of this thread, innermost last


@dataclass(frozen=True)
class Violation:
    """A graph-only re-run's zeros that a later op kept for its backward: ``op`` (the autograd
    node that saved it, known only on the rank that found it) and the tensor's ``shape``."""

    op: str
    shape: tuple[int, ...]

    MAX_DIMS = 4  # dimensions of the shape carried in the counts exchange

    def encode(self) -> list[int]:
        """``[1, ndim, d0, d1, d2, d3]``: what the exchange carries (shape cut to 4 dims)."""
        dims = list(self.shape[:self.MAX_DIMS])
        return [1, len(self.shape)] + dims + [0] * (self.MAX_DIMS - len(dims))

    @staticmethod
    def decode(row: list[int]) -> Optional[tuple[int, ...]]:
        """The shape :meth:`encode` carried, or None for no violation."""
        if not row or not row[0]:
            return None
        return tuple(row[2:2 + min(row[1], Violation.MAX_DIMS)])

    NO_VIOLATION = [0] * (2 + MAX_DIMS)


def violation_message(rank: int, shape: tuple[int, ...], op: str = "") -> str:
    """The one message every rank raises for a violation found on ``rank``."""
    what = f"{op} saved" if op else "an op saved"
    return ("megatron-flat: a graph-only recompute of the flat MoE layer returned zeros on "
            f"rank {rank}, but later in the recomputed region {what} a "
            f"{tuple(shape)} tensor computed from the MoE output for its backward (the region "
            "changed since its first re-run). Turn graph-only recompute off: "
            "--no-flat-dispatch-graph-only-recompute (FlatConfig."
            "dispatch_graph_only_recompute=False)")


def report_violation(violation: Violation) -> None:
    """Record a violation found on this rank for the engine's next exchange (the first one
    recorded is kept)."""
    if getattr(_state, "violation", None) is None:
        _state.violation = violation


def take_violation() -> Optional[Violation]:
    """The violation recorded on this rank, if any (and forget it)."""
    violation = getattr(_state, "violation", None)
    _state.violation = None
    return violation


@dataclass
class Verdict:
    """Whether an engine's re-runs may skip their values: ``None`` not yet known (the next
    re-run computes values and is watched), ``True`` graph-only, ``False`` full values for
    good (``reason`` says what kept a tensor computed from the output)."""

    graph_only: Optional[bool] = None
    reason: str = ""
    graph_only_calls: int = 0   # re-runs that skipped their values
    watched_calls: int = 0      # re-runs watched (verification and graph-only)

    def reset(self) -> None:
        self.graph_only, self.reason = None, ""


@dataclass
class _Watch:
    node: Any            # the call's autograd node
    verdict: Verdict
    graph_only: bool     # the output holds zeros, not values
    alone: bool = True   # no peers: a violation is raised at once
    flagged: bool = False


@dataclass
class RecomputeRegion:
    """One re-run of a reentrant checkpoint's region (see the module docstring)."""

    hooks: Any = None                       # what our pack/unpack hooks compose with
    watched: List[_Watch] = field(default_factory=list)
    _clean: list = field(default_factory=list)  # nodes known not to reach a watched node
    _clean_ids: set = field(default_factory=set)  # their ids (the list holds the nodes alive)
    _pack: Optional[Callable] = None

    def on_top(self) -> bool:
        """Whether this region's hooks are the active saved-tensor hooks (no other hooks
        were pushed inside the region): only then is every save seen."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] is self._pack

    def watch(self, output: torch.Tensor, verdict: Verdict, graph_only: bool,
              alone: bool = True) -> None:
        """Check the saves that follow against ``output``'s autograd node. ``alone``: the
        call has no peers, so a violation is raised at once instead of reported."""
        verdict.watched_calls += 1
        if graph_only:
            verdict.graph_only_calls += 1
        self.watched.append(_Watch(output.grad_fn, verdict, graph_only, alone))

    # -- the hook --------------------------------------------------------------------
    def _depends(self, tensor: torch.Tensor) -> Optional[_Watch]:
        """The watched call whose node is an ancestor of ``tensor``'s, else None."""
        root = tensor.grad_fn
        if root is None:
            return None
        targets = {id(w.node): w for w in self.watched if not w.flagged}
        if not targets:
            return None
        known = self._clean_ids
        seen, stack, order = set(), [root], []
        while stack:
            node = stack.pop()
            key = id(node)
            if key in seen or key in known:
                continue
            if key in targets:
                return targets[key]
            seen.add(key)
            order.append(node)
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        self._clean.extend(order)  # held, so their ids stay theirs for this region
        self._clean_ids.update(id(n) for n in order)
        return None

    def check(self, tensor: torch.Tensor) -> None:
        if not self.watched:
            return
        hit = self._depends(tensor)
        if hit is None:
            return
        op = type(tensor.grad_fn).__name__
        what = f"{op} saved a {tuple(tensor.shape)} tensor computed from the MoE output"
        hit.flagged = True
        if hit.graph_only:
            hit.verdict.graph_only, hit.verdict.reason = False, f"zeros kept: {what}"
            violation = Violation(op=op, shape=tuple(tensor.shape))
            if hit.alone:
                raise RuntimeError(violation_message(0, violation.shape, op))
            report_violation(violation)  # raised by the whole group at its next exchange
            return
        hit.verdict.graph_only, hit.verdict.reason = False, what

    def close(self) -> None:
        """End of the re-run: every verification nothing depended on becomes graph-only."""
        for w in self.watched:
            if not w.flagged and w.verdict.graph_only is None:
                w.verdict.graph_only = True
        self.watched.clear()
        self._clean.clear()
        self._clean_ids.clear()


def current_region() -> Optional[RecomputeRegion]:
    """The innermost open region of this thread, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def recompute_region() -> Iterator[RecomputeRegion]:
    """Open a region around the re-run of a reentrant checkpoint's function.

    The caller promises that the values of what the function returns are not read: the
    outputs are only back-propagated through (``torch.autograd.backward(outputs, grads)``).
    Saved-tensor hooks already active keep working (composed); when saved-tensor hooks are
    disabled in this context the region is not opened (no engine call goes graph-only).
    """
    region = RecomputeRegion(hooks=torch._C._autograd._top_saved_tensors_default_hooks(False))
    inner_pack, inner_unpack = region.hooks if region.hooks is not None else (None, None)

    def pack(tensor: torch.Tensor) -> Any:
        region.check(tensor)
        # detach: returning an output itself would tie it to its own node in a cycle.
        return inner_pack(tensor) if inner_pack is not None else tensor.detach()

    def unpack(packed: Any) -> torch.Tensor:
        return inner_unpack(packed) if inner_unpack is not None else packed

    region._pack = pack
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
    except RuntimeError:  # hooks disabled here (torch.autograd.graph.disable_saved_tensors_hooks)
        yield region
        return
    stack = _state.__dict__.setdefault("stack", [])
    stack.append(region)
    try:
        yield region
    except BaseException:
        region.watched.clear()  # an aborted re-run proves nothing
        raise
    finally:
        stack.pop()
        hooks.__exit__(None, None, None)
        region.close()


def windowed(function: Callable) -> Callable:
    """``function`` run inside :func:`recompute_region` (for a checkpoint's re-run)."""
    if getattr(function, "__flat_recompute_region__", False):
        return function

    def run(*args: Any, **kwargs: Any) -> Any:
        with recompute_region():
            return function(*args, **kwargs)

    run.__flat_recompute_region__ = True
    run.__wrapped__ = function
    return run
