"""A stand-in for transformer-engine's fused attention, for CPU tests of attention replay.

transformer-engine cannot be installed here, so :func:`installed` puts a small package under
its names in ``sys.modules``, shaped as TE's own is where replay touches it:

- ``cpp_extensions.fused_attn`` defines ``fused_attn_fwd`` / ``fused_attn_bwd``; the module
  that defines ``FusedAttnFunc`` (``attention.dot_product_attention.backends`` from TE 2.3,
  ``attention`` before: ``layout``) imports ``fused_attn_fwd`` by name and its forward calls
  that global with every argument positional, as TE's does;
- ``fused_attn_fwd`` returns ``(out, [stats, rng_state])``: the log-sum-exp (fp32,
  ``[b, h, s, 1]``) and a ``[seed, offset]`` pair it draws from the default generator on every
  call, dropout or not; ``fused_attn_bwd`` takes them back as ``aux_ctx_tensors`` and
  rebuilds the probabilities from the stats and the dropout mask from the pair, so a wrong
  kept O, stats or RNG state changes the gradients;
- ``FusedAttnFunc`` saves (q, k, v, out, *aux) and derives nothing else from them;
- ``transformer_engine.pytorch.DotProductAttention`` takes sbhd tensors and returns
  ``[s, b, h·d]``; with ``backend="flash"`` it runs no fused kernel (TE's flash-attn choice);
  with ``cp=True`` it goes through ``...dot_product_attention.context_parallel``, which calls
  the kernel by its own global three times a forward (a two-chunk ring in one process: two
  partial outputs merged by their log-sum-exps) and its backward once per step on the merged
  output and statistics, as TE's ring does.

:class:`CoreAttention` adapts it to Megatron's core-attention slot as Megatron's
``TEDotProductAttention`` does (a subclass calling ``super().forward``). ``calls`` counts the
stand-in's kernels. Its math is plain causal attention with dropout, in fp32.
"""

import contextlib
import sys
import types

import torch

calls = {"forward": 0, "backward": 0}


