"""SCO inside Megatron-Core's full and module recompute at 2 ranks: bitwise equal to plain
recompute.

EP=2 (MoE alltoall), TP=2 with sequence parallelism, PP=2 with the 1F1B schedule (several
microbatches' boundaries alive at once); 4 layers, dropout on. Each layout trains one step
from the same initial weights and RNG states with SCO off (Megatron's own reentrant
checkpoint) and on; the step loss and every gathered gradient must be ``torch.equal``.
"""

import pytest
import torch

pytestmark = pytest.mark.world(2)

BOUNDARY = 16 * 2 * 64 * 4  # full [s, b, h] fp32 boundary; SP/TP shards are smaller
UNLIMITED = 64 * BOUNDARY
# name -> (Layout kwargs, recompute_num_layers, host budget bytes)
LAYOUTS = {
    "ep2-uniform-unlimited": (dict(ep=2, recompute="full"), 1, UNLIMITED),
    "tp2-sp-block-partial": (dict(tp=2, recompute="full", recompute_method="block"), 3,
                             BOUNDARY // 2),
    # 1F1B: the first stage holds 2 microbatches x 2 layers of boundaries, the last one 2.
    "pp2-1f1b-uniform-partial": (dict(pp=2, recompute="full"), 1, BOUNDARY),
    # Module recompute, two boundaries per layer (attention's q, k, v; the MoE input).
    "ep2-selective-attn-moe-unlimited": (
        dict(ep=2, recompute="selective", recompute_modules=("core_attn", "moe")), 1, UNLIMITED),
    "tp2-sp-selective-attn-moe-partial": (
        dict(tp=2, recompute="selective", recompute_modules=("core_attn", "moe")), 1,
        4 * BOUNDARY),
    "pp2-1f1b-selective-moe-unlimited": (
        dict(pp=2, recompute="selective", recompute_modules=("moe",)), 1, UNLIMITED),
}


@pytest.fixture(scope="module")
def tiny():
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE(num_layers=4, hidden_dropout=0.1, attention_dropout=0.1)


def _one_step(tiny, layout, overrides, initial):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flat.testing.equivalence import full_tensors, load_full
    from megatron_flat.testing.training import Trainer

    trainer = Trainer(tiny, layout, config_overrides=overrides,
                      init=None if initial is None else (lambda m: load_full([m], initial)))
    if initial is None:
        initial = full_tensors([trainer.ddp])
    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(tiny.seed)
    loss = trainer.forward_backward(0)
    return loss, full_tensors([trainer.ddp], grads=True), initial


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sco_matches_full_recompute(name, tiny, megatron_cpu):
    from megatron_flat.megatron import sco
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.training import Layout

    kwargs, num_layers, budget = LAYOUTS[name]
    layout = Layout(**kwargs)
    overrides = dict(recompute_num_layers=num_layers)
    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed):
        ref_loss, ref_grads, initial = _one_step(tiny, layout, overrides, None)
        engine = sco.enable(budget, prefetch=1)
        try:
            loss, grads, _ = _one_step(tiny, layout, overrides, initial)
        finally:
            sco.disable()
    assert loss == ref_loss, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    bad = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
    assert not bad, bad

    stats = engine.stats
    assert stats.checkpoints > 0 and stats.plain_fallbacks == 0
    assert stats.boundaries_offloaded > 0
    if budget == UNLIMITED:
        assert stats.boundaries_kept == 0
    else:
        assert stats.boundaries_kept > 0
    assert stats.host_bytes_in_use == 0
