"""Shared by the multi-rank Megatron MoE-layer tests (loaded by path; not a test module).

Builds Megatron's stock ``MoELayer`` (alltoall dispatcher) and ``FlatMoELayer``s with the same
weights, forces the routing through Megatron's RouterReplay, runs forward + backward on the
same inputs and compares output, input gradient and every parameter gradient (router and
this rank's experts).
"""

from __future__ import annotations

import math

import torch

from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

# fp32 rounding only: GEMM rows can differ in the last bits when the GEMM's row count
# changes (chunks, spills) and expert-weight gradients are summed over chunks and helpers in
# another order. Values are O(1e-3..1); an error of the method (a lost route, a wrong weight,
# a missing gradient return) is O(value).
RTOL, ATOL = 1e-5, 1e-7


def layer_config(tiny: TinyMoE, ep: int, **overrides):
    """The tiny model's MoE config with routing replay and Megatron's aux loss and z-loss on
    (they must be untouched by the flat dispatch)."""
    return transformer_config(tiny, ep=ep, moe_enable_routing_replay=True,
                              moe_router_load_balancing_type="aux_loss",
                              moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                              moe_router_pre_softmax=tiny.topk == 1,  # Megatron requires it
                              **overrides)


def _stock_spec(tiny: TinyMoE, ep: int, **overrides):
    """(the layer config, Megatron's local MoE spec with SequentialMLP experts)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    spec = get_moe_module_spec_for_backend(backend=LocalSpecProvider(),
                                           num_experts=tiny.num_experts)
    return layer_config(tiny, ep, **overrides), spec


def build_pair(tiny: TinyMoE, ep: int, flats: dict, seed: int = 7, experts_spec=None,
               **overrides):
    """(stock alltoall MoELayer, {name: FlatMoELayer}) with identical weights; the experts
    are SequentialMLP, or built from ``experts_spec``; ``overrides``: config fields."""
    from megatron_flat.megatron import compat
    from megatron_flat.megatron.spec import flat_moe_spec

    config, spec = _stock_spec(tiny, ep, **overrides)
    if experts_spec is not None:
        spec = compat.replace_experts(spec, experts_spec)
    torch.manual_seed(seed)
    stock = compat.build_moe_layer(spec, config)
    stock.set_layer_number(1)
    layers = {}
    for name, flat in flats.items():
        layer = compat.build_moe_layer(flat_moe_spec(spec, flat), config)
        layer.load_state_dict(stock.state_dict())
        layer.set_layer_number(1)
        layers[name] = layer
    return stock, layers


def run(layer, x: torch.Tensor, grad: torch.Tensor, expert_ids=None):
    """Forward + backward of ``layer`` on ``x`` ([s, b, H]) with routing ``expert_ids``
    (None: the layer's own router decides)."""
    import contextlib

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_flat.megatron.moe import replay_routing

    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    # The aux-loss backward creates a process-wide loss scale when no schedule set one; put
    # it back so a later training schedule can set its own.
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        routing = (contextlib.nullcontext() if expert_ids is None
                   else replay_routing(layer, expert_ids))
        with routing:
            out, bias = layer(x)
        assert bias is None
        out.backward(grad)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()
             if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


# bf16: chunked expert GEMMs round in bf16 per chunk, and weight gradients are summed over
# chunks in fp32 before one rounding to bf16 (the stock layer: one bf16 GEMM): a few bf16 ulps
# (measured: at most one ulp at the tensor's largest value).
BF16_RTOL = 2 * 2.0**-8


def _atol(want: torch.Tensor, loose: bool, scaled: bool) -> float:
    """The absolute tolerance for ``want``. fp32: ATOL, or with ``scaled`` ATOL times its
    largest value (a reordered sum's rounding scales with its largest terms: GPT-OSS's biased,
    clamped experts reach ~13). bf16 (``loose``): always two bf16 ulps at its largest value (a
    chunk's partial sums are rounded to bf16 at that scale), so a tensor of small values is
    held to its own precision, not to a fixed bound that could exceed the values."""
    scale = want.abs().max().item() if want.numel() else 0.0
    if loose:
        return 0.0 if scale == 0.0 else 2 * 2.0 ** (math.floor(math.log2(scale)) - 7)
    return ATOL * max(1.0, scale) if scaled else ATOL


def differences(want, got, *, exact: bool, loose: bool = False, scaled: bool = False) -> list:
    """Human-readable differences between two ``run`` results (empty: equal). ``loose``:
    bf16 tolerances instead of fp32's; ``scaled``: absolute tolerances scaled with each
    tensor's largest value (see ``_atol``)."""
    names = ["output", "input grad"]
    problems = []
    pairs = list(zip(names, want[:2], got[:2]))
    if set(want[2]) != set(got[2]):
        problems.append(f"parameters with grads differ: {sorted(set(want[2]) ^ set(got[2]))}")
    pairs += [(f"grad {n}", want[2][n], got[2][n]) for n in sorted(set(want[2]) & set(got[2]))]
    for name, a, b in pairs:
        if exact:
            if not torch.equal(a, b):
                problems.append(f"{name}: not bitwise equal (max abs {(a - b).abs().max():.3g})")
        elif not torch.allclose(b.float(), a.float(), rtol=BF16_RTOL if loose else RTOL,
                                atol=_atol(a, loose, scaled)):
            problems.append(f"{name}: max abs error {(a - b).abs().max():.3g} (largest "
                            f"value {a.abs().max():.3g})")
    return problems


# ---------------------------------------------------------------------------- grouped experts
GROUPED_KINDS = ("grouped-mlp", "te-grouped-mlp")  # GroupedMLP exists in 0.16 only
# GPT-OSS's experts: TEGroupedMLP with biases on both linears (fc2's added as b_i · prob by
# TEGroupedMLP) and the clamped, offset quick-GEGLU.
BIASED_KIND = "te-grouped-mlp-biases"


def grouped_overrides(kind: str) -> dict:
    """The config fields a grouped kind sets (GPT-OSS's expert settings for BIASED_KIND)."""
    if kind != BIASED_KIND:
        return {}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(add_bias_linear=True, bias_dropout_fusion=False, activation_func=quick_gelu,
                glu_linear_offset=1.0, activation_func_clamp_value=7.0)


def randomise_biases(layer, seed: int = 11) -> None:
    """Non-zero expert biases (built zero, as TE's), so their values reach the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if ".bias" in name and "experts" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen).to(p.dtype))


def grouped_experts_spec(kind: str):
    """The experts spec of ``kind`` runnable on CPU (None when the release has no such class)."""
    from megatron_flat.megatron import compat
    from megatron_flat.cpu.grouped import (
        CpuColumnParallelGroupedLinear,
        CpuRowParallelGroupedLinear,
    )

    if kind == "grouped-mlp":
        from megatron.core.transformer.spec_utils import ModuleSpec

        cls = compat.grouped_mlp_class()  # 0.16 only; 0.16 specs are ModuleSpecs
        return None if cls is None else ModuleSpec(module=cls)
    return compat.te_grouped_mlp_spec(CpuColumnParallelGroupedLinear,
                                      CpuRowParallelGroupedLinear)


def build_grouped_pair(tiny: TinyMoE, ep: int, kind: str, seed: int = 7):
    """(stock MoELayer with SequentialMLP, stock MoELayer with ``kind`` grouped experts) with
    identical weights (the experts' copied through their SequentialMLP-layout views)."""
    from megatron_flat.megatron import compat

    config, spec = _stock_spec(tiny, ep)
    torch.manual_seed(seed)
    sequential = compat.build_moe_layer(spec, config)
    sequential.set_layer_number(1)
    grouped = compat.build_moe_layer(compat.replace_experts(spec, grouped_experts_spec(kind)),
                                     config)
    grouped.set_layer_number(1)
    with torch.no_grad():
        grouped.router.weight.copy_(sequential.router.weight)
        for (g1, g2), (s1, s2) in zip(compat.local_expert_weights(grouped.experts),
                                      compat.local_expert_weights(sequential.experts)):
            g1.copy_(s1)
            g2.copy_(s2)
    return sequential, grouped


def grouped_differences(sequential, grouped, x, grad, expert_ids, *, exact: bool = True
                        ) -> list:
    """Run both layers; differences (empty: equal, bitwise when ``exact``, else to
    RTOL/ATOL) in output, input grad, router grad and every local expert's weight gradients
    (mapped to SequentialMLP's layout)."""
    from megatron_flat.megatron import compat

    want_out, want_dx, want = run(sequential, x, grad, expert_ids)
    got_out, got_dx, got = run(grouped, x, grad, expert_ids)
    pairs = [("output", want_out, got_out), ("input grad", want_dx, got_dx),
             ("router grad", want["router.weight"], got["router.weight"])]
    for e, (w, g) in enumerate(zip(compat.local_expert_weights(sequential.experts, grads=True),
                                   compat.local_expert_weights(grouped.experts, grads=True))):
        pairs += [(f"expert {e} fc1 grad", w[0], g[0]), (f"expert {e} fc2 grad", w[1], g[1])]
    def same(a, b):
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=RTOL, atol=ATOL)

    return [f"{name}: max abs diff {(a - b).abs().max().item():.3g}"
            for name, a, b in pairs if not same(a, b)]


def check_grouped_layer(kind: str, case: tuple, dtype: torch.dtype, ep: int, flats: dict,
                        seed: int = 70) -> None:
    """FlatMoELayer with ``kind`` grouped experts against the stock alltoall layer with the
    same experts (the CPU grouped-GEMM reference), for a test file's ``CASES`` entry
    ``(topk, profile, seq per rank, micro-batch, variants)`` with ``flats`` its FlatConfigs:
    bitwise for the unchunked plain-EP variant (the same rows), else to fp32 (bf16) rounding."""
    import pytest
    import torch.distributed as dist

    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.testing.distributed import megatron_layout

    if grouped_experts_spec(kind) is None:
        pytest.skip("megatron-core 0.19 has no GroupedMLP (TEGroupedMLP is tested)")
    topk, profile, seqs, mb, _ = case
    rank = dist.get_rank()
    tiny = TinyMoE(num_experts=2 * ep, topk=topk)
    s = seqs[rank]
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(s, mb, tiny.hidden_size, generator=gen).to(dtype)
    g = torch.randn(s, mb, tiny.hidden_size, generator=gen).to(dtype)
    ids = routing_profile(profile, s * mb, tiny.num_experts, topk)
    overrides = {} if dtype == torch.float32 else dict(params_dtype=dtype, bf16=True)
    overrides.update(grouped_overrides(kind))
    problems = {}
    with megatron_layout(ep=ep):
        stock, layers = build_pair(tiny, ep, flats, experts_spec=grouped_experts_spec(kind),
                                   **overrides)
        if kind == BIASED_KIND:
            randomise_biases(stock, seed=seed + rank)
            for layer in layers.values():
                layer.load_state_dict(stock.state_dict())
        want = run(stock, x, g, ids)
        if kind == BIASED_KIND:  # every expert bias gets a gradient somewhere
            assert sum(n.startswith("experts.") and ".bias" in n for n in want[2]) \
                == 2 * tiny.num_experts // ep, \
                sorted(want[2])
        for name, layer in layers.items():
            assert type(layer.experts) is type(stock.experts)
            got = run(layer, x, g, ids)
            exact = name.startswith("llep-plain-ep")  # unchunked, unspilled: the same rows
            problems[name] = differences(want, got, exact=exact, loose=dtype != torch.float32,
                                         scaled=kind == BIASED_KIND)
            assert max(layer.flat_dispatch.last.received) <= layer.flat_dispatch.last.receive_bound
    assert problems == {name: [] for name in flats}, problems
