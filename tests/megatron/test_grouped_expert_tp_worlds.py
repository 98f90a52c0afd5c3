"""The CPU grouped linears under expert tensor parallelism: ``TEGroupedMLP`` over them equals
``SequentialMLP`` bitwise in a whole model — loss, and every gradient after one backward —
given the same weights, at expert-TP 2 (dense TP 2 with sequence parallelism; with EP 2 on 4
ranks). Each rank holds the shard ``SequentialMLP``'s expert linears hold (fc1 ``[2F/etp,
H]``, fc2 ``[H, F/etp]``), and the token dispatcher does all the communication for both."""

import pytest
import torch

from tests._worlds import per_world
from tests.megatron._expert_models import build_model

LAYOUTS = {2: {"tp2-etp2": (2, 1, 2)}, 4: {"tp2-ep2-etp2": (2, 2, 2)}}


def _loss_and_grads(model, tiny) -> tuple:
    from megatron.core import parallel_state

    from megatron_flat.testing.tiny_gpt import dp_share, global_batch

    mb = dp_share(global_batch(tiny, 1), parallel_state.get_data_parallel_rank(),
                  parallel_state.get_data_parallel_world_size())[0]
    loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _expert_pairs(a, b):
    """(a's, b's) local expert weights of every layer, in SequentialMLP's layout."""
    from megatron_flat.megatron import compat

    for la, lb in zip(a.decoder.layers, b.decoder.layers):
        for wa, wb in zip(compat.local_expert_weights(la.mlp.experts),
                          compat.local_expert_weights(lb.mlp.experts)):
            yield from zip(wa, wb)


@pytest.mark.parametrize("world,name", per_world(LAYOUTS))
def test_te_grouped_equals_sequential_under_expert_tp(megatron_cpu, world, name):
    from megatron_flat.megatron import compat
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    layout = LAYOUTS[world][name]
    tiny = TinyMoE(num_experts=4)
    with megatron_layout(tp=layout[0], ep=layout[1], etp=layout[2]):
        sequential, _ = build_model(tiny, "sequential", layout, True, False)
        grouped, _ = build_model(tiny, "te-grouped", layout, True, False)
        pairs = list(_expert_pairs(sequential, grouped))
        assert pairs and all(s.shape == g.shape for s, g in pairs)
        with torch.no_grad():
            for s, g in pairs:
                g.copy_(s)
            mine = dict(grouped.named_parameters())
            for n, p in sequential.named_parameters():
                if n in mine:
                    mine[n].copy_(p)
        want_loss, want = _loss_and_grads(sequential, tiny)
        got_loss, got = _loss_and_grads(grouped, tiny)
        grad_pairs = [(f"expert {i}", s.grad, g.grad)
                      for i, (s, g) in enumerate(_expert_pairs(sequential, grouped))]
    assert torch.equal(want_loss, got_loss)
    shared = sorted(set(want) & set(got))
    assert len(shared) == len(want) - len(pairs)  # every parameter but the experts' matched
    assert [n for n in shared if not torch.equal(want[n], got[n])] == []
    assert [n for n, s, g in grad_pairs if not torch.equal(s, g)] == []
    assert compat.local_expert_weights(grouped.decoder.layers[0].mlp.experts)[0][0].shape[0] \
        == 2 * tiny.moe_ffn_hidden_size // layout[2]  # fc1 [2F / etp, H]: a shard
