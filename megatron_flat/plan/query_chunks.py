"""Would query-chunked core attention pay? The planner's answer, at flat's reach.

Query chunks split the core attention by query rows. Under full recompute what they could
take out of the layer's working set (``peaks.other_term``) is small, because every other
tensor the layer keeps must stay whole:

- **Kept whole anyway.** Q, K, V (the QKV projection's output, which V's view holds), the
  attention output O (the output projection saves it as its input) and the log-sum-exp
  (what the backward needs instead of the scores). K and V serve every query chunk.
- **What chunks remove.** RoPE's rotated copy of Q, 2·N·h·d/TP bytes at 16 bits: each
  chunk's backward rotates its rows again from the kept Q (elementwise, cheap) and runs
  the backend's backward on (dO_i, Q_i, K, V, O_i, LSE_i). Rotated K cannot go: every
  chunk needs all of it, so re-rotating it puts it back at the same peak.
- **What chunks add.** dK and dV summed over the chunks. Stock's single kernel sums them
  over its query blocks in fp32 and rounds once; to stay within fp32 reordering of stock
  the chunks must sum into fp32 buffers too: 4·N·g·(d + d_v)/TP bytes for the backward.

So the net saving is ``(2·h·d − 4·g·(d + d_v))·N/TP`` bytes (16-bit activations; nothing in
fp32), and where it is positive the reach grows by that saving over the step's remaining
bytes per token: ``gain = s / (slope − s)``, with ``slope`` flat's step bytes per token at
its reach (measured on the planner between R/2 and R, where every term is affine in N);
none where the vocabulary transient, not the layer, binds the step.
``QUERY_CHUNK_MIN_GAIN`` is the bar: a technique gets a launch flag when it moves the reach
by at least that much; below it, the chunks' launches and RoPE re-runs are not worth one.
At the paper's three presets the gain is about 3% (``docs/planner.md``): not built.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron_flat.plan.model import Layout, ModelSpec

QUERY_CHUNK_MIN_GAIN = 0.05


@dataclass(frozen=True)
class QueryChunkAssessment:
    """The planner's answer at one layout: ``saving_per_token`` (device bytes per sequence
    token, net, may be ≤ 0), ``slope`` (flat's step bytes per token at its reach),
    ``reach_gain`` (fraction; 0 when nothing is saved), ``pays`` (gain ≥ the bar)."""

    reach: int
    saving_per_token: float
    slope: float
    reach_gain: float
    pays: bool
    min_gain: float = QUERY_CHUNK_MIN_GAIN

    def as_dict(self) -> dict:
        return asdict(self)


def net_saving_per_token(model: ModelSpec, layout: Layout) -> float:
    """Device bytes per sequence token that query chunks take out of the layer's working
    set under full recompute (module docstring): rotated Q at the model's width, less fp32
    dK and dV accumulators, per TP rank and CP share. Zero for fp32 activations (the
    accumulators are as wide as what they replace would need)."""
    if model.bytes_per_value >= 4:
        return 0.0
    TP = layout.tp
    g_local = max(model.kv_heads // TP, 1) * TP
    rotated_q = model.bytes_per_value * model.heads * model.head_dim
    accumulators = 4 * g_local * (model.head_dim + model.dv)
    per_rank = (rotated_q - accumulators) / TP
    return per_rank * layout.micro_batch_size / layout.cp


def assess(model: ModelSpec, layout: Layout, reach: int, host_bytes: Optional[int] = None,
           **kw) -> Optional[QueryChunkAssessment]:
    """The assessment at flat's reach ``reach`` on ``layout`` (None when nothing fits).
    ``kw``: ``tightest_report``'s options (host margin, skew, allowed techniques)."""
    from megatron_flat.plan.fit import seq_granularity, tightest_report

    g = seq_granularity(layout)
    half = (reach // 2) // g * g
    if reach <= 0 or half <= 0 or half == reach:
        return None
    top = tightest_report(model, layout, reach, host_bytes, **kw)
    low = tightest_report(model, layout, half, host_bytes, **kw)
    slope = (top.total - low.total) / (reach - half)
    saving = net_saving_per_token(model, layout)
    if top.vocab >= top.dispatch + top.other:
        saving = 0.0  # the vocabulary transient binds the step: the layer's set is not in it
    gain = saving / (slope - saving) if saving > 0 and slope > saving else 0.0
    return QueryChunkAssessment(reach=reach, saving_per_token=saving, slope=slope,
                                reach_gain=gain, pays=gain >= QUERY_CHUNK_MIN_GAIN)
