"""The peak formulas on small hand-computed cases, the composition and the binding term."""

import math

import pytest

from megatron_flat.config import GIB, FlatConfig
from megatron_flat.plan import Layout, ModelSpec, PlanError, estimate, preset

# Tiny MoE: H 8, 2 layers, 2 heads x 4, V 32, E 4 experts top-2, F 4, fp32.
H, L, V, E, K, F = 8, 2, 32, 4, 2, 4
MODEL = ModelSpec(name="t", hidden=H, layers=L, heads=2, kv_heads=2, head_dim=4, vocab=V,
                  experts=E, topk=K, expert_ffn=F, dtype="fp32")
REF = Layout(fused_kernels=False, distributed_optimizer=False)  # Megatron's unfused path
N = 16


def test_dispatch_baseline_by_hand():
    r = estimate(MODEL, REF, N)
    small = N * (13 * E + 16 * K + 8)                  # router bookkeeping: 1472
    routed = 4 * (K * N) * H * 4                       # send, sorted, expert out, its concat
    experts = 6 * (K * N) * F * 4                      # unfused SwiGLU activations
    assert r.dispatch == small + routed + experts == 8640
    assert r.dispatch_buffers == 4 * H * K * N * 2     # send + receive (σ = 1 at EP 1)
    assert r.sections["expert dispatch"] == r.dispatch
    # Fused SwiGLU keeps 4F per route instead of 6F.
    fused = estimate(MODEL, Layout(distributed_optimizer=False), N)
    assert r.dispatch - fused.dispatch == 2 * (K * N) * F * 4


def test_vocab_baseline_by_hand():
    r = estimate(MODEL, REF, N)
    fwd = N * V * 4 + 29 * N                           # fp32 logits, CE bookkeeping: 2512
    bwd = N * H * 4 + V * H * 4                        # input grad + transient weight grad
    assert r.sections["vocabulary projection + loss"] == max(fwd, bwd) == 2512
    assert r.vocab == max(fwd, 4 * N * V + bwd) == 3584  # + the saved fp32 softmax
    # bf16: logits in bf16 plus their fp32 copy, 6 B per logit.
    bf = estimate(ModelSpec(**{**MODEL.__dict__, "dtype": "bf16"}), REF, N)
    assert bf.sections["vocabulary projection + loss"] == N * V * 6 + 29 * N


def test_boundaries_optimizer_and_composition_by_hand():
    r = estimate(MODEL, REF, N)
    B = N * H * 4
    assert r.boundary_bytes == B and r.boundaries_held == L
    assert r.boundaries_device == L * B + 3 * B + 4 * N   # + last output, final norm in/out
    params = r.params
    attn = 4 * H * 8                                      # Q, K, V, O: H x (2 heads x 4)
    per_layer = attn + 2 * H + H * E + E * 3 * H * F
    assert params == L * per_layer + 2 * V * H + H
    assert r.weights == 4 * params and r.grads == 4 * params
    assert r.optimizer_device == 8 * params               # fp32 params: m and v only
    assert r.total == r.optimizer + r.boundaries_device + max(r.dispatch + r.other, r.vocab)


def test_skew_scales_the_receive_side_and_is_capped():
    lay = Layout(ep=2, dp=2, fused_kernels=False, distributed_optimizer=False)
    one = estimate(MODEL, lay, N, skew=1.0)
    two = estimate(MODEL, lay, N, skew=2.0)
    e_local = E // 2
    per_route = 4 * H * (1 + (e_local > 1)) + 4 * (6 * F + 2 * H)  # recv, sort, experts, out
    assert two.dispatch - one.dispatch == (K * N) * per_route
    assert two.dispatch_buffers == 4 * H * K * N * (1 + 2)
    # A rank can receive at most EP·min(k, E_l)/k = 2 times the mean.
    assert estimate(MODEL, lay, N, skew=9.0).dispatch == two.dispatch
    assert one.dispatch_bound == two.dispatch
    # EP = 1: every route is local, the skew does not apply.
    assert estimate(MODEL, REF, N, skew=3.0).dispatch == estimate(MODEL, REF, N, skew=1.0).dispatch
    with pytest.raises(PlanError, match="skew"):
        estimate(MODEL, REF, N, skew=0.5)