def _causal_probs(q, k, scale, causal=True):
    """q, k: [b, h, s, d] fp32. Scaled scores, causally masked unless ``causal`` is False."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if not causal:
        return scores
    s_q, s_k = scores.shape[-2:]
    mask = torch.ones(s_q, s_k, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf"))


def _keep_mask(rng_state, shape, dropout):
    generator = torch.Generator().manual_seed(int(rng_state[0]) * 1_000_003 + int(rng_state[1]))
    return (torch.rand(shape, generator=generator) >= dropout).float() / (1.0 - dropout)


def _bhsd(t):
    return t.permute(1, 2, 0, 3).float()


def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                   q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                   cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None,
                   page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                   dropout=0.0, fast_zero_fill=True, qkv_layout="sbhd_sbhd_sbhd",
                   attn_bias_type="no_bias", attn_mask_type="causal", window_size=(-1, -1),
                   rng_gen=None):
    calls["forward"] += 1
    rng_state = torch.randint(0, 2 ** 31 - 1, (2,), dtype=torch.int64)  # every call draws
    qf, kf, vf = _bhsd(q), _bhsd(k), _bhsd(v)
    scores = _causal_probs(qf, kf, attn_scale, attn_mask_type == "causal")
    stats = torch.logsumexp(scores, dim=-1, keepdim=True)  # fp32 [b, h, s, 1]
    probs = torch.exp(scores - stats)
    if dropout > 0:
        probs = probs * _keep_mask(rng_state, probs.shape, dropout)
    out = torch.matmul(probs, vf).permute(2, 0, 1, 3).to(q.dtype)  # sbhd
    return out, [stats, rng_state]


def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
                   fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
                   attn_scale=None, dropout=0.0, attn_mask_type="causal"):
    calls["backward"] += 1
    stats, rng_state = aux_ctx_tensors
    qf, kf, vf, of, dof = (_bhsd(t) for t in (q, k, v, o, d_o))
    causal = attn_mask_type == "causal"
    probs = torch.exp(_causal_probs(qf, kf, attn_scale, causal) - stats)  # the kept stats
    keep = _keep_mask(rng_state, probs.shape, dropout) if dropout > 0 else 1.0
    dropped = probs * keep
    dv = torch.matmul(dropped.transpose(-1, -2), dof)
    dprobs = torch.matmul(dof, vf.transpose(-1, -2)) * keep
    delta = (dof * of).sum(-1, keepdim=True)  # rowsum(dO·O), from the kept O
    dscores = probs * (dprobs - delta)
    dq = torch.matmul(dscores, kf) * attn_scale
    dk = torch.matmul(dscores.transpose(-1, -2), qf) * attn_scale
    return tuple(t.permute(2, 0, 1, 3).to(q.dtype) for t in (dq, dk, dv))


_CP_SOURCE = '''
import torch
from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_fwd, fused_attn_bwd


def _fwd(q, k, v, scale, mask):
    return fused_attn_fwd(True, q.shape[0], k.shape[0], None, None, q, k, v, q.dtype,
                          "F16_arbitrary_seqlen", None, None, None, None, None, None, None,
                          scale, 0.0, True, "sbhd_sbhd_sbhd", "no_bias", mask, (-1, -1), None)


def _bhsd(t):
    return t.permute(1, 2, 0, 3).float()


class AttnFuncWithCP(torch.autograd.Function):
    """Two query chunks as a ring of two would run them: chunk 1 on its own keys (causal),
    chunk 2 on chunk 1's keys (full) and its own (causal), merged by their log-sum-exps; the
    backward runs each step's kernel on the merged output and statistics."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        h = q.shape[0] // 2
        o1, (l1, r1) = _fwd(q[:h], k[:h], v[:h], scale, "causal")
        o21, (l21, r21) = _fwd(q[h:], k[:h], v[:h], scale, "no_mask")
        o22, (l22, r22) = _fwd(q[h:], k[h:], v[h:], scale, "causal")
        l2 = torch.logaddexp(l21, l22)
        o2 = torch.exp(l21 - l2) * _bhsd(o21) + torch.exp(l22 - l2) * _bhsd(o22)
        out = torch.cat([o1, o2.permute(2, 0, 1, 3).to(q.dtype)])
        ctx.save_for_backward(q, k, v, out, l1, l2, r1, r21, r22)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, l1, l2, r1, r21, r22 = ctx.saved_tensors
        h, sc = q.shape[0] // 2, ctx.scale

        def bwd(qs, ks, vs, rows, lse, rng, mask):
            return fused_attn_bwd(qs.shape[0], ks.shape[0], None, None, qs, ks, vs, out[rows],
                                  d_out[rows], q.dtype, q.dtype, [lse, rng],
                                  "F16_arbitrary_seqlen", sc, 0.0, mask)

        first, second = slice(None, h), slice(h, None)
        dq1, dk1, dv1 = bwd(q[:h], k[:h], v[:h], first, l1, r1, "causal")
        dq21, dk21, dv21 = bwd(q[h:], k[:h], v[:h], second, l2, r21, "no_mask")
        dq22, dk22, dv22 = bwd(q[h:], k[h:], v[h:], second, l2, r22, "causal")
        return (torch.cat([dq1, dq21 + dq22]), torch.cat([dk1 + dk21, dk22]),
                torch.cat([dv1 + dv21, dv22]), None)


def attn_forward_func_with_cp(q, k, v, scale):
    return AttnFuncWithCP.apply(q, k, v, scale)
'''


def _backends_source(module_name):
    """The module holding FusedAttnFunc: it imports fused_attn_fwd by name, as TE's does."""
    code = '''
import torch
from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_fwd, fused_attn_bwd


class FusedAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, is_training, max_seqlen, q, k, v, attn_scale, dropout_p):
        out, aux_ctx_tensors = fused_attn_fwd(
            is_training, max_seqlen, max_seqlen, None, None, q, k, v, q.dtype,
            "F16_arbitrary_seqlen", None, None, None, None, None, None, None, attn_scale,
            dropout_p, True, "sbhd_sbhd_sbhd", "no_bias", "causal", (-1, -1), None)
        ctx.save_for_backward(q, k, v, out, *aux_ctx_tensors)
        ctx.max_seqlen, ctx.attn_scale, ctx.dropout_p = max_seqlen, attn_scale, dropout_p
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, *aux_ctx_tensors = ctx.saved_tensors
        dq, dk, dv = fused_attn_bwd(ctx.max_seqlen, ctx.max_seqlen, None, None, q, k, v, out,
                                    d_out, q.dtype, q.dtype, aux_ctx_tensors,
                                    "F16_arbitrary_seqlen", ctx.attn_scale, ctx.dropout_p)
        return None, None, dq, dk, dv, None, None
