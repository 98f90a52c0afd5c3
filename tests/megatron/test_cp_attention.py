"""ContextParallelCoreAttention's pieces that need no process group."""

import pytest

from megatron_flat.megatron.cpu_context_attention import attention_flops, load_balanced_chunks


def test_load_balanced_chunks():
    assert load_balanced_chunks(0, 2) == [0, 3]
    assert load_balanced_chunks(1, 2) == [1, 2]
    held = sorted(j for r in range(4) for j in load_balanced_chunks(r, 4))
    assert held == list(range(8))
    with pytest.raises(ValueError, match="outside"):
        load_balanced_chunks(2, 2)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_flops_balanced(cp):
    # Every CP rank does 1/CP of the single-rank causal work (the load balance), which is
    # N(N+1)/2 query-key pairs.
    seq = 16 * cp
    assert cp * attention_flops(seq, cp, 2, 8) == attention_flops(seq, 1, 2, 8)
    assert attention_flops(seq, 1, 1, 1) == 4 * seq * (seq + 1) // 2
    with pytest.raises(ValueError, match="2·CP"):
        attention_flops(30, 2, 1, 1)
