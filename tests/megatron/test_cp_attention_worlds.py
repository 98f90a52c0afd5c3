"""ContextParallelCoreAttention equals single-rank causal attention, forward and backward,
at CP 2 and CP 4 (eight chunks, each rank two of them).

Every rank computes the reference (plain causal attention over the whole sequence) itself;
the CP run feeds each rank its two load-balanced chunks and gathers outputs and input
gradients back into global order for comparison (fp32 rounding: blocks sum in another order).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.cpu.context_attention import (
    ContextParallelCoreAttention,
    load_balanced_chunks,
)
from megatron_flat.testing.distributed import megatron_layout
from tests._worlds import WORLDS

world2 = pytest.mark.world(2)


def _attention(cp: int, heads: int = 4, groups: int = 4):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads,
                               num_query_groups=groups, context_parallel_size=cp,
                               use_cpu_initialization=True, attention_dropout=0.0)
    return ContextParallelCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                        attention_type="self")


def _local(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim=0)
    return torch.cat([chunks[j] for j in load_balanced_chunks(rank, cp)])


def _to_global(parts, cp: int) -> torch.Tensor:
    chunks = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        for piece, j in zip(part.chunk(2, dim=0), load_balanced_chunks(rank, cp)):
            chunks[j] = piece
    return torch.cat(chunks)


def _single_and_cp(build, q, k, v, grad):
    """``build(cp_size)`` at CP 1 on the whole sequence and at CP = the world on each rank's
    chunks: the CP output and input gradients, gathered into global order, equal the single
    rank's (fp32 rounding) and are not all zero. Returns both modules."""
    cp = dist.get_world_size()
    with megatron_layout(1, 1, 1):
        single = build(1)
        ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = single(*ref_inputs, None)
        ref.backward(grad)
    with megatron_layout(1, 1, 1, cp=cp):
        attn = build(cp)
        rank = dist.get_rank()
        inputs = [_local(t, rank, cp).requires_grad_() for t in (q, k, v)]
        out = attn(*inputs, None)
        assert out.shape == (q.shape[0] // cp,) + tuple(ref.shape[1:])
        out.backward(_local(grad, rank, cp))
        got = [out.detach()] + [t.grad for t in inputs]
        for want, mine in zip([ref.detach()] + [t.grad for t in ref_inputs], got):
            parts = [torch.empty_like(mine) for _ in range(cp)]
            dist.all_gather(parts, mine.contiguous())
            full = _to_global(parts, cp)
            # fp32: the flash blocks' merge reorders the softmax sums; their rounding
            # scales with the tensor's largest value (up to ~6 here)
            torch.testing.assert_close(full, want, rtol=1e-5,
                                       atol=1e-6 * max(1.0, float(want.abs().max())))
            assert full.abs().max() > 0
    return single, attn


@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("world", WORLDS)
def test_cp_equals_single_rank(world, groups, megatron_cpu):
    """CP = the world."""
    cp = dist.get_world_size()
    assert cp == world
    seq, b, heads, dim = 24, 2, 4, 16
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(seq, b, heads, dim, generator=gen)
    k = torch.randn(seq, b, groups, dim, generator=gen)
    v = torch.randn(seq, b, groups, dim, generator=gen)
    grad = torch.randn(seq, b, heads * dim, generator=gen)
    single, attn = _single_and_cp(lambda size: _attention(size, heads, groups), q, k, v, grad)
    assert type(single) is type(attn) is ContextParallelCoreAttention


@world2
def test_mla_head_dims_under_cp_equal_single_rank_mla_attention(megatron_cpu):
    """Multi-latent attention under CP on the CPU backend: queries/keys of k_channels 24,
    values of v_channels 16. ``DotProductAttention`` built with MLA's arguments and CP = the
    world is the backend's MLAContextParallelCoreAttention, and it equals the single-rank
    MLADotProductAttention (Megatron's local forward): output and every input gradient."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flat.cpu.mla_attention import (
        MLAContextParallelCoreAttention,
        MLADotProductAttention,
    )

    seq, b, heads, dk, dv = 24, 2, 4, 24, 16

    def build(size):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads,
                                   context_parallel_size=size, use_cpu_initialization=True,
                                   attention_dropout=0.0)
        return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self", k_channels=dk, v_channels=dv,
                                   softmax_scale=0.2)

    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(seq, b, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(seq, b, heads, dv, generator=gen)
    grad = torch.randn(seq, b, heads * dv, generator=gen)
    single, attn = _single_and_cp(build, q, k, v, grad)
    assert type(single) is MLADotProductAttention
    assert type(attn) is MLAContextParallelCoreAttention


@pytest.mark.parametrize("softmax_type, window", [("learnable", None), ("vanilla", (5, 0)),
                                                   ("learnable", (5, 0)), ("off-by-one", (3, 0))])
@world2
def test_sinks_and_windows_under_cp_equal_megatrons_local_attention(megatron_cpu, softmax_type,
                                                                   window):
    """GPT-OSS's attention under CP: ``DotProductAttention`` with a softmax offset (learnable,
    non-zero; or off-by-one) and/or a sliding window, built with CP = the world, is the
    backend's ContextParallelCoreAttention on its masked path, and equals Megatron's own
    single-rank DotProductAttention: output, every input gradient and the offset's
    gradient (summed over the ranks' queries)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    seq, b, heads, dim = 24, 2, 4, 16

    def build(size):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads,
                                   context_parallel_size=size, use_cpu_initialization=True,
                                   attention_dropout=0.0, softmax_type=softmax_type,
                                   window_size=window, masked_softmax_fusion=False)
        attention = DotProductAttention(config, layer_number=1,
                                        attn_mask_type=AttnMaskType.causal,
                                        attention_type="self")
        if softmax_type == "learnable":
            with torch.no_grad():
                attention.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        return attention

    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(seq, b, heads, dim, generator=gen) for _ in range(3))
    grad = torch.randn(seq, b, heads * dim, generator=gen)
    single, attn = _single_and_cp(build, q, k, v, grad)
    assert type(single) is DotProductAttention
    assert type(attn) is ContextParallelCoreAttention and attn._masked()
    if softmax_type == "learnable":
        offset_grad = attn.softmax_offset.grad.clone()
        dist.all_reduce(offset_grad)
        torch.testing.assert_close(offset_grad, single.softmax_offset.grad, rtol=1e-5,
                                   atol=1e-6)
        assert single.softmax_offset.grad.abs().max() > 0


