"""The techniques under context parallelism (shared helpers of ``test_cp_worlds.py``).

For one layout with CP > 1 (always with full recompute, which SCO needs, and the same in
every run):

1. stock Megatron with CP equals the single-rank model (the harness's tolerances);
2. each technique alone equals stock with the same CP: PipelinedLLEP and Ring-DTP reorder
   fp32 reductions (the harness's tolerances), SCO and OffloadStreamAdamW only move data
   (bitwise: losses, every step-0 gradient, every parameter after the steps, every rank's
   AdamW state);
3. all four on equal stock (``_composed.assert_composed_equal``).

Each check also asserts the technique really ran under CP (flat MoE layers with several
chunks, the Ring-DTP module, boundaries offloaded, OffloadStreamAdamW as the inner optimizer).
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig

from tests.composed import _composed as composed

STEPS = composed.STEPS

# Each technique alone, knobs as in the all-four run; ``exact``: only data moves (bitwise).
TECHNIQUES: Dict[str, dict] = {
    "pipelined-llep": dict(flat=FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=8,
                                           llep_imbalance_threshold=0.0), exact=False),
    "ring-dtp": dict(flat=FlatConfig(vocab=True, vocab_mode="auto", vocab_block_size=48),
                     exact=False),
    "sco": dict(flat=FlatConfig(sco=True, sco_host_budget_gib=0.01, sco_prefetch=1), exact=True),
    "offload-adamw": dict(flat=FlatConfig(optimizer_offload=True, optimizer_bucket_numel=10_000,
                                          optimizer_num_slots=2), exact=True),
}


def _gather_problems(problems: List[str]) -> List[str]:
    everyone: List[List[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, problems)
    return sorted({p for rank in everyone for p in rank})


def bitwise_mismatches(got, want) -> List[str]:
    """Where two runs of the same layout differ at all (losses, grads, params, AdamW state)."""
    out = []
    if got.losses != want.losses:
        out.append(f"losses {got.losses} != {want.losses}")
    pairs = [("param", got.params, want.params),
             ("state", got.optimizer_state, want.optimizer_state)]
    if want.grads is not None:
        pairs.append(("grad", got.grads, want.grads))
    for what, a, b in pairs:
        if set(a) != set(b):
            out.append(f"{what} keys differ: {sorted(set(a) ^ set(b))[:6]}")
            continue
        for key in sorted(b):
            if not torch.equal(a[key], b[key]):
                err = (a[key] - b[key]).abs().max().item()
                out.append(f"rank {dist.get_rank()} {what} {key}: max abs error {err:.3g}")
    return out


def _check_used(name: str, used: dict, layout) -> None:
    assert used["cp_size"] == layout.cp, used
    if name == "pipelined-llep":
        assert used["flat_moe_layers"] > 0 and used["chunks"] > 1, used
    elif name == "ring-dtp":
        assert used["ring_dtp"] == used["post_process"], used
    elif name == "sco":
        assert used["boundaries_offloaded"] > 0, used
    elif name == "offload-adamw":
        assert used["offload_inners"], used


class CPCase:
    """One CP layout's runs, made once and shared by its tests: the single-rank reference
    (``STEPS`` steps, also the initial weights of every run) and stock Megatron under the
    layout. Every run of a layout builds fresh process groups whose gloo threads live as long
    as the process, so each is made once per file."""

    def __init__(self, tiny, layout):
        self.tiny, self.layout = tiny, layout
        self._reference = self._stock = None

    @property
    def reference(self):
        from megatron_flat.testing.equivalence import run_reference

        if self._reference is None:
            self._reference = run_reference(self.tiny, steps=STEPS)
        return self._reference

    @property
    def stock(self):
        from megatron_flat.testing.equivalence import run_layout

        if self._stock is None:
            self._stock = run_layout(self.tiny, self.layout, self.reference, steps=STEPS)
        return self._stock

    def assert_stock_matches_single_rank(self):
        from megatron_flat.testing.equivalence import mismatches

        assert self.stock.losses[1] != self.stock.losses[0]  # the optimizer really stepped
        found = _gather_problems(mismatches(self.stock, self.reference))
        assert not found, f"{self.layout.name} differs from one rank:\n  " + "\n  ".join(found)

    def assert_technique_matches_stock(self, name: str):
        from megatron_flat.testing.equivalence import ATOL, mismatches, run_layout

        technique = TECHNIQUES[name]
        used = {}
        flat = run_layout(self.tiny, self.layout, self.reference, steps=STEPS,
                          flat=technique["flat"],
                          inspect=lambda trainer: used.update(composed.what_ran(trainer)))
        _check_used(name, used, self.layout)
        if technique["exact"]:
            problems = bitwise_mismatches(flat, self.stock)
        else:
            problems = mismatches(flat, self.stock)
            problems += composed.state_mismatches(flat.optimizer_state,
                                                  self.stock.optimizer_state, ATOL)
        found = _gather_problems(problems)
        assert not found, (f"{name} under {self.layout.name} differs from stock:\n  "
                           + "\n  ".join(found))

    def assert_all_four_match_stock(self):
        composed.assert_composed_equal(self.tiny, self.layout, self.reference, self.stock)
