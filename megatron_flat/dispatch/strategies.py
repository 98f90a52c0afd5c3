"""How a chunk's experts go from forward to backward: the chunk strategies.

One strategy object per chunk (:func:`strategy_for`), each with a ``forward`` (the chunk's
received rows through their experts, in received order) and a ``backward`` (the chunk's
output gradients to input, probability and weight gradients; what goes back to the sources).
``resends_tokens`` says whether the backward dispatch carries the routes' tokens and
probabilities again beside their output gradients (the chunk is rebuilt from them) or only
the output gradients (the chunk's graph was held).

* :class:`Recomputed` (``pipelined``, the default): forward keeps nothing; backward rebuilds
  each unit's graph from its rows, one unit at a time (the bank's ``run_for_grad`` skips
  the last layer's forward GEMM), and differentiates it before the next exists. A *unit* is
  one expert's rows, or, with grouped calls on (``--flat-dispatch-grouped-calls``, a bank
  that offers ``run_native``), all of this rank's native experts' rows of the chunk in one
  grouped call (:func:`units`); spilled experts' rows are always units of their own, run
  with the transferred weights. A grouped unit's backward holds its experts' graph and
  weight gradients together: fewer launches, a higher peak.
* :class:`SavedFirstLayer` (the first ``saved_chunks`` chunks, a bank with ``run_saving``):
  forward saves each expert's first-layer output, which stands in for that GEMM in backward;
  otherwise as :class:`Recomputed`.
* :class:`SavedGraph` (the first ``saved_chunks`` chunks, any other bank): forward saves each
  expert's whole graph; backward differentiates them one at a time.
* :class:`WholeGraph` (``llep`` mode): forward builds the chunk's graph over all its experts,
  as plain autograd would, and backward differentiates it at once.

Two words, two ideas: a *saved* chunk is one of the first ``saved_chunks`` of ``pipelined``
mode (``--flat-dispatch-saved-chunks``); ``llep`` mode holds each chunk's *whole graph*.

Weight gradients go straight into Megatron DDP's ``main_grad`` when the weights have one
(:mod:`.grads`, the fused-accumulation protocol), else into fp32 accumulators ``acc``.
This module needs :class:`~.step.Step` only as a type: ``step`` builds nothing here, the
engine hands each call its strategies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch

from megatron_flat.dispatch.exchange import drain
from megatron_flat.dispatch.grads import accumulate_all

if TYPE_CHECKING:  # pragma: no cover
    from megatron_flat.dispatch.step import Step

__all__ = ["ChunkStrategy", "Recomputed", "SavedFirstLayer", "SavedGraph", "WholeGraph",
           "strategy_for"]


# ---------------------------------------------------------------------------- shared pieces
def units(step: "Step", i: int, native: bool = True) -> list[tuple]:
    """Chunk i's expert runs, ``(experts, start, end, counts)`` over its grouped rows: with
    grouped calls on (``Step.native``: the option and a bank with ``run_native``) this rank's
    native experts are one unit (their rows are contiguous in the grouped order; ``counts``: rows per
    local expert, 0 for an absent one), every other expert a unit of its own (counts None)."""
    segments = step.recv.segments[i]
    if not (native and step.native):
        return [([e], s, t, None) for e, s, t in segments]
    lo, hi = step.first, step.first + step.e_local
    mine = [(e, s, t) for e, s, t in segments if lo <= e < hi]
    out = []
    for e, s, t in segments:
        if not lo <= e < hi:
            out.append(([e], s, t, None))
        elif e == mine[0][0]:
            counts = [0] * step.e_local
            for ne, ns, nt in mine:
                counts[ne - lo] = nt - ns
            out.append(([ne for ne, _, _ in mine], mine[0][1], mine[-1][2], counts))
    return out


def grouped(step: "Step", i: int, received: list) -> list[torch.Tensor]:
    """Chunk i's received tensors in grouped (expert-contiguous) order, each gathered once
    (one row gather per tensor per chunk, none when the received order is already grouped);
    ``received`` is emptied as they are, so each grouped copy replaces its received buffer
    instead of living beside it. Units then take their rows as slices (views, no gather)."""
    out = []
    received.reverse()
    while received:
        out.append(step.group_rows(received.pop(), i))
    return out


def each_unit(step: "Step", i: int, received: list,
              run: Callable[[tuple, torch.Tensor, torch.Tensor], torch.Tensor],
              native: bool = True) -> torch.Tensor:
    """Chunk i's expert outputs in received order, one unit at a time (:func:`units`): the
    received rows and probabilities (``received``: ``[x_recv, p_recv]``, taken) are grouped
    once, each unit's rows are a slice and go through ``run(unit, x, p)``, so the working set
    is one unit's intermediates (one expert's, or the native experts' grouped call) beside
    the chunk's inputs and the outputs so far. The outputs are joined once per chunk (one
    ``cat``, after the grouped inputs are released, so the join's transient takes their
    place) and put back in received order with one row write (none when that order is
    already grouped)."""
    xg, pg = grouped(step, i, received)
    chunk_units = units(step, i, native)
    if not chunk_units:
        return xg.new_empty(xg.shape)
    rows = xg.shape[0]
    outs = []
    for unit in chunk_units:
        _, start, end, _ = unit
        outs.append(run(unit, xg[start:end], pg[start:end]))
    del xg, pg
    yg = outs[0] if len(outs) == 1 else torch.cat(outs)
    outs.clear()
    if yg.shape[0] != rows:
        raise RuntimeError(f"PipelinedLLEP bug: chunk {i}'s units gave {yg.shape[0]} rows "
                           f"for {rows} received")
    return step.ungroup(yg, i)


def gradient_like(step: "Step", x: torch.Tensor,
                  p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty tensors with the dtypes and widths of the input and probability gradients a
    chunk sends back (so :func:`differentiate` holds no reference to the received rows),
    made once per call and kept by the step."""
    key = (x.dtype, tuple(x.shape[1:]), p.dtype)
    like = step.templates.get(key)
    if like is None:
        like = step.templates[key] = (x.new_empty((0,) + key[1]), p.new_empty(0))
    return like


