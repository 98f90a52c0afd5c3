"""Choosing the knobs (``fit``) and the reach (``max_context``).

``fit`` answers "which techniques, with which knobs, make this step fit this device?":

1. If the baseline fits, nothing is turned on.
2. Otherwise subsets of the techniques are tried, fewest first and, among equally many,
   cheapest first (``TECHNIQUES`` is ordered by overhead: chunking the dispatch costs the
   least, then the vocabulary ring, then boundary offload over PCIe, then the optimizer's
   28 B/param of PCIe traffic per step; the attention block's sequence tiles come last, the
   fifth peak's technique, turned on only when the four are not enough, and only where
   they apply: sequence parallelism over TP > 1). Each enabled technique is first set to its
   smallest-memory setting; pinned host memory goes to the optimizer state first (it moves
   all at once or not at all), the rest to boundaries.
3. The first subset that fits is relaxed knob by knob toward its cheapest setting while the
   step still fits: 2 optimizer staging slots and the largest bucket (≤ 100M params), the
   ``auto`` ring schedule, the fewest dispatch chunks (one chunk: plain LLEP, ``dispatch =
   "llep"``, which still evens the load), the fewest offloaded boundaries, the largest
   attention tile (doubling from ``ATTN_TILE_TOKENS``).

4. Attention replay (``attn_replay``), a speed knob, not a memory one: under full recompute
   it keeps each layer's core-attention output (O and its log-sum-exp) in SCO's host pool so
   the recompute skips that kernel. It is turned on last, where the layout runs full
   recompute, the node's pinned host memory holds its L_s·m slots of O + LSE beside the
   optimizer state and SCO's boundaries, the device still holds the step with one of them
   prefetched, and the step-time model predicts the step faster. SCO's pool is filled first
   come (each layer's boundary before its O + LSE), so keeping every layer's outputs takes
   every boundary too: SCO is turned on (if off) with a budget of L_s·m·(B + O + LSE). Off,
   ``Fit.attn_replay_why`` says why. It adds device bytes, so it never extends the reach; a
   plan whose baseline fits runs stock Megatron: nothing is turned on, replay neither.

When nothing fits, ``PlanError`` says by how much and which term binds at the smallest-
memory setting. ``max_context`` bisects the longest sequence for which the baseline fits and
for which ``fit`` succeeds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

from megatron_flat.config import GIB, FlatConfig
from megatron_flat.plan.baselines import BASELINES, allowed
from megatron_flat.plan.costs import ATTN_TILE_TOKENS
from megatron_flat.plan import param_offload as po_term
from megatron_flat.plan.model import Layout, ModelSpec, PlanError
from megatron_flat.plan.peaks import (
    DEFAULT_SKEW,
    PeakReport,
    estimate,
    gathers_sequence,
    usable,
)

TECHNIQUES = ("dispatch", "vocab", "sco", "optimizer_offload", "attn_tiles", "param_offload")
# Param offload runs only beside these (``FlatConfig`` refuses it alone).
NEEDS = {"param_offload": ("dispatch", "optimizer_offload")}
# Knobs that only save time: fit turns them on after the memory techniques, where they fit.
SPEED_KNOBS = ("attn_replay",)
# What ``allow`` may name (every one by default).
KNOBS = TECHNIQUES + SPEED_KNOBS
TECHNIQUE_NAMES = {"dispatch": "PipelinedLLEP", "vocab": "Ring-DTP", "sco": "SCO",
                   "optimizer_offload": "OffloadStreamAdamW", "attn_tiles": "attention tiles",
                   "attn_replay": "attention replay", "param_offload": "param offload"}
BUCKET_LADDER = (100_000_000, 50_000_000, 25_000_000, 10_000_000, 5_000_000, 1_000_000)
MIN_CHUNK_TOKENS = 1024  # smallest per-source chunk fit will choose (GEMM efficiency)
MIB = 1 << 20
# What turning a technique on sets in FlatConfig.
SWITCH_ON = {"dispatch": {"dispatch": "pipelined"}, "vocab": {"vocab": True},
             "sco": {"sco": True}, "optimizer_offload": {"optimizer_offload": True},
             "attn_tiles": {"attn_tiles": ATTN_TILE_TOKENS},
             "param_offload": {"param_offload": True}}


def enabled(flat: Optional[FlatConfig], technique: str) -> bool:
    """Whether ``technique`` (a name in ``TECHNIQUES``) is on in ``flat``; dispatch counts as
    on for "llep" and "pipelined"."""
    if flat is None:
        return False
    value = getattr(flat, technique)
    return value != "off" if technique == "dispatch" else bool(value)


def applies(technique: str, layout: Layout) -> bool:
    """Whether ``technique`` can run on ``layout``: the attention tiles need sequence
    parallelism over TP > 1, param offload expert parallelism (``install`` refuses them
    otherwise); the others always can."""
    if technique == "attn_tiles":
        return gathers_sequence(layout)
    if technique == "param_offload":
        return po_term.applies(layout) is None
    return True


class DoesNotFit(PlanError):
    """No allowed combination of techniques fits; ``best`` is the smallest-memory report."""

    def __init__(self, message: str, best: PeakReport):
        super().__init__(message)
        self.best = best


@dataclass
class Fit:
    """The knobs ``fit`` chose and the peaks they give.

    ``flat``: the FlatConfig to launch with (everything off when the baseline fits);
    ``report``: its peaks; ``baseline``: the peaks without megatron-flat; ``budget``: usable
    device bytes (device size less the margin); ``host_budget``: usable pinned host bytes
    per device (None: not limited); ``enabled``: the memory techniques turned on (SCO may
    also be on as attention replay's host pool alone); ``attn_replay_why``: why attention
    replay is off (None: ``flat.attn_replay`` is on); ``without_replay``: the knobs before
    replay was turned on (None when it is off), what the step would run without it.
    """

    flat: FlatConfig
    report: PeakReport
    baseline: PeakReport
    budget: int
    host_budget: Optional[int]
    enabled: Tuple[str, ...]
    attn_replay_why: Optional[str] = None
    without_replay: Optional[FlatConfig] = None


@dataclass(frozen=True)
class Reach:
    """Longest sequence (tokens per sample) that fits, a multiple of ``granularity``; 0 when
    not even ``granularity`` tokens fit. ``baseline``: stock Megatron's; ``baselines``: every
    baseline the layout allows (``plan.baselines``), by name; ``flat_without_attn_tiles``:
    flat's reach with the attention tiles not allowed (``flat`` where they do not apply or
    were not allowed anyway); ``flat_without_param_offload``: the same for param offload."""

    baseline: int
    flat: int
    granularity: int
    baselines: Dict[str, int] = field(default_factory=dict)
    flat_without_attn_tiles: int = 0
    flat_without_param_offload: int = 0

    def strongest(self) -> Optional[str]:
        """The baseline reaching furthest (first in ``BASELINES`` order on ties)."""
        if not self.baselines:
            return None
        return max(self.baselines, key=lambda n: (self.baselines[n], -BASELINES.index(n)))

    def ratio(self) -> Optional[float]:
        """flat ÷ the strongest baseline's reach; None when no baseline fits at any length."""
        best = self.strongest()
        if best is None or not self.baselines[best]:
            return None
        return self.flat / self.baselines[best]


