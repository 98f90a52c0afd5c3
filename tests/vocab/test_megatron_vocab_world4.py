"""Ring-DTP as GPTModel's output layer + loss at TP=4 and TP=2 x PP=2 (gloo).

* The output module against Megatron's projection + ``vocab_parallel_cross_entropy`` at
  TP=4 (``_megatron_vocab.py``): loss, hidden-state gradient, weight-shard gradient, every
  mode.
* Full tiny MoE GPT steps (tied embeddings) through the equivalence harness against the
  stock single-rank model: TP=4 with sequence parallelism (4 tokens x 2 per rank, a ring
  of 4), and TP=2 x PP=2 — the last stage's output copy of the word embedding gets the
  Ring-DTP gradient and Megatron's embedding-group all-reduce sums it with the first
  stage's, so both copies step alike (the harness requires replicas to agree bitwise).
"""


import pytest

pytestmark = pytest.mark.world(4)

from tests.vocab import _megatron_vocab as helpers

MODES = ("weights", "activations", "auto")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(helpers.CASES))
def test_output_loss_matches_megatron_tp4(megatron_cpu, case, mode):
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout(tp=4):
        helpers.check_against_megatron(case, mode, tp=4)


# ---------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def tied(megatron_cpu):
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    tiny = TinyMoE(share_embeddings=True)
    return tiny, run_reference(tiny)


STEPS = {
    # name: (layout, mode); tied embeddings (world 2 runs untied and tied in both modes).
    "tp4-sp-weights": (dict(tp=4), "weights"),
    "tp2-pp2-auto": (dict(tp=2, pp=2), "auto"),  # 16 tokens per rank, 64 rows: activations
}


@pytest.mark.parametrize("name", list(STEPS))
def test_gpt_step_matches_stock_model(tied, name):
    from megatron_flat.testing.equivalence import assert_equivalent

    layout, mode = STEPS[name]
    tiny, reference = tied
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
