"""Param offload's optimizer on a GPU, where Megatron's fused norm and scale kernels cannot
read the experts' host gradients: the norm takes their per-parameter norms as one device
tensor (the same sum of squares) and the clipping scales them on the host by Megatron's own
coefficient. Run here with every gradient taken for a host one (``_on_host``)."""

import pytest
import torch

from megatron_flat.megatron import param_offload_optimizer as opt


@pytest.fixture
def host_everything(monkeypatch):
    monkeypatch.setattr(opt, "_on_host", lambda grad: True)


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in ((4, 8), (8, 4), (16,))]


def test_the_norm_of_host_gradients_is_their_sum_of_squares(megatron_cpu, host_everything):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    grads = _grads()
    given = opt._for_device_norm(grads, device=torch.device("cpu"))
    assert len(given) == 1 and given[0].shape == (3,)
    want = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
    assert get_grad_norm_fp32(given) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("total, scaled", [(10.0, True), (0.5, False)])
def test_clipping_scales_host_gradients_by_megatrons_coefficient(megatron_cpu, host_everything,
                                                                 total, scaled):
    passed = []
    clip = opt._clipping(lambda params, *args, **kwargs: passed.append(list(params)))
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads()]
    for p, g in zip(params, _grads()):
        p.grad = g.clone()
    clip(params, 1.0, total, use_decoupled_grad=False)
    coeff = 1.0 / (total + 1.0e-6)
    for p, g in zip(params, _grads()):
        assert torch.equal(p.grad, g * coeff if scaled else g)
    assert passed == [[]]  # nothing left for Megatron's device kernel


def test_without_host_gradients_clipping_is_megatrons(megatron_cpu):
    passed = []
    clip = opt._clipping(lambda params, *args, **kwargs: passed.append(list(params)))
    params = [torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.ones(2)
    clip(params, 1.0, 10.0)
    assert passed == [params] and torch.equal(params[0].grad, torch.ones(2))