def test_pipelined_llep_bounds_the_dispatch_by_chunks():
    lay = Layout(ep=2, dp=2, fused_kernels=False, distributed_optimizer=False)
    n = 4096
    base = estimate(MODEL, lay, n, skew=2.0)
    cfgs = [FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=c, dispatch_max_chunks=64)
            for c in (2048, 512, 128)]
    values = [estimate(MODEL, lay, n, cfg, skew=2.0) for cfg in cfgs]
    assert [v.num_chunks for v in values] == [2, 8, 32]
    assert [v.chunk_tokens for v in values] == [2048, 512, 128]
    assert base.dispatch > values[0].dispatch > values[1].dispatch > values[2].dispatch
    # LLEP evens the load: σ goes from 2 to α = 1.
    assert values[0].skew == 1.0 and base.skew == 2.0
    # By hand at c_eff = 128: routing + output accumulator + 2 chunks in flight (send+recv)
    # + sort + one chunk's experts + one borrowed expert (weights + fp32 grad).
    c, b = 128, 4
    small = n * (13 * E + 16 * K + 8)
    expected = (small + b * n * H + b * 2 * H * (K * c + K * c) + b * K * c * H
                + b * K * c * (6 * F + 2 * H) + 3 * H * F * (b + 4))
    assert values[2].dispatch == expected
    # K_max caps the chunk count; c_eff then exceeds c.
    capped = estimate(MODEL, lay, n, FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=128,
                                                dispatch_max_chunks=4), skew=2.0)
    assert (capped.num_chunks, capped.chunk_tokens) == (4, 1024)
    # Below the imbalance threshold LLEP keeps plain EP.
    calm = estimate(MODEL, lay, n, FlatConfig(dispatch="llep"), skew=1.2)
    assert calm.skew == 1.2


