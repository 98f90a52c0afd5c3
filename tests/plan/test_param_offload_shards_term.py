"""The planner's param offload term with the experts' optimizer state sharded over expert-DP
(``plan.param_offload``; the runtime: ``megatron.param_offload_shards``): with the
distributed optimizer each of the s_e = TP·CP·DP/EP replicas keeps 12 bytes per owned
element of ⌈P_e / s_e⌉, plus the weights' all-gather staging; without it, or at s_e = 1,
every replica keeps all of them, as before."""

import pytest

from megatron_flat.config import FlatConfig
from megatron_flat.plan import param_offload as po
from megatron_flat.plan.model import Layout, ModelSpec
from megatron_flat.plan.peaks import estimate

TINY = ModelSpec(name="tiny-moe", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64,
                 vocab=1024, experts=8, topk=2, expert_ffn=128)
ON = FlatConfig(dispatch="pipelined", optimizer_offload=True, param_offload=True)
P_E = 4 * TINY.expert_params() * TINY.layers  # 4 local experts of 8 at EP 2


@pytest.mark.parametrize("dp, distributed, replicas", [(2, True, 1), (4, True, 2),
                                                       (8, True, 4), (4, False, 1)])
def test_the_host_state_is_the_replicas_share(dp, distributed, replicas):
    # EP 2 over TP 1 x DP dp: expert-DP dp / 2 (1 at DP 2)
    layout = Layout(ep=2, dp=dp, distributed_optimizer=distributed)
    term = po.term(TINY, layout, P_E)
    assert term.replicas == replicas
    owned = -(-P_E // term.replicas)
    assert term.optimizer_params == owned
    assert term.optimizer_host == 12 * owned  # bf16: fp32 master, m, v
    staging = 2 * po.STAGING_BYTES_PER_PARAM * min(4096, owned)
    if term.replicas > 1:
        staging += (1 + term.replicas) * min(po.GATHER_CHUNK_NUMEL, owned) * 2
    assert term.staging(2, 4096) == staging
    # the weights and gradients in the host tier stay whole on every replica
    assert term.host_bytes == (2 + 4) * P_E


def test_the_peak_report_counts_the_shard():
    layouts = {s: Layout(ep=2, dp=2 * s) for s in (1, 2, 4)}
    host = {s: estimate(TINY, lay, 4096, flat=ON).optimizer_host for s, lay in layouts.items()}
    dense = {s: host[s] - po.term(TINY, layouts[s], P_E).optimizer_host for s in host}
    # the experts' part halves with each doubling of expert-DP (the dense part shards too)
    assert [host[s] - dense[s] for s in (1, 2, 4)] == [12 * P_E, 6 * P_E, 3 * P_E]


def test_the_gather_round_is_the_runtimes():
    from megatron_flat.megatron.param_offload_shards import GATHER_CHUNK_NUMEL

    assert po.GATHER_CHUNK_NUMEL == GATHER_CHUNK_NUMEL
