"""All four techniques on vs off in one Megatron training run (shared by the world-2 and
world-4 files).

Both runs start from the same weights (the single-rank reference's initial weights, loaded
shard by shard) under the same layout and train the same steps; the flat run turns on
PipelinedLLEP (LLEP forced on every step, chunk-capped), Ring-DTP, SCO and
OffloadStreamAdamW through ``Trainer(flat=...)``. Compared: per-step loss, step-0
gradients (gathered to full tensors; not with the distributed optimizer, whose ranks hold
only their reduced shard), parameters after the last step, and every rank's AdamW state.

Tolerances are the ones each technique established: PipelinedLLEP and Ring-DTP reorder
fp32 reductions (experts' gradient sums, the vocabulary's log-sum-exp), so losses and
gradients agree to ``RTOL``/``ATOL`` and parameters after AdamW to ``PARAM_ATOL``; SCO and
OffloadStreamAdamW move data only, so they add no error of their own. The first moment is
a sum of gradients (same tolerance as gradients); the second a sum of squared gradients,
compared relative to its own size.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig

# Every technique on, knobs sized to the tiny model so each does real work: chunks of 8
# routed tokens (several chunks per step), LLEP on every step (threshold 0), Ring-DTP with
# a vocab block smaller than the vocabulary (several strips at P = 1), SCO with room for
# every boundary, optimizer buckets that split parameters.
FLAT = FlatConfig(
    dispatch="pipelined", dispatch_chunk_tokens=8, llep_imbalance_threshold=0.0,
    vocab=True, vocab_mode="auto", vocab_block_size=48,
    sco=True, sco_host_budget_gib=0.01, sco_prefetch=1,
    optimizer_offload=True, optimizer_bucket_numel=10_000, optimizer_num_slots=2,
)
STEPS = 2  # the harness's parameter tolerance is set for two AdamW steps
# First moments: fp32 reordering, as the gradients (measured within 3% of rtol 1e-5 /
# atol 1e-6). Second moments hold the last step's squared gradients, taken at parameters
# that already differ by Adam's amplified rounding (PARAM_ATOL): measured up to 1.4e-5
# of a tensor's largest value, so 1e-4 of it.
MOMENT_RTOL = 1e-5
SQ_MOMENT_RTOL = 1e-4


def state_mismatches(flat_state, stock_state, atol: float) -> List[str]:
    """Differences between two runs' AdamW states on this rank (empty = equal)."""
    out = []
    if set(flat_state) != set(stock_state):
        return [f"optimizer state keys differ: {sorted(set(flat_state) ^ set(stock_state))[:6]}"]
    for key in sorted(stock_state):
        got, want = flat_state[key], stock_state[key]
        if key.endswith(".step"):
            ok = torch.equal(got, want)
        elif key.endswith(".exp_avg_sq"):
            ok = torch.allclose(got, want, rtol=SQ_MOMENT_RTOL,
                                atol=SQ_MOMENT_RTOL * want.abs().max())
        else:
            ok = torch.allclose(got, want, rtol=MOMENT_RTOL, atol=atol)
        if not ok:
            err = (got - want).abs().max().item()
            out.append(f"rank {dist.get_rank()} {key}: max abs error {err:.3g}")
    return out


def what_ran(trainer) -> dict:
    """What a trainer's run really exercised on this rank: flat MoE layers, the most chunks a
    dispatch used, graph-only recomputes, the Ring-DTP module, boundaries SCO offloaded,
    whether every inner optimizer is OffloadStreamAdamW, and the CP size."""
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.optimizer import MegatronOffloadStreamAdamW, inner_optimizers
    from megatron_flat.megatron.vocab import ring_dtp_output

    model = trainer.model
    layers = [m for m in model.modules() if isinstance(m, FlatMoELayer)]
    return {
        "flat_moe_layers": len(layers),
        "chunks": max((m.flat_dispatch.last.num_chunks for m in layers), default=0),
        "graph_only_calls": sum(m.flat_dispatch.verdict.graph_only_calls for m in layers),
        "ring_dtp": ring_dtp_output(model) is not None,
        "post_process": bool(model.post_process),
        "boundaries_offloaded": 0 if trainer.sco is None
        else trainer.sco.stats.boundaries_offloaded,
        "offload_inners": all(isinstance(o, MegatronOffloadStreamAdamW)
                              for o in inner_optimizers(trainer.optimizer)),
        "cp_size": trainer.cp_size,
    }


def run_composed(tiny, layout, reference=None, stock=None):
    """Run the layout with every technique off, then on; returns (stock, flat, used), where
    ``used`` says what the flat run really exercised on this rank. ``reference`` (for its
    initial weights) and ``stock`` (a run of ``layout`` from them, ``STEPS`` steps) are made
    here unless given."""
    from megatron_flat.testing.equivalence import run_layout, run_reference

    if reference is None:
        reference = run_reference(tiny, steps=1)  # for its initial weights only
    if stock is None:
        stock = run_layout(tiny, layout, reference, steps=STEPS)
    used = {}

    flat = run_layout(tiny, layout, reference, steps=STEPS, flat=FLAT,
                      inspect=lambda trainer: used.update(what_ran(trainer)))
    return stock, flat, used


def assert_composed_equal(tiny, layout, reference=None, stock=None) -> None:
    from megatron_flat.testing.equivalence import ATOL, mismatches

    stock, flat, used = run_composed(tiny, layout, reference, stock)
    # The MTP heads' layers (on the last stage) are MoE layers too.
    mtp_layers = tiny.mtp_num_layers if used["post_process"] else 0
    assert used["flat_moe_layers"] == tiny.num_layers // layout.pp + mtp_layers, used
    assert used["chunks"] > 1, used
    if layout.recompute == "full" or "moe" in layout.recompute_modules:
        # the re-runs of steps after the first skip the dispatch
        assert used["graph_only_calls"] > 0, used
    assert used["ring_dtp"] == used["post_process"], used
    assert used["boundaries_offloaded"] > 0, used
    assert used["offload_inners"], used
    problems = mismatches(flat, stock)
    problems += state_mismatches(flat.optimizer_state, stock.optimizer_state, ATOL)
    if not layout.distributed_optimizer:
        assert stock.grads is not None and flat.grads is not None
    everyone: List[List[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank in everyone for p in rank})
    assert not found, "all four on differs from all four off:\n  " + "\n  ".join(found)
