"""ContextParallelCoreAttention's pieces that need no process group."""

import pytest

from megatron_flat.cpu.context_attention import attention_flops, load_balanced_chunks


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_attention_equals_causal_attention_in_the_inputs_dtype(dtype):
    """One chunk of queries at global positions [T−c, T) against keys [0, T): the prefix and
    the diagonal block merged by their log-sum-exps equal causal attention over the whole
    sequence (those rows), and come back in the queries' dtype (a bf16 model's output
    projection takes bf16)."""
    import torch

    from megatron_flat.cpu.context_attention import _PrefixCausalAttention

    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    b, n, total, c, d = 1, 2, 12, 4, 8
    q, k, v = (torch.randn(b, n, total, d).to(kind).requires_grad_() for _ in range(3))
    out = _PrefixCausalAttention.apply(q[:, :, total - c:], k, v, d ** -0.5)
    assert out.dtype == kind
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True)[:, :, total - c:]
    # bf16: four roundings to bf16 (the kernel's probabilities, both partial outputs, the
    # merged output), each within one unit roundoff 2**-8 of the values' scale.
    tol = 1e-5 if kind == torch.float32 else 4 * 2.0**-8
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    out.float().sum().backward()
    assert q.grad.dtype == kind and k.grad.dtype == kind


@pytest.mark.parametrize("dk,dv", [(24, 16), (8, 12)])
def test_prefix_attention_with_mla_head_dims_equals_causal_attention(dk, dv):
    """Multi-latent attention's values are narrower (or wider) than its queries and keys: the
    prefix attention pads the kernel's operands with zero columns and still equals causal
    attention, output and every input gradient (fp64 math reference)."""
    import torch

    from megatron_flat.cpu.context_attention import _PrefixCausalAttention

    torch.manual_seed(1)
    b, n, total, c = 1, 2, 12, 4
    q, k = (torch.randn(b, n, total, dk, requires_grad=True) for _ in range(2))
    v = torch.randn(b, n, total, dv, requires_grad=True)
    scale = 0.3
    out = _PrefixCausalAttention.apply(q[:, :, total - c:], k, v, scale)
    assert out.shape == (b, n, c, dv)
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (qq @ kk.transpose(-1, -2)) * scale
    mask = torch.ones(total, total, dtype=torch.bool).tril()
    ref = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv)[:, :, total - c:]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for mine, theirs in ((q, qq), (k, kk), (v, vv)):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_kept_prefix_output_replays_bitwise(dtype):
    """Attention replay under CP: the slot's (O, LSE) kept from a no-grad first pass and
    handed to the re-run give the output and every input gradient bitwise (fp32 and bf16); a
    one-ulp change to the kept O (every element) changes the gradients."""
    import torch

    from megatron_flat.cpu.context_attention import (
        _PrefixCausalAttention,
        _prefix_forward,
    )

    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    b, n, total, c, d = 1, 2, 12, 4, 8
    base = [torch.randn(b, n, total, d).to(kind) for _ in range(3)]
    grad = torch.randn(b, n, c, d).to(kind)

    def run(kept=None):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = _PrefixCausalAttention.apply(q[:, :, total - c:], k, v, d ** -0.5, *(kept or ()))
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]

    stock = run()
    with torch.no_grad():
        kept = _prefix_forward(base[0][:, :, total - c:], base[1], base[2], d ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(run(kept), stock))
    out = torch.nextafter(kept[0], torch.full_like(kept[0], float("inf")))
    lse = kept[1]
    assert not all(torch.equal(a, b) for a, b in zip(run((out, lse))[1:], stock[1:]))
