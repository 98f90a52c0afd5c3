"""Shared by the param offload tests on Megatron's MoE layers (loaded by path; not a test
module): a stack of FlatMoELayers (SequentialMLP or grouped experts) trained resident, with
DDP's main_grad protocol on every expert Parameter, or with ``attach_param_offload``; both
runs' losses, input and router gradients, expert main_grads and updated weights."""

from __future__ import annotations

import torch

from megatron_flat.config import FlatConfig
from megatron_flat.testing.families import moe_loss_scale_kept
from megatron_flat.testing.tiny_gpt import TinyMoE, reset_moe_loss_tracker
from tests.dispatch import _moe_layers as helpers

RECOMPUTES = ("megatron", "non-reentrant", "none")


class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


def build_stack(tiny: TinyMoE, ep: int, kind: str, depth: int, dtype: torch.dtype,
                flat: FlatConfig, seed: int = 7) -> _Stack:
    """``depth`` FlatMoELayers with ``kind`` experts ("sequential" or a grouped kind of
    ``_moe_layers.GROUPED_KINDS``), seeded alike on every call."""
    from megatron_flat.megatron import compat
    from megatron_flat.megatron.spec import flat_moe_spec

    overrides = {} if dtype == torch.float32 else dict(params_dtype=dtype, bf16=True)
    overrides.update(helpers.grouped_overrides(kind))
    config, spec = helpers._stock_spec(tiny, ep, **overrides)
    if kind != "sequential":
        spec = compat.replace_experts(spec, helpers.grouped_experts_spec(kind))
    layers = []
    for index in range(depth):
        torch.manual_seed(seed + index)
        layer = compat.build_moe_layer(flat_moe_spec(spec, flat), config)
        layer.set_layer_number(index + 1)
        if kind == helpers.BIASED_KIND:
            helpers.randomise_biases(layer, seed=seed + index)
        layers.append(layer)
    return _Stack(layers)


def resident_main_grads(stack: _Stack) -> None:
    """Megatron's DDP protocol on every expert Parameter, with the weights where they are."""
    from megatron_flat.megatron.param_offload import fold_into_main_grad

    for layer in stack.layers:
        for p in layer.experts.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.grad_added_to_main_grad = False
            p.register_post_accumulate_grad_hook(fold_into_main_grad)


def skew_router(stack: _Stack, direction: torch.Tensor, experts=(0, 1)) -> None:
    """Point the routers' rows of ``experts`` along ``direction``, so inputs shifted along it
    send most routes there (one rank's native experts: PipelinedLLEP spills them)."""
    with torch.no_grad():
        for layer in stack.layers:
            for e in experts:
                layer.router.weight[e] += 3.0 * direction.to(layer.router.weight.dtype)


def _forward(stack: _Stack, x: torch.Tensor, recompute: str) -> torch.Tensor:
    from megatron.core import tensor_parallel

    for layer in stack.layers:
        def run(h, layer=layer):
            return layer(h)[0]

        if recompute == "megatron":
            y = tensor_parallel.checkpoint(run, False, x)
        elif recompute == "non-reentrant":
            y = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
        else:
            y = run(x)
        x = x + y
    return x


def train(stack: _Stack, batches, recompute: str, offload=None, lr: float = 0.05) -> dict:
    """Steps of gradient accumulation (each a list of microbatch inputs [s, b, H]), each
    followed by ``w -= lr · main_grad`` on every expert weight and ``p -= lr · grad`` on the
    router; every loss, input gradient, router and expert gradient, and the final weights."""
    reset_moe_loss_tracker()  # sized by the first model that logged an aux loss
    out = {"losses": [], "input_grads": [], "router_grads": [], "expert_grads": []}
    transfers = 0  # spilled experts' weights sent to helpers (PipelinedLLEP's plan)
    experts = [list(layer.experts.parameters()) for layer in stack.layers]
    routers = [layer.router.weight for layer in stack.layers]
    with moe_loss_scale_kept():
        for microbatches in batches:
            for x in microbatches:
                x = x.clone().requires_grad_()
                loss = _forward(stack, x, recompute).float().square().mean()
                transfers += sum(len(layer.flat_dispatch.last.plan.weight_transfers)
                                 for layer in stack.layers)
                loss.backward()
                out["losses"].append(loss.detach())
                out["input_grads"].append(x.grad)
            out["router_grads"].append([r.grad.clone() for r in routers])
            if offload is not None:
                grads = [offload.host_grads(i) for i in range(len(experts))]
            else:
                grads = [[p.main_grad for p in layer] for layer in experts]
            out["expert_grads"].append([[g.clone() for g in layer] for layer in grads])
            with torch.no_grad():  # at rest, an offloaded Parameter's data is its host view
                for layer, layer_grads in zip(experts, grads):
                    for p, g in zip(layer, layer_grads):
                        p.data.sub_((g * lr).to(p.dtype))
                for r in routers:
                    r.sub_(lr * r.grad)
                    r.grad = None
            if offload is not None:
                offload.weights_updated()
                offload.zero_grad()
            else:
                for layer in experts:
                    for p in layer:
                        p.main_grad.zero_()
                        p.grad_added_to_main_grad = False
    out["weights"] = [[p.data.clone() for p in layer] for layer in experts]
    return out, transfers


def differences(want: dict, got: dict) -> list:
    """What is not bitwise equal between two ``train`` results."""
    def flat(value):
        if isinstance(value, torch.Tensor):
            return [value]
        return [t for v in value for t in flat(v)]

    problems = []
    for key in want:
        a, b = flat(want[key]), flat(got[key])
        if len(a) != len(b):
            problems.append(f"{key}: {len(a)} tensors against {len(b)}")
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
        if bad:
            problems.append(f"{key}: {len(bad)} of {len(a)} tensors differ (first {bad[0]})")
    return problems
