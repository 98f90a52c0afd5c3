"""plan.costs' op formula for the flat MoE layer holds where it is fitted: at EP 2, E_l in
{2, 4, 8} and K in {1, 4, 10}, the ledger's ops of Megatron's tiny MoE layer with
PipelinedLLEP (forward + backward, and under full recompute with the graph-only re-run) are
within 15 % of ``moe_layer_counts`` with U = K·E_l units (benchmarks/moe_ops_fit.py counts
them; the routing reaches every local expert in every chunk, as at real scale)."""

import importlib.util
import os

import pytest

from megatron_flat.plan.costs import moe_layer_counts

pytestmark = pytest.mark.world(2)

POINTS = [(el, k) for el in (2, 4, 8) for k in (1, 4, 10)]


def _fit_module():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "moe_ops_fit.py")
    spec = importlib.util.spec_from_file_location("moe_ops_fit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("el, k", POINTS)
def test_flat_ops_within_15_percent_of_the_formula(el, k, megatron_cpu):
    fit = _fit_module()
    got = fit.count(el, k)
    assert got["units"] == k * el
    shape = dict(hidden=16, ffn=16, experts=2 * el, tokens=fit.TOKENS, ep=2, routes_computed=1,
                 routes_sent=1, bytes_per_value=4, flat=True, chunks=k, max_chunks=10)
    for key, recompute in (("step", False), ("recompute", True)):
        want = moe_layer_counts(**shape, recompute=recompute)["ops"]
        assert abs(got[key] - want) <= 0.15 * want, (key, got[key], want)