@world2
def test_sinks_under_cp_keep_nothing_for_replay_say_so_once_and_count_reruns(megatron_cpu,
                                                                             monkeypatch):
    """With attention replay on, a masked (sinks / window) CP layer keeps nothing: its first
    pass warns once, its re-run computes as stock and is counted in ``stock_reruns``."""
    import warnings

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flat.attention.replay import ReplayStore
    from megatron_flat.megatron import replay_wiring

    cp = dist.get_world_size()
    monkeypatch.setattr(replay_wiring, "current_store", lambda attention: attention.replay)
    monkeypatch.setattr(replay_wiring, "_warned", set())
    with megatron_layout(1, 1, 1, cp=cp):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                   context_parallel_size=cp, use_cpu_initialization=True,
                                   attention_dropout=0.0, softmax_type="learnable")
        attn = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self")
        attn.replay = ReplayStore()
        q = torch.randn(24 // cp, 2, 4, 16)
        with pytest.warns(UserWarning, match="keeps nothing on layers with attention sinks"):
            with torch.no_grad():
                first = attn(q, q, q, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # said once
            again = attn(q, q, q, None)
        assert torch.equal(first, again.detach())
        assert (attn.replay.stock_reruns, attn.replay.replays, len(attn.replay)) == (1, 0, 0)


@world2
def test_refuses_uneven_chunks(megatron_cpu):
    cp = dist.get_world_size()
    with megatron_layout(1, 1, 1, cp=cp):
        attn = _attention(cp)
        q = torch.randn(3, 1, 4, 16)
        with pytest.raises(ValueError, match="two equal chunks"):
            attn(q, q, q, None)
