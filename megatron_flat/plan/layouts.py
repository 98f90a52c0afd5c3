"""Searching the layout: which TP, CP, PP, DP and EP to split a model over a GPU count.

``candidate_layouts`` lists every layout the planner considers for ``gpus`` devices:
TP a divisor of the GPU count within one node (≤ ``gpus_per_node``), CP and PP divisors of
what is left, PP ≤ the layers, DP = gpus / (TP·CP·PP), EP a divisor of the expert count that
divides TP·CP·DP; ``check_layout`` drops what cannot split the model (heads, KV heads,
experts, layers). Sizes the user fixes (``--layout tp=8,cp=2`` or ``--tp 8``) are kept and
only the others are searched.

``search_layouts`` ranks the candidates for megatron-flat and for every baseline separately
(each run gets its own best layout, a fair comparison):

* by reach, the longest context each run fits at a layout (``fit.max_context``'s
  bisection): the best ``top`` per run, ties to the preferred layout (``preference``);
* at a sequence length, the layouts where flat fits it, by predicted step time
  (``plan.time`` over ``plan.costs``) at one global batch for all of them, so a layout with
  more DP replicas runs fewer microbatches on each.

The chosen layout is the fastest that fits the sequence, else (no sequence given, or it fits
nowhere) the one reaching furthest.

Cost: one reach costs ~30 bisection probes, each up to 15 ``fit`` subsets, and evaluating
every run at every candidate takes tens of seconds at 256 GPUs. Three prunings keep the
search near a second without changing its result:

* a run whose step does not fit at the current third-best reach cannot enter the top three
  (fits is monotone in the length): one probe settles it;
* EP narrower than one that fell short is skipped: within one TP·CP·PP·DP, narrowing EP only
  adds experts to each GPU (weights, gradients, optimizer shard and FSDP2's gathered layer
  grow as E/EP) while the routing skew the peaks assume is capped from EP 2 on;
  for ``fsdp2-cp`` (``EP_NOT_MONOTONE``) from EP 2 down only: its model state is on the host
  and its activations are small enough that EP 1's balanced routing and missing all-to-all
  buffers can outweigh the gathered layer's extra experts, so EP 1 is always evaluated;
* DP > 1 is skipped when the same layout with that DP folded into CP fell short: the GPUs
  hold the same parameter shards (dense over DP·CP, experts over TP·CP·DP/EP) and CP only
  divides the tokens each holds.

``tests/plan/test_layouts.py`` checks the last two, which are facts of the peak model, over
every layout of several presets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from megatron_flat.config import FlatConfig
from megatron_flat.plan.baselines import BASELINES
from megatron_flat.plan.costs import UNITS, unit_costs
from megatron_flat.plan.fit import (
    KNOBS,
    MIN_CHUNK_TOKENS,
    bisect_reach,
    fit,
    reach_predicates,
    seq_granularity,
)
from megatron_flat.plan.model import Layout, ModelSpec, PlanError, check_layout
from megatron_flat.plan.peaks import DEFAULT_SKEW, PeakReport, estimate
from megatron_flat.plan.time import Prediction, predict

__all__ = ["GPU_COUNTS", "LAYOUT_KEYS", "RUNS", "SAME_SPEED", "TOP", "Fewest", "LayoutSearch",
           "Ranked", "candidate_layouts", "check_fixed", "fewest_gpus", "layout_sizes",
           "layout_text", "parse_layout", "preference", "search_layouts", "step_seconds",
           "unit_times"]

LAYOUT_KEYS = ("tp", "cp", "pp", "ep", "dp")
TOP = 3  # layouts listed per run
# Predicted steps within this fraction of the fastest count as equally fast, and the longest
# reach among them wins: the step-time model does not price TP's and CP's collectives (nor
# the pipeline's), so smaller differences do not tell layouts apart, while reach is headroom.
SAME_SPEED = 0.01
RUNS = ("flat",) + BASELINES
# Runs for which EP 1 can reach further than a wider EP (the module docstring): EP 1 is never
# pruned for them.
EP_NOT_MONOTONE = frozenset({"fsdp2-cp"})


# ------------------------------------------------------------------------------ input


def parse_layout(text: str) -> Dict[str, int]:
    """``"tp=8,cp=2,pp=1,ep=64"`` → ``{"tp": 8, "cp": 2, "pp": 1, "ep": 64}``.

    Any subset of ``LAYOUT_KEYS`` (``dp`` too), each once, each a positive integer; anything
    else raises one ``PlanError`` that names the offending item and what is allowed.
    """
    usage = (f"--layout takes comma-separated key=value pairs with keys "
             f"{', '.join(LAYOUT_KEYS)} and positive integer values, e.g. tp=8,cp=2,pp=1,ep=64")
    out: Dict[str, int] = {}
    items = [item.strip() for item in str(text).split(",")]
    if not any(items):
        raise PlanError(f"--layout is empty; {usage}")
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not key:
            raise PlanError(f"--layout item {item!r} is not key=value; {usage}")
        if key not in LAYOUT_KEYS:
            raise PlanError(f"--layout key {key!r} is not one of {', '.join(LAYOUT_KEYS)}; "
                            f"{usage}")
        if key in out:
            raise PlanError(f"--layout gives {key} twice; {usage}")
        if not value.isdigit() or int(value) < 1:
            raise PlanError(f"--layout {key}={value!r}: not a positive integer; {usage}")
        out[key] = int(value)
    return out


def check_fixed(model: ModelSpec, gpus: int,
                fixed: Mapping[str, Optional[int]]) -> Dict[str, int]:
    """The fixed sizes without the unset ones; ``PlanError`` when they cannot go together
    with ``model`` on ``gpus`` devices whatever the other sizes are."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise PlanError(f"GPU count must be a positive integer, got {gpus!r}")
    sizes = {k: v for k, v in fixed.items() if v is not None}
    for key, value in sizes.items():
        if key not in LAYOUT_KEYS:
            raise PlanError(f"layout key {key!r} is not one of {', '.join(LAYOUT_KEYS)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"--{key} must be a positive integer, got {value!r}")
    # The model's own limits on each size: TP by the heads, EP by the experts, PP by the
    # layers (check_layout's messages; DP = EP keeps the layout itself valid).
    tp, ep, pp = sizes.get("tp", 1), sizes.get("ep", 1), sizes.get("pp", 1)
    check_layout(model, Layout(tp=tp, ep=ep, pp=pp, dp=ep))
    dims = [k for k in ("tp", "cp", "pp", "dp") if k in sizes]
    product = math.prod(sizes[k] for k in dims)
    if gpus % product or ("dp" in sizes and len(dims) == 4 and product != gpus):
        shown = " x ".join(f"{k.upper()} {sizes[k]}" for k in dims)
        raise PlanError(f"layout {shown} = {product} does not divide {gpus} GPUs")
    return sizes


# --------------------------------------------------------------------------- candidates


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def preference(layout: Layout) -> Tuple[int, int, int, int]:
    """Sort key among layouts that are otherwise equal (reach or step time tied): PP 1 first
    (no pipeline bubble, no boundaries of other microbatches in flight), then the least DP
    (one sequence sharded as far as possible), the widest TP (kept in the node), the widest
    EP: ``default_layout``'s choices."""
    return (layout.pp, layout.dp, -layout.tp, -layout.ep)


def candidate_layouts(model: ModelSpec, gpus: int,
                      fixed: Optional[Mapping[str, Optional[int]]] = None, *,
                      gpus_per_node: int = 8, **kw) -> List[Layout]:
    """Every layout of ``gpus`` devices that can split ``model`` and keeps ``fixed``, in
    ``preference`` order (so within one TP·CP·PP·DP the EPs come widest first).

    TP that is not fixed stays within a node (≤ ``gpus_per_node``); ``kw`` goes to every
    ``Layout`` (micro-batch size, ...). ``PlanError`` when no layout is left, saying why.
    """
    sizes = check_fixed(model, gpus, fixed or {})
    out: List[Layout] = []
    for tp in _divisors(gpus):
        if tp != sizes.get("tp", tp) or ("tp" not in sizes and tp > gpus_per_node):
            continue
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if (cp, pp, dp) != (sizes.get("cp", cp), sizes.get("pp", pp),
                                    sizes.get("dp", dp)) or pp > model.layers:
                    continue
                room = tp * cp * dp
                eps = [sizes["ep"]] if "ep" in sizes else \
                    [e for e in _divisors(room) if e == 1 or model.experts % e == 0]
                for ep in eps:
                    try:
                        layout = Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep,
                                        gpus_per_node=gpus_per_node, **kw)
                        check_layout(model, layout)
                    except PlanError:
                        continue
                    out.append(layout)
    if not out:
        # Say why with the simplest layout that keeps the fixed sizes (the rest 1, DP last).
        rest = {k: sizes.get(k, 1) for k in ("tp", "cp", "pp", "ep")}
        Layout.for_gpus(gpus, gpus_per_node=gpus_per_node, **rest, **kw)
        raise PlanError(f"no layout of {gpus} GPUs keeps "
                        f"{', '.join(f'{k.upper()} {v}' for k, v in sizes.items())} and "
                        f"splits {model.name} (TP within a node of {gpus_per_node} dividing "
                        f"the heads, EP dividing the experts and TP·CP·DP, PP ≤ layers)")
    return sorted(out, key=preference)


