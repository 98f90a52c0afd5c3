"""Param offload's optimizer where Megatron's fused kernels cannot read the experts' host
gradients (a GPU run): the norm takes their per-parameter norms as one device tensor (the
same sum of squares), and the clipping is Megatron's coefficient applied on the host. Run
here with every gradient taken for a host one (``_on_host``)."""

import pytest
import torch

from megatron_flat.megatron import param_offload_optimizer as opt


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in ((4, 8), (8, 4), (16,))]


def test_the_norm_of_host_gradients_is_their_sum_of_squares(megatron_cpu, monkeypatch):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    monkeypatch.setattr(opt, "_on_host", lambda grad: True)
    grads = _grads()
    given = opt._for_device_norm(grads, device=torch.device("cpu"))
    assert len(given) == 1 and given[0].shape == (3,)
    want = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
    assert get_grad_norm_fp32(given) == pytest.approx(want, rel=1e-6)


def test_on_a_cpu_run_the_norm_reads_the_gradients_themselves():
    grads = _grads()
    assert opt._for_device_norm(grads) is grads


@pytest.mark.parametrize("total, scaled", [(10.0, True), (0.5, False)])
def test_host_clipping_is_megatrons(megatron_cpu, total, scaled):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron_flat.cpu.backend import enable_cpu_backend

    enable_cpu_backend()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads()]
    for p, g in zip(params, _grads()):
        p.grad = g.clone()
    clip_grad_by_total_norm_fp32(params, 1.0, total)  # Megatron's (its CPU scale kernel)
    grads = _grads()
    opt.clip_host_grads(grads, 1.0, total)
    for p, g, original in zip(params, grads, _grads()):
        assert torch.equal(p.grad, g)
        assert torch.equal(g, original) != scaled