def test_ring_dtp_bounds_the_vocab_by_strips():
    n = 4096
    tp = Layout(tp=2, distributed_optimizer=False)
    base = estimate(MODEL, tp, n)
    ring = estimate(MODEL, tp, n, FlatConfig(vocab=True, vocab_mode="weights"))
    n_sp, w = n // 2, V // 2
    strips, state = 2 * 4 * n_sp * w, 4 * n_sp * (3 + H)
    # Shards in flight, the one travelling dW sum and its relay slot (1/8 of it).
    moving = 2 * w * H * 4 + 4 * (w + -(-w // 8)) * H
    assert ring.vocab == strips + state + moving + 29 * n_sp
    assert ring.vocab < base.vocab
    auto = estimate(MODEL, tp, n, FlatConfig(vocab=True))
    assert auto.vocab_mode == "weights"                    # N_sp = 2048 > V/P = 16
    # One rank (the blocked version): one fp32 strip of vocab_block_size rows at a time; the
    # backward adds the weight gradient into main_grad and keeps the fp32 dX next to one
    # recomputed strip, then returns DDP's placeholder (as large as the weight), with the
    # lse the forward saved (validated against the meter in test_validation_flat).
    one = estimate(MODEL, REF, n, FlatConfig(vocab=True, vocab_block_size=8))
    assert one.vocab_mode == "weights"
    assert V % 8 == 0
    assert one.vocab == 4 * n + max(4 * n * H + 4 * n * 8 + 29 * n, 4 * V * H)


def test_mtp_heads_add_a_softmax_each_to_the_baseline_and_a_few_bytes_to_ring_dtp():
    n = 4096
    tp = Layout(tp=2, distributed_optimizer=False)
    heads = ModelSpec(**{**MODEL.__dict__, "mtp_layers": 2})
    base, base_mtp = estimate(MODEL, tp, n), estimate(heads, tp, n)
    saved = 4 * n * (V // 2)  # one head's fp32 softmax kept for its backward
    assert base_mtp.vocab == base.vocab + 2 * saved  # the backward meets all three
    flat = FlatConfig(vocab=True, vocab_mode="weights")
    ring, ring_mtp = estimate(MODEL, tp, n, flat), estimate(heads, tp, n, flat)
    from megatron_flat.plan.peaks import MTP_SAVED_PER_TOKEN

    assert ring_mtp.vocab == ring.vocab + 2 * MTP_SAVED_PER_TOKEN * (n // 2)
    one = FlatConfig(vocab=True, vocab_block_size=8)
    assert estimate(heads, REF, n, one).vocab == \
        estimate(MODEL, REF, n, one).vocab + 2 * MTP_SAVED_PER_TOKEN * n


def test_sco_keeps_prefetch_plus_one_on_device():
    model = ModelSpec(**{**MODEL.__dict__, "layers": 6})
    B = N * H * 4
    base = estimate(model, REF, N)
    assert base.boundaries_held == 6
    cfg = FlatConfig(sco=True, sco_host_budget_gib=(4 * B + B // 2) / GIB, sco_prefetch=1)
    r = estimate(model, REF, N, cfg)
    # The host tier allocates SCO's whole budget (exactly) at the first offload.
    assert r.boundaries_offloaded == 4 and r.boundaries_host == cfg.sco_host_budget_bytes
    # 2 past the budget stay, plus prefetch + 1 = 2 restored ones, plus the final-norm part.
    assert r.boundaries_device == (2 + 2) * B + 3 * B + 4 * N
    everything = estimate(model, REF, N, FlatConfig(sco=True, sco_host_budget_gib=1.0))
    assert everything.boundaries_offloaded == 6
    assert everything.boundaries_device == 2 * B + 3 * B + 4 * N


def test_optimizer_offload_keeps_staging_on_device():
    model = preset("paper-241b")
    lay = Layout(tp=8, cp=4, ep=32)
    base = estimate(model, lay, 1 << 16)
    off = estimate(model, lay, 1 << 16, FlatConfig(optimizer_offload=True,
                                                     optimizer_bucket_numel=10_000_000,
                                                     optimizer_num_slots=2))
    # One OffloadStreamAdamW per Megatron sub-optimizer (dense and expert), each with its own
    # 2 slots of master, m, v (fp32 grads are read in place): both shards exceed the bucket.
    assert off.optimizer_device == 2 * 2 * 10_000_000 * 12
    shard = base.optimizer_device // 12                   # bf16: 12 B/param on device
    # Distributed optimizer: fp32 master, m and v on host; the fp32 grads stay in the
    # device grad buffer (counted in grads).
    assert off.optimizer_host == 12 * shard  # bytes: exact
    assert off.host_per_node == off.host_per_device * 8
    assert off.weights == base.weights and off.grads == base.grads
    # Non-distributed (Float16) optimizer: its fp32 master stays on the device.
    lay = Layout(tp=8, cp=4, ep=32, distributed_optimizer=False)
    base = estimate(model, lay, 1 << 16)
    off = estimate(model, lay, 1 << 16, FlatConfig(optimizer_offload=True,
                                                     optimizer_bucket_numel=10_000_000,
                                                     optimizer_num_slots=2))
    shard = base.optimizer_device // 12
    assert off.optimizer_device == 2 * 2 * 10_000_000 * 12 + 4 * shard
    assert off.optimizer_host == 8 * shard


def test_binding_term():
    lay = Layout(tp=8, cp=8, ep=64)
    # Short sequence: the resident state binds.
    assert estimate(preset("paper-667b"), lay, 4096).binding == "optimizer"
    # Huge vocabulary, few parameters, long sequence: the logits bind.
    big_vocab = ModelSpec(name="v", hidden=1024, layers=2, heads=8, kv_heads=8, head_dim=128,
                          vocab=1_000_000, experts=8, topk=2, expert_ffn=512)
    r = estimate(big_vocab, Layout(), 65536)
    assert r.binding == "vocab" and r.vocab > r.dispatch + r.other
    # Many experts per token, small vocabulary: the MoE transient binds.
    wide = ModelSpec(name="d", hidden=4096, layers=2, heads=32, kv_heads=8, head_dim=128,
                     vocab=1000, experts=64, topk=16, expert_ffn=4096)
    r = estimate(wide, Layout(ep=8, dp=8), 65536)
    assert r.binding == "dispatch"
    # Deep and narrow with a small vocabulary: the boundaries bind.
    deep = ModelSpec(name="b", hidden=1024, layers=400, heads=8, kv_heads=8, head_dim=128,
                     vocab=1000, experts=4, topk=1, expert_ffn=64)
    assert estimate(deep, Layout(), 65536).binding == "boundaries"


def test_pipeline_stages_hold_microbatches_in_flight():
    model = preset("paper-241b")  # 14 layers: 7 per stage
    lay = Layout(tp=8, cp=2, pp=2, ep=16)
    first = estimate(model, lay, 1 << 18, stage=0)
    last = estimate(model, lay, 1 << 18, stage=1)
    # 1F1B: the first stage holds PP = 2 microbatches' boundaries, the last one, plus the
    # final norm's; only the last stage has the vocabulary transient.
    assert first.boundaries_held == 14 and last.boundaries_held == 7
    assert first.boundaries_device == 14 * first.boundary_bytes
    assert first.vocab == 0 < last.vocab
    assert estimate(model, lay, 1 << 18).total == max(first.total, last.total)
    fewer = estimate(model, lay.with_(microbatches_in_flight=1), 1 << 18, stage=0)
    assert fewer.boundaries_held == 7
    with pytest.raises(PlanError, match="stage 2"):
        estimate(model, lay, 1 << 18, stage=2)


def test_sequence_and_layout_errors():
    with pytest.raises(PlanError, match=r"multiple of 2·CP = 16"):
        estimate(MODEL, Layout(cp=8), 1000)
    with pytest.raises(PlanError, match="sequence length must be a positive integer"):
        estimate(MODEL, REF, 0)
    with pytest.raises(PlanError, match="EP 8 does not divide"):
        estimate(MODEL, Layout(ep=8, dp=8), 64)


def test_dense_model_has_no_dispatch():
    dense = ModelSpec(name="dense", hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16,
                      vocab=100, dense_ffn=256)
    r = estimate(dense, Layout(), 128)
    assert r.dispatch == 0 and r.total > 0


@pytest.mark.parametrize("name", ["paper-120b", "paper-241b", "paper-667b", "deepseek-v3",
                                  "gpt-oss-120b", "gpt-oss-20b", "qwen3-30b-a3b", "kimi-k2",
                                  "qwen3-235b-a22b", "mixtral-8x22b", "llama-4-maverick"])
def test_every_preset_estimates_on_a_default_layout(name):
    from megatron_flat.plan import default_layout

    model = preset(name)
    lay = default_layout(model, 64)
    r = estimate(model, lay, 1 << 17)
    assert all(v >= 0 for v in r.components().values())
    assert r.binding in ("dispatch", "vocab", "boundaries", "optimizer", "other")
    assert math.isfinite(r.total)
