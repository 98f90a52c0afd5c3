"""The planner's attention-block term against the memory meter, world of one (TP 1, no
sequence parallelism): the ``attention block`` section (``_attention_block.py``) within 5%
(the baseline terms' target) on shapes that vary tokens, hidden and head width, and no
sequence-parallel gather buffer, planned or measured."""


import pytest

from tests.plan import _attention_block as block

TOLERANCE = 0.05
SHAPES = {
    "s256-h128-a4": dict(seq_length=256, hidden_size=128, num_attention_heads=4),
    "s512-h64-a8": dict(seq_length=512, hidden_size=64, num_attention_heads=8),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_attention_block_matches_the_meter(megatron_cpu, name):
    table = block.rows(name, block.tiny_model(**SHAPES[name]), tp=1, flat=None)
    print("\n" + block.format_table(table))
    (_, _, section, got), (_, _, buffer, held) = table
    assert got > 0 and abs(block.error(section, got)) <= TOLERANCE, block.format_table(table)
    assert buffer == held == 0  # nothing gathers over a TP group of one


def test_the_term_grows_with_tokens_and_the_attention_width():
    # The planner's side alone: linear in N, and the section is the forward's end state at
    # these shapes (kept tensors + output projection + LSE + unfused RoPE's cos and sin).
    small, double = (block.planned(block.tiny_model(seq_length=s), 1, None)
                     for s in (256, 512))
    assert double[block.METER_ATTENTION] == 2 * small[block.METER_ATTENTION]
    tiny = block.tiny_model(seq_length=256, hidden_size=128, num_attention_heads=4)
    n, H, d = 256, 128, 32
    expected = 4 * n * (3 * H + 2 * H + H + H) + 4 * n * 4 + 4 * n * d * 4
    assert block.planned(tiny, 1, None)[block.METER_ATTENTION] == expected