def layout_text(layout: Layout) -> str:
    """``TP 8 CP 2 PP 1 DP 1 EP 16``: a layout in one column of a table."""
    return f"TP {layout.tp} CP {layout.cp} PP {layout.pp} DP {layout.dp} EP {layout.ep}"


def layout_sizes(layout: Layout) -> Dict[str, int]:
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "ep": layout.ep, "dp": layout.dp}


# ---------------------------------------------------------------------------- step time


def unit_times(model: ModelSpec, layout: Layout, report: PeakReport,
               flat: Optional[FlatConfig], device: str) -> Dict[str, Prediction]:
    """Predicted seconds of each unit (``costs.UNITS``) of ``report``'s stage on ``device``:
    per microbatch, the optimizer per step. ``flat=None``: the baseline ``report`` is of."""
    return {unit: predict(counts, overlap, device)
            for unit, (counts, overlap) in unit_costs(model, layout, report, flat).items()}


def step_seconds(times: Mapping[str, Prediction], microbatches: int, stages: int = 1) -> float:
    """Predicted step from ``unit_times``: the units are disjoint (experts in dispatch,
    attention in boundaries, the output layer in vocab; norms and embeddings are left out),
    each once per microbatch on the worst stage, plus PP − 1 more for the 1F1B pipeline's
    fill and drain (``stages`` = PP; without it more stages would look free), and the
    optimizer once per step."""
    per_mb = sum(times[u].total_s for u in UNITS if u != "optimizer")
    return (microbatches + stages - 1) * per_mb + times["optimizer"].total_s