def host_budget_per_device(layout: Layout, host_bytes: Optional[int],
                           host_margin: float) -> Optional[int]:
    """Pinned host bytes one device may use: the node's memory less a margin, shared by the
    node's GPUs (``layout.gpus_per_node``, or all of them when the job is smaller)."""
    if host_bytes is None:
        return None
    if not 0 <= host_margin < 1:
        raise PlanError(f"host margin must be a fraction in [0, 1), got {host_margin!r}")
    return int(host_bytes * (1.0 - host_margin)) // min(layout.gpus_per_node, layout.gpus)


class _Planner:
    """Shared state of one fit / max-context question."""

    def __init__(self, model, layout, device_bytes, host_bytes, margin, host_margin, skew,
                 min_chunk_tokens, allow, device="H200"):
        unknown = [t for t in allow if t not in KNOBS]
        if unknown:
            raise PlanError(f"unknown technique(s) {', '.join(unknown)}; choose from "
                            f"{', '.join(KNOBS)}")
        if device_bytes is None or device_bytes <= 0:
            raise PlanError(f"device memory must be positive, got {device_bytes!r}")
        self.model, self.layout, self.skew = model, layout, skew
        self.device = device  # what attention replay's speed is predicted for
        self.budget = usable(device_bytes, margin)
        self.host_budget = host_budget_per_device(layout, host_bytes, host_margin)
        self.min_chunk = max(1, int(min_chunk_tokens))
        chosen = [t for t in TECHNIQUES if t in allow and applies(t, layout)]
        self.allow = tuple(t for t in chosen if all(n in chosen for n in NEEDS.get(t, ())))
        self.replay_allowed = "attn_replay" in allow

    # -- predicates -----------------------------------------------------------------------
    def estimate(self, seq: int, flat: Optional[FlatConfig],
                 baseline: str = "megatron") -> PeakReport:
        return estimate(self.model, self.layout, seq, flat, skew=self.skew, baseline=baseline)

    def ok(self, report: PeakReport) -> bool:
        host_ok = self.host_budget is None or report.host_per_device <= self.host_budget
        return report.total <= self.budget and host_ok

    def subsets(self) -> Iterable[Tuple[str, ...]]:
        """Subsets of the allowed techniques in the order ``fit`` tries them: those of the
        first five, fewest first, cheapest first; then those with param offload (the sixth,
        tried only when the five cannot hold the step), each with what it needs."""
        rank = {t: i for i, t in enumerate(TECHNIQUES)}
        subs = [s for r in range(1, len(self.allow) + 1)
                for s in itertools.combinations(self.allow, r)
                if all(n in s for t in s for n in NEEDS.get(t, ()))]
        return sorted(subs, key=lambda s: ("param_offload" in s, len(s),
                                           sum(rank[t] for t in s)))

    # -- smallest-memory setting of a subset ---------------------------------------------
    def tightest(self, seq: int, techniques: Sequence[str]) -> Optional[FlatConfig]:
        """All of ``techniques`` at their smallest-memory knobs; None if the pinned host
        memory cannot hold the optimizer state."""
        kw = {k: v for t in techniques for k, v in SWITCH_ON[t].items()}
        host_left = math.inf if self.host_budget is None else self.host_budget
        probe = self.estimate(seq, FlatConfig(**kw, optimizer_bucket_numel=BUCKET_LADDER[-1],
                                              optimizer_num_slots=1))
        if "optimizer_offload" in techniques:
            # Param offload's host tier goes with the optimizer state: both all or nothing.
            if probe.optimizer_host + probe.params_host > host_left:
                return None
            host_left -= probe.optimizer_host + probe.params_host
            kw.update(optimizer_bucket_numel=BUCKET_LADDER[-1], optimizer_num_slots=1)
        if "dispatch" in techniques:
            c = self.min_chunk
            kw.update(dispatch_chunk_tokens=c,
                      dispatch_max_chunks=max(1, math.ceil(probe.tokens_sp / c)))
        if "sco" in techniques:
            offload = min(probe.boundaries_held * probe.boundary_bytes, host_left)
            n = offload // probe.boundary_bytes if probe.boundary_bytes else 0
            kw.update(sco_host_budget_gib=_budget_gib(n * probe.boundary_bytes,
                                                      probe.boundary_bytes))
        if "vocab" in techniques:
            best = None
            for mode in ("weights", "activations"):
                r = self.estimate(seq, FlatConfig(**{**kw, "vocab_mode": mode}))
                if best is None or r.vocab < best[0]:
                    best = (r.vocab, mode)
            kw["vocab_mode"] = best[1]
        return FlatConfig(**kw)

    def first_fitting(self, seq: int) -> Optional[Tuple[Tuple[str, ...], FlatConfig]]:
        for techniques in self.subsets():
            cfg = self.tightest(seq, techniques)
            if cfg is not None and self.ok(self.estimate(seq, cfg)):
                return techniques, cfg
        return None

    # -- relaxation -----------------------------------------------------------------------
    def relax(self, seq: int, cfg: FlatConfig) -> FlatConfig:
        def fits(c: FlatConfig) -> bool:
            return self.ok(self.estimate(seq, c))

        if cfg.optimizer_offload:
            for slots in (2, 1):
                for bucket in BUCKET_LADDER:
                    trial = replace(cfg, optimizer_num_slots=slots, optimizer_bucket_numel=bucket)
                    if fits(trial):
                        cfg = trial
                        break
                else:
                    continue
                break
        if cfg.vocab and cfg.vocab_mode != "auto" and fits(replace(cfg, vocab_mode="auto")):
            cfg = replace(cfg, vocab_mode="auto")
        if cfg.dispatch == "pipelined":
            n_sp = self.estimate(seq, cfg).tokens_sp
            lo, hi = 1, max(1, cfg.dispatch_max_chunks)  # fewest chunks that fit, in [lo, hi]

            def with_k(k: int) -> FlatConfig:
                return replace(cfg, dispatch_chunk_tokens=max(1, math.ceil(n_sp / k)),
                               dispatch_max_chunks=k)
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(with_k(mid)):
                    hi = mid
                else:
                    lo = mid + 1
            cfg = with_k(lo)
            if lo == 1 and fits(replace(cfg, dispatch="llep")):
                cfg = replace(cfg, dispatch="llep")  # one chunk: plain LLEP does the same
        if cfg.sco:
            r = self.estimate(seq, cfg)
            B = r.boundary_bytes
            lo, hi = 0, r.boundaries_offloaded  # fewest offloaded boundaries that fit

            def with_n(n: int) -> FlatConfig:
                return replace(cfg, sco_host_budget_gib=_budget_gib(n * B, B))
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(with_n(mid)):
                    hi = mid
                else:
                    lo = mid + 1
            cfg = with_n(lo)
        if cfg.attn_tiles:
            tokens = self.estimate(seq, cfg).tokens
            while 2 * cfg.attn_tiles < tokens and fits(replace(cfg, attn_tiles=2 * cfg.attn_tiles)):
                cfg = replace(cfg, attn_tiles=2 * cfg.attn_tiles)
        return cfg

    # -- attention replay -----------------------------------------------------------------
    def replay(self, seq: int, cfg: FlatConfig) -> Tuple[FlatConfig, Optional[str]]:
        """``cfg`` with attention replay on, when the layout runs full recompute, the node's
        pinned host memory holds it beside the optimizer state, the step still fits the
        device with one O + LSE prefetched, and the step-time model predicts it faster on
        ``self.device``; else ``cfg`` unchanged and why not.

        SCO's pool is filled first come in forward order, each layer's boundary before its
        O + LSE (``peaks.sco_pool``), so replay keeping every layer means SCO offloading
        every boundary too: SCO is turned on (if off) with a host budget of L_s·m·(B + O +
        LSE), replay's bytes on top of every boundary's.
        """
        if not self.replay_allowed:
            return cfg, "not allowed (--without attn_replay)"
        if not self.layout.full_recompute:
            return cfg, "needs full recompute (the re-run it skips)"
        before = self.estimate(seq, cfg)
        if not before.boundaries_held:
            return cfg, "no layers on this stage"
        B = before.boundary_bytes
        pool = before.replay_need + before.boundaries_held * B
        trial = replace(cfg, attn_replay=True, sco=True,
                        sco_host_budget_gib=_replay_budget_gib(pool, B))
        after = self.estimate(seq, trial)
        if self.host_budget is not None and after.host_per_device > self.host_budget:
            return cfg, self._replay_host_why(before, after)
        if after.total > self.budget:
            return cfg, self._replay_device_why(after)
        saved = self._boundaries_s(before, cfg) - self._boundaries_s(after, trial)
        if saved <= 0:
            return cfg, (f"no faster on {self.device}: its copies over PCIe cost more than "
                         "the attention kernels it skips")
        return trial, None

    def _boundaries_s(self, report: PeakReport, cfg: FlatConfig) -> float:
        """Predicted seconds of the attention + SCO unit (the one unit replay changes)."""
        from megatron_flat.plan.costs import unit_costs
        from megatron_flat.plan.time import predict

        counts, overlap = unit_costs(self.model, self.layout, report, cfg)["boundaries"]
        return predict(counts, overlap, self.device).total_s

    def _replay_device_why(self, report: PeakReport) -> str:
        from megatron_flat.plan.units import format_bytes

        return (f"device memory: its prefetched O + LSE ({format_bytes(report.replay_device)}) "
                f"takes the step to {format_bytes(report.total)}, above the "
                f"{format_bytes(self.budget)} usable")

    def _replay_host_why(self, before: PeakReport, after: PeakReport) -> str:
        from megatron_flat.plan.units import format_bytes

        left = max(0, self.host_budget - before.host_per_device)
        return (f"host memory: SCO's pool would hold {format_bytes(after.boundaries_host)} per "
                f"GPU (every boundary, then each layer's O + LSE: "
                f"{format_bytes(before.replay_need)}); {format_bytes(left)} per GPU is left of "
                "the node's pinned host memory after the optimizer state and SCO's boundaries")