def gradient_targets(step: "Step", unit_members: Sequence[tuple]):
    """What to differentiate for units ``(members, native)`` (``members``: the unit's
    ``(expert, leaves)``; ``native``: its rows ran through the bank's native call):
    ``(tensors, spread)``, where ``spread(grads)`` yields each expert's ``(expert, weight
    gradients, leaves)`` from the gradients of ``tensors``. A native unit is differentiated
    with respect to the bank's ``native_params()`` when the bank has them (parameters its
    native call reads whole, e.g. a grouped weight whose experts' leaves are views) and
    split back per expert by its ``native_grads``; otherwise per expert leaf."""
    bank = step.bank
    wanted, pieces = [], []
    for members, native in unit_members:
        if native and hasattr(bank, "native_params"):
            params = list(bank.native_params())
            pieces.append((members, True, len(wanted), len(params)))
            wanted += params
        else:
            for e, leaves in members:
                take = [w for w in leaves if w.requires_grad]
                pieces.append(([(e, leaves)], False, len(wanted), len(take)))
                wanted += take

    def spread(grads: Sequence[Optional[torch.Tensor]]) -> Iterator[tuple]:
        for members, native, at, n in pieces:
            got = list(grads[at:at + n])
            if native:
                per_expert = bank.native_grads(got)
                for e, leaves in members:
                    yield e, list(per_expert[e - step.first]), leaves
            else:
                (e, leaves), = members
                found = iter(got)
                yield e, [next(found) if w.requires_grad else None for w in leaves], leaves

    return wanted, spread


def differentiate(step: "Step", i: int, gg: torch.Tensor, like: Sequence[torch.Tensor],
                  graphs: Iterator[tuple], acc: dict):
    """Chunk i's backward one unit's graph at a time (``(members, start, end, x, p, y,
    native)``, ``members`` the unit's ``(expert, leaves)``: rebuilt, or saved from forward):
    differentiated with its slice of the grouped output gradients ``gg``, and its weight
    gradients added (into ``main_grad`` or the accumulators) before the next unit's graph
    exists, so backward holds one unit's graph and weight gradients, never the chunk's.
    Input and probability gradients are written straight into the buffer sent back
    (``like``: their dtypes and widths, :func:`gradient_like`), in received order. Units'
    graphs are independent, so every value is what one ``autograd.grad`` over the whole
    chunk would give."""
    (dx_recv, dp_recv), back = step.empty_packed(like, gg.shape[0])
    for members, start, end, x, p, y, native in graphs:
        wanted, spread = gradient_targets(step, [(members, native)])
        grads = torch.autograd.grad(y, [x, p] + wanted, gg[start:end], allow_unused=True)
        del y
        step.put(dx_recv, i, start, end,
                 grads[0] if grads[0] is not None else torch.zeros_like(x))
        step.put(dp_recv, i, start, end,
                 grads[1] if grads[1] is not None else torch.zeros_like(p))
        accumulate_all(acc, spread(grads[2:]))
        del grads, x, p, members, wanted, spread
    return back