# ------------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Ranked:
    """One layout's standing for one run: its ``reach`` (tokens; 0: fits no length) and,
    for flat at the asked length, the predicted ``step_s`` with ``microbatches`` per DP
    replica (the global batch over micro-batch size × DP)."""

    layout: Layout
    reach: int
    step_s: Optional[float] = None
    microbatches: Optional[int] = None

    def as_dict(self) -> dict:
        out: dict = dict(layout_sizes(self.layout), reach_tokens=self.reach)
        if self.step_s is not None:
            out.update(predicted_step_s=self.step_s, microbatches=self.microbatches)
        return out


@dataclass
class LayoutSearch:
    """What ``search_layouts`` found.

    ``reach``: per run (``"flat"`` and each baseline), its best layouts by reach, at most
    ``top``, longest first (empty: the run fits no length at any layout). ``fastest``: the
    layouts where flat fits ``seq_len`` with the global batch, at most ``top``: those within
    ``SAME_SPEED`` of the quickest step by reach, then the others by step. ``chosen``: the
    layout the plan uses; ``chosen_by`` says by which rule (``"fastest"``, ``"reach"``,
    ``"preferred"``: nothing fits at any length, or ``"fixed"``: one candidate).
    """

    gpus: int
    fixed: Dict[str, int]
    candidates: int
    seq_len: Optional[int]
    global_batch: int
    reach: Dict[str, List[Ranked]]
    fastest: List[Ranked]
    chosen: Layout
    chosen_by: str
    fits_at_seq: int = 0      # layouts timed: flat fits seq_len and DP divides the batch
    bisections: int = 0       # reach bisections run (the rest were settled without one)

    @property
    def searched(self) -> Tuple[str, ...]:
        """The sizes the search chose (not fixed; DP follows from the others)."""
        return tuple(k for k in ("tp", "cp", "pp", "ep") if k not in self.fixed)

    def best(self, run: str) -> Optional[Ranked]:
        """The run's layout reaching furthest; None when it fits no length anywhere."""
        ranked = self.reach.get(run) or []
        return ranked[0] if ranked else None

    def best_reach(self, run: str) -> int:
        best = self.best(run)
        return best.reach if best else 0

    def strongest(self) -> Optional[str]:
        """The baseline reaching furthest at its own best layout (``BASELINES`` order on
        ties); None when no baseline was evaluated."""
        names = [n for n in BASELINES if n in self.reach]
        if not names:
            return None
        return max(names, key=lambda n: (self.best_reach(n), -BASELINES.index(n)))

    def ratio(self) -> Optional[float]:
        """flat's reach over the strongest baseline's, each at its own best layout; None when
        no baseline fits at any length."""
        best = self.strongest()
        if best is None or not self.best_reach(best):
            return None
        return self.best_reach("flat") / self.best_reach(best)