def _budget_gib(nbytes: int, boundary: int) -> float:
    """``sco_host_budget_gib`` admitting exactly ``nbytes // boundary`` boundaries.

    Aims a little above ``nbytes`` (half a boundary, at most 1 MiB) so float rounding can
    neither drop nor add one, and the pool the host tier allocates (the whole budget) holds
    less than 1 MiB it does not use; rounded down to whole MiB when a boundary is at least
    2 MiB (readable values).
    """
    if nbytes <= 0 or boundary <= 0:
        return 0.0
    target = nbytes + min(boundary // 2, MIB)
    if boundary >= 2 * MIB:
        return (target // MIB) / 1024
    return target / GIB


def _replay_budget_gib(nbytes: int, boundary: int) -> float:
    """``sco_host_budget_gib`` holding ``nbytes`` (every boundary and every O + LSE), as
    ``_budget_gib`` aims it, rounded up to the 6 significant digits the
    ``--flat-sco-host-budget-gib`` flag is printed with, so the printed budget still holds
    them all."""
    gib = _budget_gib(nbytes, boundary)
    printed = float(format(gib, ".6g"))
    if printed >= gib:
        return printed
    step = 10.0 ** (math.floor(math.log10(gib)) - 5)  # one unit of the 6th digit
    return float(format((math.floor(gib / step) + 1) * step, ".6g"))


def fit(model: ModelSpec, layout: Layout, seq_len: int, device_bytes: int,
        host_bytes: Optional[int] = None, *, margin: float = 0.1, host_margin: float = 0.1,
        skew: float = DEFAULT_SKEW, min_chunk_tokens: int = MIN_CHUNK_TOKENS,
        allow: Sequence[str] = KNOBS, device: str = "H200") -> Fit:
    """Pick the FlatConfig knobs so the step fits ``device_bytes`` with ``margin`` to spare.

    ``host_bytes``: host memory per node (``layout.gpus_per_node`` devices share it), of which
    ``host_margin`` is kept free; None leaves pinned host memory unlimited. ``allow``: the
    techniques fit may turn on (``KNOBS``: the memory techniques and attention replay).
    ``min_chunk_tokens``: the smallest dispatch chunk (c) fit considers. Raises
    ``PlanError`` when no allowed combination fits. Attention replay is turned on last,
    where it fits and the step-time model predicts it faster on ``device`` (module
    docstring, step 4).
    """
    planner = _Planner(model, layout, device_bytes, host_bytes, margin, host_margin, skew,
                       min_chunk_tokens, allow, device)
    baseline = planner.estimate(seq_len, None)
    if planner.ok(baseline):
        return Fit(FlatConfig(), baseline, baseline, planner.budget, planner.host_budget, (),
                   attn_replay_why="the baseline fits: megatron-flat is not needed")
    found = planner.first_fitting(seq_len)
    if found is None:
        raise DoesNotFit(*_no_fit(planner, seq_len, baseline))
    techniques, cfg = found
    relaxed = planner.relax(seq_len, cfg)
    cfg, replay_why = planner.replay(seq_len, relaxed)
    report = planner.estimate(seq_len, cfg)
    return Fit(cfg, report, baseline, planner.budget, planner.host_budget, techniques,
               attn_replay_why=replay_why,
               without_replay=relaxed if replay_why is None else None)


def tightest_report(model: ModelSpec, layout: Layout, seq_len: int,
                    host_bytes: Optional[int] = None, *, host_margin: float = 0.1,
                    skew: float = DEFAULT_SKEW, min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                    allow: Sequence[str] = KNOBS) -> PeakReport:
    """The peaks with every allowed technique at its smallest-memory setting (what is shown
    when nothing fits). The optimizer state stays on device when the host cannot hold it."""
    planner = _Planner(model, layout, 1, host_bytes, 0.0, host_margin, skew, min_chunk_tokens,
                       allow)
    cfg = planner.tightest(seq_len, planner.allow)
    for dropped in (("param_offload",), ("param_offload", "optimizer_offload")):
        if cfg is not None:
            break
        cfg = planner.tightest(seq_len, tuple(t for t in planner.allow if t not in dropped))
    return planner.estimate(seq_len, cfg)


def _no_fit(planner: _Planner, seq: int, baseline: PeakReport) -> Tuple[str, PeakReport]:
    from megatron_flat.plan.units import format_bytes

    best = tightest_report(planner.model, planner.layout, seq,
                           None if planner.host_budget is None else
                           planner.host_budget * min(planner.layout.gpus_per_node,
                                                     planner.layout.gpus),
                           host_margin=0.0, skew=planner.skew, min_chunk_tokens=planner.min_chunk,
                           allow=planner.allow)
    parts = [f"{planner.model.name} at {seq:,} tokens does not fit: even with "
             f"{', '.join(TECHNIQUE_NAMES[t] for t in planner.allow) or 'no technique'} at their "
             f"smallest settings the step needs {format_bytes(best.total)} per device, more than "
             f"the {format_bytes(planner.budget)} usable (baseline "
             f"{format_bytes(baseline.total)}); binding term: {best.binding}"]
    if planner.host_budget is not None and best.host_per_device > planner.host_budget:
        parts.append(f"pinned host need {format_bytes(best.host_per_device)} per device exceeds "
                     f"the {format_bytes(planner.host_budget)} available")
    if not enabled(best.flat, "optimizer_offload"):
        if "optimizer_offload" in planner.allow:
            parts.append("the host cannot hold the optimizer state")
    elif "param_offload" in planner.allow and not enabled(best.flat, "param_offload"):
        parts.append("the host cannot hold the routed experts' weights and gradients beside "
                     "the optimizer state (param offload)")
    parts.append("try more GPUs, a larger CP/EP, or a shorter sequence")
    return "; ".join(parts), best


def seq_granularity(layout: Layout) -> int:
    """Sequence lengths the search visits: multiples of lcm(1024, 2·CP, TP·CP)."""
    g = 1024
    if layout.cp > 1:
        g = math.lcm(g, 2 * layout.cp)
    if layout.sp:
        g = math.lcm(g, layout.tp * layout.cp)
    return g


def bisect_reach(fits: Callable[[int], bool], g: int, limit: int, known: int = 0) -> int:
    """Largest multiple of ``g`` (≤ ``limit``) for which the monotone predicate ``fits``
    holds; 0 when not even ``g`` fits. ``known``: a multiple of ``g`` already known to fit
    (the search starts from it instead of from ``g``)."""
    if known % g:
        raise PlanError(f"known length {known} is not a multiple of the granularity {g}")
    if known:
        lo = known // g
    elif not fits(g):
        return 0
    else:
        lo = 1  # fits(lo·g)
    hi = 2 * lo
    while hi * g <= limit and fits(hi * g):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // g + 1)  # fits(hi·g) is False or hi·g > limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * g):
            lo = mid
        else:
            hi = mid
    return lo * g


def reach_predicates(model: ModelSpec, layout: Layout, device_bytes: int,
                     host_bytes: Optional[int] = None, *, margin: float = 0.1,
                     host_margin: float = 0.1, skew: float = DEFAULT_SKEW,
                     min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                     allow: Sequence[str] = KNOBS) -> Dict[str, Callable[[int], bool]]:
    """``{run: fits(seq)}`` for ``"flat"`` and every baseline the layout allows: whether that
    run's step fits ``seq`` tokens (flat: the baseline fits or ``fit`` would succeed).

    Each predicate is monotone in ``seq`` (every term grows with it), which is what
    ``bisect_reach`` and the layout search's pruning rely on; ``seq`` must be a length the
    layout can split (a multiple of ``seq_granularity(layout)`` always is).
    """
    planner = _Planner(model, layout, device_bytes, host_bytes, margin, host_margin, skew,
                       min_chunk_tokens, allow)

    def fits_as(name: str) -> Callable[[int], bool]:
        return lambda seq: planner.ok(planner.estimate(seq, None, baseline=name))

    out: Dict[str, Callable[[int], bool]] = {}
    base_fits = fits_as("megatron")
    out["flat"] = lambda seq: base_fits(seq) or planner.first_fitting(seq) is not None
    for name in BASELINES:
        if allowed(name, layout) is None:
            out[name] = fits_as(name)
    return out


def max_context(model: ModelSpec, layout: Layout, device_bytes: int,
                host_bytes: Optional[int] = None, *, margin: float = 0.1,
                host_margin: float = 0.1, skew: float = DEFAULT_SKEW,
                min_chunk_tokens: int = MIN_CHUNK_TOKENS, allow: Sequence[str] = KNOBS,
                granularity: Optional[int] = None, limit: int = 1 << 30) -> Reach:
    """Longest sequence that fits, for every baseline the layout allows and flat (``fit``
    succeeds), by bisection.

    Every term grows with the sequence length, so "fits" is monotone and bisection over
    multiples of ``granularity`` (default ``seq_granularity(layout)``) finds the exact
    boundary up to ``limit`` tokens. A baseline fits when its device total and its host
    bytes (times the node's GPUs) fit, as megatron-flat must.
    """
    g = granularity or seq_granularity(layout)
    if g % seq_granularity(layout) and granularity is not None:
        raise PlanError(f"granularity {g} must be a multiple of {seq_granularity(layout)} "
                        f"for this layout")
    preds = reach_predicates(model, layout, device_bytes, host_bytes, margin=margin,
                             host_margin=host_margin, skew=skew,
                             min_chunk_tokens=min_chunk_tokens, allow=allow)
    reach = {name: bisect_reach(fits, g, limit) for name, fits in preds.items()}
    flat = reach.pop("flat")

    def without(technique: str) -> int:
        if technique not in allow or not applies(technique, layout) or not flat:
            return flat
        fits = reach_predicates(model, layout, device_bytes, host_bytes, margin=margin,
                                host_margin=host_margin, skew=skew,
                                min_chunk_tokens=min_chunk_tokens,
                                allow=[t for t in allow if t != technique])["flat"]
        # A technique never shortens the reach: what fits without it fits with it.
        return bisect_reach(fits, g, min(limit, flat))
    return Reach(baseline=reach["megatron"], flat=flat, granularity=g, baselines=reach,
                 flat_without_attn_tiles=without("attn_tiles"),
                 flat_without_param_offload=without("param_offload"))


def reach_techniques(reach: Reach, allow: Sequence[str] = KNOBS) -> Tuple[str, ...]:
    """The techniques flat's reach runs with: ``allow`` less param offload where it adds no
    reach (where the node's host memory binds, the smallest-memory setting with it is not
    what runs at the reach)."""
    if reach.flat_without_param_offload >= reach.flat:
        return tuple(t for t in allow if t != "param_offload")
    return tuple(allow)


@dataclass(frozen=True)
class HostBinds:
    """Where param offload adds no reach because the node's pinned host memory binds: the
    reach with and without it when host memory is not limited, and the host memory per node
    the step at that reach pins (with it)."""

    reach: int                  # with or without param offload at the given host memory
    unlimited_with: int
    unlimited_without: int
    host_per_node_needed: int   # pinned host per node at ``unlimited_with``
    host_bytes: int             # the node's host memory given

    def as_dict(self) -> dict:
        return {"reach": self.reach, "unlimited_host_with": self.unlimited_with,
                "unlimited_host_without": self.unlimited_without,
                "host_per_node_needed": self.host_per_node_needed,
                "host_bytes": self.host_bytes}


def param_offload_host_binds(model: ModelSpec, layout: Layout, device_bytes: int,
                             host_bytes: Optional[int], reach: Reach, *, margin: float = 0.1,
                             host_margin: float = 0.1, skew: float = DEFAULT_SKEW,
                             min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                             allow: Sequence[str] = KNOBS,
                             limit: int = 1 << 30) -> Optional[HostBinds]:
    """``HostBinds`` where param offload is allowed on ``layout`` and adds no reach while it
    would with host memory unlimited (the node's pinned memory binds); else None."""
    if host_bytes is None or "param_offload" not in allow or \
            not applies("param_offload", layout) or not reach.flat or \
            reach.flat > reach.flat_without_param_offload:
        return None
    g = reach.granularity
    kw = dict(margin=margin, host_margin=host_margin, skew=skew,
              min_chunk_tokens=min_chunk_tokens)

    def unlimited(techniques: Sequence[str]) -> int:
        fits = reach_predicates(model, layout, device_bytes, None, allow=techniques,
                                **kw)["flat"]
        return bisect_reach(fits, g, limit, known=reach.flat)
    with_ = unlimited(allow)
    if with_ <= reach.flat:
        return None  # the device binds, not the host
    without = unlimited([t for t in allow if t != "param_offload"])
    report = fit(model, layout, with_, device_bytes, None, allow=allow, **kw).report
    return HostBinds(reach=reach.flat, unlimited_with=with_, unlimited_without=without,
                     host_per_node_needed=report.host_per_node, host_bytes=host_bytes)