# ---------------------------------------------------------------------------- strategies
class ChunkStrategy:
    """One chunk's way from forward to backward (the module docstring lists them)."""

    resends_tokens = True

    def forward(self, step: "Step", i: int, received: list, weights: Sequence[torch.Tensor],
                helper: dict) -> torch.Tensor:
        """Chunk i's expert outputs in received order from ``received`` (``[x_recv,
        p_recv]``; the strategy takes them, so they can be freed as they are used)."""
        raise NotImplementedError

    def backward(self, step: "Step", i: int, received: list, weights: Sequence[torch.Tensor],
                 helper: dict, acc: dict):
        raise NotImplementedError


class Recomputed(ChunkStrategy):
    """Nothing kept; backward rebuilds each unit's graph from its re-sent rows."""

    def forward(self, step, i, received, weights, helper):
        bank = step.bank

        def run(unit, x, p):
            experts, _, _, counts = unit
            if counts is not None:
                return bank.run_native(x, p, counts)
            return bank.run(step.weights_of(experts[0], weights, helper), x, p)

        return each_unit(step, i, received, run)

    def first_layers(self) -> Optional[list]:
        """What forward saved per unit to stand in for the first layer (None: nothing)."""
        return None

    def backward(self, step, i, received, weights, helper, acc):
        xg, pg, gg = grouped(step, i, received)
        return differentiate(step, i, gg, gradient_like(step, xg, pg),
                             self._rebuilt(step, i, xg, pg, weights, helper), acc)

    def _rebuilt(self, step, i, xg, pg, weights, helper) -> Iterator[tuple]:
        """Each unit's graph rebuilt from its slice of the grouped rows, one at a time (the
        last linear layer's forward GEMM skipped by ``run_for_grad``; the first layer's too
        when forward saved its output)."""
        bank = step.bank
        run = bank.run_for_grad if hasattr(bank, "run_for_grad") else bank.run
        firsts = self.first_layers()
        for n, (experts, start, end, counts) in enumerate(units(step, i)):
            x = xg[start:end].detach().requires_grad_()
            p = pg[start:end].detach().requires_grad_()
            members = [(e, step.leaf(e, weights, helper)) for e in experts]
            first = None
            if firsts is not None:
                first, firsts[n] = firsts[n], None
            with torch.enable_grad():
                if counts is not None:  # the native experts' grouped call, own parameters
                    y = bank.run_native_for_grad(x, p, counts, first=first)
                elif first is None:
                    y = run(members[0][1], x, p)
                else:
                    y = run(members[0][1], x, p, first=first)
            del first
            yield members, start, end, x, p, y, counts is not None
            del x, p, members, y


class SavedFirstLayer(Recomputed):
    """A saved chunk whose bank hands back each expert's first-layer output (``run_saving``):
    forward saves it (None for an expert whose first layer cannot stand in), backward uses
    it instead of that GEMM; the rows come again with the backward dispatch."""

    def __init__(self) -> None:
        self.firsts: Optional[list] = None

    def first_layers(self) -> Optional[list]:
        firsts, self.firsts = self.firsts, None
        return firsts

    def forward(self, step, i, received, weights, helper):
        firsts = []
        bank = step.bank

        def run(unit, x, p):
            experts, _, _, counts = unit
            if counts is not None:
                y, first = bank.run_native_saving(x, p, counts)
            else:
                y, first = bank.run_saving(step.weights_of(experts[0], weights, helper), x, p)
            firsts.append(first)
            return y

        y_recv = each_unit(step, i, received, run)
        self.firsts = firsts
        return y_recv