def _splits(model: ModelSpec, layout: Layout, seq_len: int) -> bool:
    """Whether ``layout`` can split ``seq_len`` tokens (CP's 2·CP chunks, SP's TP shares)."""
    try:
        estimate(model, layout, seq_len)
    except PlanError:
        return False
    return True


def _groups(layouts: Iterable[Layout]) -> List[List[Layout]]:
    """Consecutive layouts sharing TP·CP·PP·DP (EP widest first, as ``preference`` sorts)."""
    out: List[List[Layout]] = []
    for layout in layouts:
        key = (layout.tp, layout.cp, layout.pp, layout.dp)
        if out and (out[-1][0].tp, out[-1][0].cp, out[-1][0].pp, out[-1][0].dp) == key:
            out[-1].append(layout)
        else:
            out.append([layout])
    return out


def _folded(layout: Layout) -> Optional[Layout]:
    """``layout`` with its DP folded into CP (reaches at least as far; see the module
    docstring), when the two visit the same lengths; None otherwise."""
    if layout.dp == 1:
        return None
    folded = layout.with_(cp=layout.cp * layout.dp, dp=1)
    return folded if seq_granularity(folded) == seq_granularity(layout) else None


def _rank_key(r: Ranked) -> tuple:
    return (-r.reach,) + preference(r.layout)


class _Short:
    """Per run, what is known to fall short: layouts pruned (reach below a threshold that
    has only grown since) and reaches found."""

    def __init__(self, reach: Optional[Mapping[Layout, int]] = None):
        self.pruned: set = set()
        self.reach: Dict[Layout, int] = dict(reach or {})

    def below(self, layout: Optional[Layout], threshold: int) -> bool:
        """``layout`` is known to reach less than ``threshold``."""
        if layout is None:
            return False
        return layout in self.pruned or self.reach.get(layout, threshold) < threshold


