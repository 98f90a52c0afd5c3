"""The planner's baseline terms against the memory meter on the tiny Megatron MoE GPT (CPU).

Each shape trains one step with ``Trainer`` + ``measure_peaks`` (full recompute, world of one)
and compares the planner's figures, in the meter's definitions (``PeakReport.sections``), within
10%. What each measured component includes (``megatron_flat.megatron.peaks``), as bytes above
the live set when the section opens, the worst entry:

- ``expert dispatch``: one MoE layer's forward (router, permutation, all-to-all, sort by local
  expert, the expert MLPs, unsort, unpermute) and backward (output grad to input grad), the
  recomputed forward included. Planner: ``dispatch`` (the forward peak binds: it holds what is
  saved for backward plus the routed copies).
- ``vocabulary projection + loss``: output layer + cross-entropy, forward (to the model's
  return) and backward (loss grad to the output layer's input grad). The fp32 softmax saved by
  the forward is already live when the backward section opens, so the meter's figure is
  max(forward, backward-above-saved); the planner's ``sections`` gives exactly that, while its
  ``vocab`` (used in the step composition) adds the saved softmax to the backward.
- ``checkpoint boundaries``: live bytes at the decoder's exit minus its entry for one
  microbatch: the saved layer inputs except the first (it predates the entry), the last layer's
  output and the final RMSNorm's saved normalised input and output.

Excluded: the optimizer step (not part of this comparison), allocator rounding, caching and
fragmentation (the CPU meter counts storage bytes exactly; on CUDA these belong in the fit
margin), scratch memory inside single kernels, all-to-all buffers of EP > 1 (in a world of one
the all-to-all is an identity) and fused GPU kernels (the CPU runs Megatron's unfused path, so
the planner is called with ``fused_kernels=False``).
"""

import pytest
import torch

from megatron_flat.plan import Layout, estimate
from megatron_flat.plan.peaks import METER_BOUNDARIES, METER_DISPATCH, METER_VOCAB

TOLERANCE = 0.10

# (name, TinyMoE overrides): vary tokens, hidden, experts, top-k, FFN, vocab, micro-batch.
SHAPES = [
    ("seq128-v1024", dict(seq_length=128, vocab_size=1024)),
    ("seq256-h128-e8-v2048", dict(seq_length=256, hidden_size=128, num_experts=8,
                                  vocab_size=2048)),
    ("seq256x2-e8-k4-f32-v512", dict(seq_length=256, micro_batch_size=2, global_batch_size=2,
                                     num_experts=8, topk=4, moe_ffn_hidden_size=32,
                                     vocab_size=512)),
]


def tiny_layout(tiny) -> Layout:
    # World of one, Megatron's unfused reference path, Megatron's plain (fp32) optimizer.
    return Layout(micro_batch_size=tiny.micro_batch_size, fused_kernels=False,
                  distributed_optimizer=False)


def _tiny(overrides):
    from megatron_flat.testing.tiny_gpt import TinyMoE

    base = dict(micro_batch_size=1, global_batch_size=1)
    return TinyMoE(**{**base, **overrides})


def _measure(tiny):
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer, measure_peaks

    with megatron_layout(seed=tiny.seed):
        return measure_peaks(Trainer(tiny, TrainLayout(recompute="full")), steps=1)


def _rows(name, planned, measured, components):
    return [(name, c, planned[c], measured[c], planned[c] / measured[c]) for c in components]


def format_table(rows) -> str:
    out = [f"{'shape':26s} {'component':30s} {'planned':>10s} {'measured':>10s} {'ratio':>6s}"]
    out += [f"{s:26s} {c:30s} {p:>10,d} {m:>10,d} {r:6.3f}" for s, c, p, m, r in rows]
    return "\n".join(out)


@pytest.fixture(scope="module")
def measured(megatron_cpu):
    return {name: (_tiny(over), _measure(_tiny(over))) for name, over in SHAPES}


def test_baseline_terms_match_the_meter(measured):
    rows = []
    for name, (tiny, peaks) in measured.items():
        report = estimate(tiny.planner_spec(), tiny_layout(tiny), tiny.seq_length)
        rows += _rows(name, report.sections, peaks,
                      (METER_DISPATCH, METER_VOCAB, METER_BOUNDARIES))
    print("\n" + format_table(rows))
    bad = [r for r in rows if abs(r[4] - 1) > TOLERANCE]
    assert not bad, "planner off by more than 10%:\n" + format_table(bad)


def test_composed_vocab_adds_the_saved_softmax(measured):
    # The section figure is what the meter sees; the composition's figure is never smaller.
    for name, (tiny, peaks) in measured.items():
        report = estimate(tiny.planner_spec(), tiny_layout(tiny), tiny.seq_length)
        assert report.vocab >= report.sections[METER_VOCAB]
        n = tiny.seq_length * tiny.micro_batch_size
        assert report.vocab - report.sections[METER_VOCAB] <= 4 * n * tiny.vocab_size


def test_bf16_dispatch_and_vocab_match_the_meter(megatron_cpu):
    """bf16 weights and activations (what real runs use): logits in bf16 plus their fp32 copy.

    Megatron's fp32 optimizer refuses bf16 parameters in this Trainer, so this runs the
    forward and backward (``Trainer.forward_backward``) under the same meter sections as
    ``measure_peaks`` without the optimizer step. Boundaries are not compared in bf16: the CPU
    RMSNorm keeps fp32 intermediates that the planner's fixed final-norm term does not model.
    """
    from megatron_flat.megatron.peaks import attach_peak_sections
    from megatron_flat.runtime.memory import MemoryMeter
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout as TrainLayout
    from megatron_flat.testing.training import Trainer

    rows = []
    for name, over in SHAPES[:2]:
        tiny = _tiny(over)
        with megatron_layout(seed=tiny.seed):
            trainer = Trainer(tiny, TrainLayout(recompute="full"), config_overrides=dict(
                bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16))
            trainer.warm_up()
            with MemoryMeter("cpu") as meter:
                sections = attach_peak_sections(trainer.model, meter)
                try:
                    trainer.forward_backward(0)
                finally:
                    sections.remove()
        peaks = {k: s.peak_device_bytes for k, s in meter.sections.items()}
        report = estimate(tiny.planner_spec("bf16"), tiny_layout(tiny), tiny.seq_length)
        rows += _rows(name + "-bf16", report.sections, peaks, (METER_DISPATCH, METER_VOCAB))
    print("\n" + format_table(rows))
    bad = [r for r in rows if abs(r[4] - 1) > TOLERANCE]
    assert not bad, "planner off by more than 10%:\n" + format_table(bad)
