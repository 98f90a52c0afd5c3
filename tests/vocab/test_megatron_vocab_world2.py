"""Ring-DTP as GPTModel's output layer + loss at TP=2 (gloo), against Megatron itself.

* The output module against Megatron's projection + ``vocab_parallel_cross_entropy`` at
  TP=2: loss, hidden-state gradient, weight-shard gradient, every mode; with and without
  sequence parallelism, loss mask, bf16, huge logits (``_megatron_vocab.py``).
* A full tiny MoE GPT step through the equivalence harness with Ring-DTP on against the
  stock single-rank model: loss, every gradient, the parameters after two AdamW steps —
  untied and tied embeddings, at TP=2 with sequence parallelism (the ring) and at DP=2
  (TP=1: the blocked version).
"""


import pytest
import torch

pytestmark = pytest.mark.world(2)

from tests.vocab import _megatron_vocab as helpers

MODES = ("weights", "activations", "auto")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(helpers.CASES))
def test_output_loss_matches_megatron_tp2(megatron_cpu, case, mode):
    from megatron_flat.testing.distributed import megatron_layout

    # Whole strips and 512-byte token tiles in one layout: each layout's gloo groups keep
    # their threads for the life of the process.
    with megatron_layout(tp=2):
        for tile_bytes in (None, 512):
            helpers.check_against_megatron(case, mode, tp=2, tile_bytes=tile_bytes)


# ---------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def references(megatron_cpu):
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tinies = {tied: TinyMoE(share_embeddings=tied) for tied in (False, True)}
    return {tied: (tiny, run_reference(tiny)) for tied, tiny in tinies.items()}


STEPS = {
    # name: (layout, mode, block size, tile bytes); 16 tokens x 2 per micro-batch: TP=2 gives
    # each rank 16 tokens against 64 vocab rows (auto -> activations). Tiles of 1 KiB: 4
    # tokens of a 64-row strip (5 of a 48-row one), so the default tiled path really tiles;
    # "whole-strips" is --flat-vocab-tile-bytes 0.
    "tp2-sp-weights": (dict(tp=2), "weights", None, 1024),
    "tp2-sp-activations": (dict(tp=2), "activations", None, 1024),
    "tp2-sp-whole-strips": (dict(tp=2), "activations", None, 0),
    "dp2-blocked": (dict(), "auto", 48, 1024),  # 128 rows in strips of 48, 48, 32
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(STEPS))
def test_gpt_step_matches_stock_model(references, name, tied):
    from megatron_flat.testing.equivalence import assert_equivalent

    tiny, reference = references[tied]
    layout, mode, block, tile = STEPS[name]
    result, seen = helpers.gpt_step(tiny, reference, layout, mode, block, tile)
    assert_equivalent(result, reference)
    assert result.grads is not None
    assert result.losses[1] != result.losses[0]
    (ring, calls, last_stage, weight), = seen  # one model chunk per rank, a last stage
    assert last_stage
    # The shard's gradient went straight into DDP's main_grad (Megatron's fused way).
    assert weight.grad_added_to_main_grad is True
    assert ring is not None and ring.tp == layout.get("tp", 1) and ring.mode == mode
    assert ring.tile_bytes == (tile or None)
    # Every micro-batch went through Ring-DTP; the stock output layer never ran.
    micro = tiny.global_batch_size // tiny.micro_batch_size // (2 // ring.tp)
    assert calls == {"stock": 0, "ring": 2 * micro}
    if tied:
        assert "output_layer.weight" not in result.grads  # the embedding got the grad


def test_without_labels_the_model_returns_megatron_logits(megatron_cpu):
    """Inference/evaluation (no labels) keeps Megatron's logits path, bitwise."""
    from megatron_flat.megatron.vocab import enable_ring_dtp, ring_dtp_output
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import (
        TinyMoE,
        build_tiny_gpt,
        global_batch,
        transformer_config,
    )

    tiny = TinyMoE()
    with megatron_layout(tp=2, seed=tiny.seed):
        model = build_tiny_gpt(tiny, transformer_config(tiny, tp=2))
        mb = global_batch(tiny)[0]
        with torch.no_grad():
            stock = model(mb.tokens, mb.position_ids, None)
            enable_ring_dtp(model)
            assert ring_dtp_output(model) is not None
            flat = model(mb.tokens, mb.position_ids, None)
    assert stock.shape == (tiny.micro_batch_size, tiny.seq_length, tiny.vocab_size // 2)
    assert torch.equal(stock, flat)


# ---------------------------------------------------------------------------- MTP heads
@pytest.fixture(scope="module")
def mtp_references(megatron_cpu):
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tinies = {tied: TinyMoE(share_embeddings=tied, mtp_num_layers=2 if tied else 1)
              for tied in (False, True)}
    return {tied: (tiny, run_reference(tiny)) for tied, tiny in tinies.items()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied-1-head", "tied-2-heads"])
@pytest.mark.parametrize("name", ["tp2-sp-activations", "tp2-sp-weights", "dp2-blocked"])
def test_gpt_step_with_mtp_heads_matches_stock_model(mtp_references, name, tied):
    """Multi-token prediction: the main head and every MTP head through Ring-DTP, against
    the stock single-rank model with Megatron's own MTP loss (loss, every gradient, the
    parameters after two steps)."""
    from megatron_flat.megatron.vocab import RingDTPHeads
    from megatron_flat.testing.equivalence import assert_equivalent

    tiny, reference = mtp_references[tied]
    layout, mode, block, tile = STEPS[name]
    heads = []
    original = RingDTPHeads.loss
    RingDTPHeads.loss = lambda self, labels, hidden: (
        heads.append(labels is not self._labels) or original(self, labels, hidden))
    try:
        result, seen = helpers.gpt_step(tiny, reference, layout, mode, block, tile)
    finally:
        RingDTPHeads.loss = original
    assert_equivalent(result, reference)
    assert any(key.startswith("mtp.") for key in result.grads)
    (ring, calls, last_stage, weight), = seen
    micro = tiny.global_batch_size // tiny.micro_batch_size // (2 // ring.tp)
    # Every MTP head of every micro-batch (forward steps: 2 steps) went through Ring-DTP.
    assert sum(heads) == 2 * micro * tiny.mtp_num_layers
    assert calls["stock"] == 0
    assert weight.grad_added_to_main_grad is True