class SavedGraph(ChunkStrategy):
    """A saved chunk of a bank without ``run_saving``: forward saves each expert's whole
    graph; backward dispatches only the output gradients and differentiates them."""

    resends_tokens = False

    def __init__(self) -> None:
        self.graphs: list = []
        self.like: tuple = ()

    def forward(self, step, i, received, weights, helper):
        graphs = []
        # dtype and width of the input and probability gradients sent back
        self.like = gradient_like(step, *received)

        def run(unit, x, p):
            (e,), start, end, _ = unit
            x, p = x.detach().requires_grad_(), p.detach().requires_grad_()
            leaves = step.leaf(e, weights, helper)
            with torch.enable_grad():
                y = step.bank.run(leaves, x, p)
            graphs.append(([(e, leaves)], start, end, x, p, y, False))
            return y.detach()

        y_recv = each_unit(step, i, received, run, native=False)
        self.graphs = graphs
        return y_recv

    def backward(self, step, i, received, weights, helper, acc):
        graphs, self.graphs = self.graphs, []
        (gg,) = grouped(step, i, received)
        return differentiate(step, i, gg, self.like, drain(graphs), acc)


class WholeGraph(ChunkStrategy):
    """``llep`` mode: the chunk's graph over all its experts held from forward to backward
    (inputs, activations), as plain autograd would; only output gradients are dispatched in
    backward, and the whole graph is differentiated at once."""

    resends_tokens = False

    def __init__(self) -> None:
        self.held: Optional[tuple] = None

    def forward(self, step, i, received, weights, helper):
        xg, pg = grouped(step, i, received)
        xg, pg = xg.detach().requires_grad_(), pg.detach().requires_grad_()
        leaves = step.leaves(i, weights, helper)
        with torch.enable_grad():
            yg = self._through(step, i, xg, pg, leaves.__getitem__)
        self.held = (xg, pg, leaves, yg)
        return step.ungroup(yg.detach(), i)

    @staticmethod
    def _through(step, i, xg, pg, weight_of) -> torch.Tensor:
        """Chunk i's grouped rows through their units (:func:`units`) as one graph."""
        bank = step.bank

        def run(unit, x, p):
            experts, _, _, counts = unit
            if counts is not None:
                return bank.run_native(x, p, counts)
            return bank.run(weight_of(experts[0]), x, p)

        chunk_units = units(step, i)
        if not chunk_units:
            return xg.new_empty((0,) + tuple(xg.shape[1:]))
        if len(chunk_units) == 1:
            return run(chunk_units[0], xg, pg)
        # torch.split, not slicing: split's backward is one cat, a slice's a full-size zeros.
        sizes = [t - s for _, s, t, _ in chunk_units]
        outs = [run(unit, x, p) for unit, x, p in
                zip(chunk_units, torch.split(xg, sizes), torch.split(pg, sizes))]
        return torch.cat(outs)

    def backward(self, step, i, received, weights, helper, acc):
        gg = step.group_rows(received[-1], i)
        received.clear()
        xg, pg, leaves, yg = self.held
        self.held = None
        if step.recv.segments[i]:
            wanted, spread = gradient_targets(step, [
                ([(e, leaves[e]) for e in experts], counts is not None)
                for experts, _, _, counts in units(step, i)])
            grads = list(torch.autograd.grad(yg, [xg, pg] + wanted, gg, allow_unused=True))
            dxg = grads[0] if grads[0] is not None else torch.zeros_like(xg)
            dpg = grads[1] if grads[1] is not None else torch.zeros_like(pg)
            accumulate_all(acc, spread(grads[2:]))
            del grads, wanted, spread
        else:
            dxg, dpg = xg.detach(), pg.detach()  # empty
        del xg, pg, yg, gg, leaves
        return step.pack([(dxg, None), (dpg, None)], group=step.recv.group[i])


def strategy_for(bank, *, graph: bool, saved: bool) -> ChunkStrategy:
    """The strategy of one chunk: ``graph`` (``llep`` mode with autograd on), ``saved`` (one
    of the first ``saved_chunks`` chunks of ``pipelined``), else recomputed. A bank that can
    hand back its first layer's output saves only that per expert; any other saves each
    expert's whole graph."""
    if graph:
        return WholeGraph()
    if saved:
        if hasattr(bank, "run_saving") and hasattr(bank, "run_for_grad"):
            return SavedFirstLayer()
        return SavedGraph()
    return Recomputed()
