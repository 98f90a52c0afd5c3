"""Ring-DTP as GPTModel's output layer + loss (gloo), against Megatron itself.

* The output module against Megatron's projection + ``vocab_parallel_cross_entropy`` at
  TP=2 and TP=4 (``_megatron_vocab.py``): loss, hidden-state gradient, weight-shard gradient,
  every mode; with and without sequence parallelism, loss mask, bf16, huge logits; at TP=2
  also in 512-byte token tiles.
* Full tiny MoE GPT steps through the equivalence harness with Ring-DTP on against the stock
  single-rank model: loss, every gradient, the parameters after two AdamW steps.
  - 2 ranks: untied and tied embeddings, at TP=2 with sequence parallelism (the ring) and at
    DP=2 (TP=1: the blocked version); with MTP heads; without labels (Megatron's logits).
  - 4 ranks, tied embeddings: TP=4 with sequence parallelism (4 tokens x 2 per rank, a ring
    of 4), and TP=2 x PP=2 — the last stage's output copy of the word embedding gets the
    Ring-DTP gradient and Megatron's embedding-group all-reduce sums it with the first
    stage's, so both copies step alike (the harness requires replicas to agree bitwise).
"""


import pytest
import torch

from tests._worlds import WORLDS
from tests.vocab import _megatron_vocab as helpers

world2 = pytest.mark.world(2)
world4 = pytest.mark.world(4)

MODES = ("weights", "activations", "auto")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(helpers.CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_output_loss_matches_megatron(megatron_cpu, world, case, mode):
    from megatron_flat.testing.distributed import megatron_layout

    # At TP=2 whole strips and 512-byte token tiles in one layout: each layout's gloo groups
    # keep their threads for the life of the process.
    with megatron_layout(tp=world):
        for tile_bytes in ((None, 512) if world == 2 else (None,)):
            helpers.check_against_megatron(case, mode, tp=world, tile_bytes=tile_bytes)


# ---------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def references(megatron_cpu):
    """The stock single-rank run per tied/untied embeddings, computed when first asked for."""
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    done = {}

    def reference(tied):
        if tied not in done:
            tiny = TinyMoE(share_embeddings=tied)
            done[tied] = (tiny, run_reference(tiny))
        return done[tied]

    return reference


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


@world2
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(STEPS))
def test_gpt_step_matches_stock_model(references, name, tied):
    from megatron_flat.testing.equivalence import assert_equivalent

    tiny, reference = references(tied)
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


@world2
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


STEPS_TP4 = {
    # name: (layout, mode); tied embeddings (world 2 runs untied and tied in both modes).
    "tp4-sp-weights": (dict(tp=4), "weights"),
    "tp2-pp2-auto": (dict(tp=2, pp=2), "auto"),  # 16 tokens per rank, 64 rows: activations
}


@world4
@pytest.mark.parametrize("name", list(STEPS_TP4))
def test_gpt_step_at_4_ranks_matches_stock_model(references, name):
    from megatron_flat.testing.equivalence import assert_equivalent

    layout, mode = STEPS_TP4[name]
    tiny, reference = references(True)
    result, seen = helpers.gpt_step(tiny, reference, layout, mode)
    assert_equivalent(result, reference)
    assert result.grads is not None
    assert result.losses[1] != result.losses[0]
    (ring, calls, last_stage, weight), = seen
    assert (ring is not None) == last_stage
    assert last_stage or layout.get("pp", 1) > 1
    if last_stage:
        dp = 4 // (layout["tp"] * layout.get("pp", 1))
        micro = tiny.global_batch_size // tiny.micro_batch_size // dp
        assert ring.tp == layout["tp"] and ring.mode == mode
        assert calls == {"stock": 0, "ring": 2 * micro}
        assert weight.grad_added_to_main_grad is True  # straight into DDP's main_grad


# ---------------------------------------------------------------------------- MTP heads
@pytest.fixture(scope="module")
def mtp_references(megatron_cpu):
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tinies = {tied: TinyMoE(share_embeddings=tied, mtp_num_layers=2 if tied else 1)
              for tied in (False, True)}
    return {tied: (tiny, run_reference(tiny)) for tied, tiny in tinies.items()}


@world2
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