def _top_by_reach(layouts: List[Layout], runs: Tuple[str, ...], predicates, top: int,
                  limit: int, known: Optional[Mapping[str, Mapping[Layout, int]]] = None
                  ) -> Tuple[Dict[str, List[Ranked]], Dict[str, _Short], int]:
    """The best ``top`` of ``layouts`` (in ``preference`` order) by reach, per run in
    ``runs``: ``({run: ranked}, {run: what fell short}, bisections run)``.

    ``predicates(layout)`` gives ``reach_predicates``'s ``{run: fits}``; ``known`` exact
    reaches already found (reused, not recomputed). The three prunings of the module
    docstring skip only layouts that cannot enter a top ``top``.
    """
    tops: Dict[str, List[Ranked]] = {run: [] for run in runs}
    short = {run: _Short((known or {}).get(run)) for run in runs}
    bisections = 0
    for group in _groups(layouts):
        alive = set(runs)   # runs a narrower EP of this group can still rank for
        for layout in group:
            preds = predicates(layout)
            g = seq_granularity(layout)
            folded = _folded(layout)
            for run in runs:
                if run not in preds:
                    continue
                ranked = tops[run]
                full = len(ranked) >= top
                threshold = ranked[-1].reach if full else 0
                # EP 1 is evaluated for every run the facts do not cover (balanced routing,
                # no all-to-all), even after a wider EP fell short.
                gone = run not in alive and not (run in EP_NOT_MONOTONE and layout.ep == 1)
                if gone or (full and short[run].below(folded, threshold)):
                    short[run].pruned.add(layout)
                    continue
                reach = short[run].reach.get(layout)
                if reach is None:
                    known_fits = 0
                    if full:
                        # Only a reach of at least the current last one can enter: one probe
                        # at the first length it could have settles the rest.
                        probe = -(-threshold // g) * g
                        if probe > limit or not preds[run](probe):
                            alive.discard(run)
                            short[run].pruned.add(layout)
                            continue
                        known_fits = probe
                    reach = bisect_reach(preds[run], g, limit, known_fits)
                    bisections += 1
                    short[run].reach[layout] = reach
                if not reach or (full and reach < threshold):
                    alive.discard(run)
                    continue
                ranked.append(Ranked(layout, reach))
                ranked.sort(key=_rank_key)
                del ranked[top:]
    return tops, short, bisections


def search_layouts(model: ModelSpec, gpus: int, device_bytes: int,
                   host_bytes: Optional[int] = None, *,
                   fixed: Optional[Mapping[str, Optional[int]]] = None,
                   seq_len: Optional[int] = None, device: str = "H200",
                   microbatches: int = 1, global_batch: Optional[int] = None,
                   top: int = TOP, margin: float = 0.1, host_margin: float = 0.1,
                   skew: float = DEFAULT_SKEW, min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                   gpus_per_node: int = 8, micro_batch_size: int = 1,
                   limit: int = 1 << 30, allow: Sequence[str] = KNOBS) -> LayoutSearch:
    """Rank every candidate layout (``candidate_layouts``) for flat and every baseline.

    Reach per run and layout is ``max_context``'s (same margins, skew, host budget), exact
    for every layout that enters a run's top ``top``; the prunings (module docstring) only
    skip layouts that cannot. With ``seq_len``, every layout that can split it, whose DP
    divides the global batch and where flat fits is timed: ``fit``'s knobs, ``step_seconds``
    on ``device`` with global batch / (micro-batch size × DP) microbatches per replica.
    ``global_batch`` (sequences per step) defaults to ``microbatches`` × micro-batch size ×
    the smallest DP among the candidates (1 when DP is searched: one replica's batch, so a
    DP > 1 is timed only with a larger ``global_batch``).

    ``allow``: the techniques flat may turn on (``fit``'s; attention replay among them, which
    speeds up the steps timed).

    ``fastest``: the timed layouts within ``SAME_SPEED`` of the fastest predicted step,
    longest reach first, then the others by step time. The chosen layout is its first;
    else (no ``seq_len``, or flat fits it nowhere) the first of flat's best ``top`` by reach
    that can split ``seq_len``; else the preferred candidate that can. ``PlanError`` for
    fixed sizes no layout has, or a ``seq_len`` no candidate can split.
    """
    if top < 1:
        raise PlanError(f"top must be >= 1, got {top}")
    if microbatches < 1:
        raise PlanError(f"microbatches must be >= 1, got {microbatches}")
    sizes = check_fixed(model, gpus, fixed or {})
    cands = candidate_layouts(model, gpus, sizes, gpus_per_node=gpus_per_node,
                              micro_batch_size=micro_batch_size)
    if global_batch is None:
        # The layouts with the fewest replicas run ``microbatches`` each (with DP fixed, or
        # implied by fixed TP·CP·PP, that is every layout: the flag's plain meaning).
        global_batch = microbatches * micro_batch_size * min(lay.dp for lay in cands)
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch must be a positive integer, got {global_batch!r}")
    if seq_len is not None and not any(_splits(model, lay, seq_len) for lay in cands):
        estimate(model, cands[0], seq_len)  # raises with the reason for the preferred layout
    kw = dict(margin=margin, host_margin=host_margin, skew=skew,
              min_chunk_tokens=min_chunk_tokens, allow=allow)
    cache: Dict[Layout, dict] = {}

    def predicates(layout: Layout) -> dict:
        if layout not in cache:
            cache[layout] = reach_predicates(model, layout, device_bytes, host_bytes, **kw)
        return cache[layout]

    tops, short, bisections = _top_by_reach(cands, RUNS, predicates, top, limit)

    # Time flat at seq_len where it fits. EP is tried widest first and a narrower one is
    # skipped once a wider one does not fit, as is a DP > 1 whose CP-folded layout does
    # not (the prunings of the module docstring, for fits at one length).
    timed: List[Ranked] = []
    misses: set = set()
    for group in _groups(cands) if seq_len is not None else []:
        lead = group[0]
        if not _splits(model, lead, seq_len) or global_batch % (micro_batch_size * lead.dp):
            continue
        for i, layout in enumerate(group):
            entry = None if _folded(layout) in misses else \
                _time(model, layout, seq_len, device_bytes, host_bytes,
                      predicates(layout)["flat"], device=device,
                      microbatches=global_batch // (micro_batch_size * layout.dp), **kw)
            if entry is None:
                misses.update(group[i:])
                break
            timed.append(entry)
    fastest: List[Ranked] = []
    if timed:
        quickest = min(r.step_s for r in timed)
        same = [r for r in timed if r.step_s <= quickest * (1 + SAME_SPEED)]
        steps = {r.layout: r for r in same}
        by_reach, _, more = _top_by_reach(sorted(steps, key=preference), ("flat",), predicates,
                                          top, limit, known={"flat": short["flat"].reach})
        bisections += more
        fastest = [replace(steps[r.layout], reach=r.reach) for r in by_reach["flat"]]
        rest = sorted((r for r in timed if r.layout not in steps),
                      key=lambda r: (r.step_s,) + preference(r.layout))
        for r in rest[:max(0, top - len(fastest))]:
            reach = short["flat"].reach.get(r.layout)
            if reach is None:
                reach = bisect_reach(predicates(r.layout)["flat"], seq_granularity(r.layout),
                                     limit)
            fastest.append(replace(r, reach=reach))
    if fastest:
        chosen, chosen_by = fastest[0].layout, "fastest"
    else:
        ok = [r.layout for r in tops["flat"]
              if seq_len is None or _splits(model, r.layout, seq_len)]
        if ok:
            chosen, chosen_by = ok[0], "reach"
        else:
            chosen = next(lay for lay in cands if seq_len is None or _splits(model, lay, seq_len))
            chosen_by = "preferred"
    if len(cands) == 1:
        chosen_by = "fixed"
    return LayoutSearch(gpus=gpus, fixed=sizes, candidates=len(cands), seq_len=seq_len,
                        global_batch=global_batch, reach=tops, fastest=fastest, chosen=chosen,
                        chosen_by=chosen_by, fits_at_seq=len(timed), bisections=bisections)


def _time(model, layout, seq_len, device_bytes, host_bytes, flat_fits, *, device,
          microbatches, **kw) -> Optional[Ranked]:
    """flat at ``seq_len`` on ``layout`` with ``microbatches`` per replica: ``fit``'s knobs
    and the predicted step (reach filled in by the caller); None when it does not fit."""
    if not flat_fits(seq_len):
        return None
    chosen = fit(model, layout, seq_len, device_bytes, host_bytes, device=device, **kw)
    times = unit_times(model, layout, chosen.report, chosen.flat, device)
    return Ranked(layout, 0, step_seconds(times, microbatches, layout.pp), microbatches)


# ------------------------------------------------------------------------ fewest GPUs

GPU_COUNTS = tuple(1 << i for i in range(11))  # 1, 2, 4, ... 1024: what fewest_gpus tries
WITHOUT_PARAM_OFFLOAD = "flat_without_param_offload"


@dataclass(frozen=True)
class Fewest:
    """The fewest GPUs (of ``GPU_COUNTS``) on which one run's step fits a sequence, and the
    first layout (``preference`` order) it fits there; ``gpus`` 0: none of them."""

    run: str
    gpus: int
    layout: Optional[Layout]

    def as_dict(self) -> dict:
        out: dict = {"gpus": self.gpus or None}
        if self.layout is not None:
            out.update(layout_sizes(self.layout))
        return out


def fewest_gpus(model: ModelSpec, seq_len: int, device_bytes: int,
                host_bytes: Optional[int] = None, *, counts: Sequence[int] = GPU_COUNTS,
                gpus_per_node: int = 8, micro_batch_size: int = 1,
                allow: Sequence[str] = KNOBS, **kw) -> Dict[str, Fewest]:
    """For flat, flat without param offload and every baseline: the fewest GPUs of
    ``counts`` (tried in ascending order) with a layout on which the run's step fits
    ``seq_len`` tokens, by the same predicates as the reach (``fit.reach_predicates``: one
    probe per layout, no bisection). ``kw``: margin, host_margin, skew, min_chunk_tokens.
    """
    runs = ("flat", WITHOUT_PARAM_OFFLOAD) + BASELINES
    found: Dict[str, Fewest] = {}
    without = tuple(t for t in allow if t != "param_offload")
    for gpus in sorted(set(int(c) for c in counts)):
        if len(found) == len(runs):
            break
        try:
            layouts = candidate_layouts(model, gpus, gpus_per_node=gpus_per_node,
                                        micro_batch_size=micro_batch_size)
        except PlanError:
            continue
        for layout in layouts:
            if len(found) == len(runs) or not _splits(model, layout, seq_len):
                continue
            preds = reach_predicates(model, layout, device_bytes, host_bytes, allow=allow, **kw)
            if WITHOUT_PARAM_OFFLOAD not in found:
                preds[WITHOUT_PARAM_OFFLOAD] = reach_predicates(
                    model, layout, device_bytes, host_bytes, allow=without, **kw)["flat"]
            for run in runs:
                if run not in found and run in preds and preds[run](seq_len):
                    found[run] = Fewest(run, gpus, layout)
    return {run: found.get(run, Fewest(run, 0, None)) for run in runs}