'''
    return _module(module_name, code)


def _module(module_name, code):
    module = types.ModuleType(module_name)
    exec(compile(code, f"<stand-in {module_name}>", "exec"), module.__dict__)
    return module


class DotProductAttention(torch.nn.Module):
    """TE's module: sbhd query/key/value in, ``[s, b, h·d]`` out."""

    def __init__(self, num_attention_heads, kv_channels, attention_dropout=0.0,
                 softmax_scale=None, backend="fused"):
        super().__init__()
        self.heads, self.head_dim = num_attention_heads, kv_channels
        self.attention_dropout = attention_dropout
        self.softmax_scale = softmax_scale or kv_channels ** -0.5
        self.backend = backend

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None):
        s, b = query.shape[:2]
        dropout = self.attention_dropout if self.training else 0.0
        if _STATE.get("cp"):  # TE's context-parallel attention: the kernel once per step
            cp = sys.modules[CP_MODULE]
            out = cp.attn_forward_func_with_cp(query, key, value, self.softmax_scale)
        elif self.backend == "flash":  # TE's flash-attn choice: no fused kernel, no stats
            probs = torch.softmax(_causal_probs(_bhsd(query), _bhsd(key), self.softmax_scale),
                                  dim=-1)
            out = torch.matmul(probs, _bhsd(value)).permute(2, 0, 1, 3).to(query.dtype)
        else:
            func = sys.modules[_STATE["kernel_module"]].FusedAttnFunc
            out = func.apply(self.training, s, query, key, value, self.softmax_scale, dropout)
        return out.reshape(s, b, -1)


class CoreAttention(DotProductAttention):
    """Megatron's core-attention slot over the stand-in, as ``TEDotProductAttention``."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, **kwargs):
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.config = config
        super().__init__(config.num_attention_heads // tp, config.kv_channels,
                         config.attention_dropout if attention_dropout is None
                         else attention_dropout, softmax_scale, _STATE.get("backend", "fused"))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        return super().forward(query, key, value, attention_mask)


_STATE: dict = {}
CP_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"
LAYOUTS = {"2.3+": "transformer_engine.pytorch.attention.dot_product_attention.backends",
           "1.12-2.2": "transformer_engine.pytorch.attention"}


@contextlib.contextmanager
def installed(layout="2.3+", backend="fused", cp=False):
    """The stand-in under transformer-engine's names for the block; ``layout``: where
    ``FusedAttnFunc`` lives (a key of ``LAYOUTS``, or None: nowhere replay looks); ``cp``:
    attention through the context-parallel module's two-chunk ring (TE 2.3+'s layout)."""
    # Megatron decides at import whether TE is there: import it before the stand-in appears
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.transformer.attention  # noqa: F401

    import megatron_flat.testing.training  # noqa: F401

    names = ["transformer_engine", "transformer_engine.pytorch",
             "transformer_engine.pytorch.cpp_extensions",
             "transformer_engine.pytorch.cpp_extensions.fused_attn",
             "transformer_engine.pytorch.attention",
             "transformer_engine.pytorch.attention.dot_product_attention",
             "transformer_engine.pytorch.attention.dot_product_attention.backends", CP_MODULE]
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in names:
            sys.modules[name] = types.ModuleType(name)
        extensions = sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"]
        extensions.fused_attn_fwd, extensions.fused_attn_bwd = fused_attn_fwd, fused_attn_bwd
        sys.modules["transformer_engine.pytorch"].DotProductAttention = DotProductAttention
        kernel = LAYOUTS.get(layout)
        if kernel is not None:
            sys.modules[kernel] = _backends_source(kernel)
        else:  # FusedAttnFunc somewhere else: an unknown release
            kernel = "transformer_engine.pytorch.elsewhere"
            sys.modules[kernel] = _backends_source(kernel)
            names.append(kernel)
        if cp:
            sys.modules[CP_MODULE] = _module(CP_MODULE, _CP_SOURCE)
        _STATE.update(kernel_module=kernel, backend=backend, cp=cp)
        calls.update(forward=0, backward=0)
        yield sys.modules[kernel]
    finally:
        for name in names:
            if saved.get(name) is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]
        _STATE.clear()
