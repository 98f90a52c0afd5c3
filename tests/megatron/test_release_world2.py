"""``megatron_flat.release``: a released model is freed, stock or flat (2 ranks).

Five rounds of build (model, DDP, optimizer), one training step and release in one process,
for stock Megatron, each technique alone and all of them on (param offload included): after
each round's ``gc.collect()`` weakrefs to the model, the DDP and the optimizer are dead, and
the memory meter's device bytes (live CPU storages) and host bytes (host pools and the host
tier) never end above where they started and every round ends where the first did, exactly
(after a first round outside the meter, which makes the process's one-time caches). Without ``release`` stock Megatron keeps
every model (DDP's gradient-accumulator hooks close a cycle through C++ autograd nodes), and
a flat model that frees itself still leaves its rotary table in Megatron's cache: the
control cases show both, so the check can fail.
"""

import gc
import weakref

import pytest

from megatron_flat.config import FlatConfig
from megatron_flat.runtime.memory import MemoryMeter
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer

pytestmark = pytest.mark.world(2)

DISPATCH = dict(dispatch="pipelined", dispatch_chunk_tokens=8)
OPTIMIZER = dict(optimizer_offload=True, optimizer_bucket_numel=4096)
SCO = dict(sco=True, sco_host_budget_gib=1 / 64)
CASES = {
    "stock": (None, dict(ep=2)),
    "pipelined-llep": (FlatConfig(**DISPATCH), dict(ep=2)),
    "ring-dtp": (FlatConfig(vocab=True, vocab_block_size=32), dict(ep=2)),
    "sco": (FlatConfig(**SCO), dict(ep=2)),
    "attn-replay": (FlatConfig(**SCO, attn_replay=True), dict(ep=2)),
    "offload-stream-adamw": (FlatConfig(**OPTIMIZER), dict(ep=2)),
    "param-offload": (FlatConfig(**DISPATCH, **OPTIMIZER, param_offload=True), dict(ep=2)),
    "attn-tiles": (FlatConfig(attn_tiles=4), dict(tp=2)),
    "all": (FlatConfig(**DISPATCH, **OPTIMIZER, **SCO, param_offload=True, vocab=True,
                       vocab_block_size=32, attn_replay=True), dict(ep=2)),
}
ROUNDS = 5


def _round(tiny, flat, split, release: bool) -> list:
    """Build, train one step, (release,) drop; weakrefs to the model, DDP and optimizer."""
    with megatron_layout(**split):
        trainer = Trainer(tiny, Layout(recompute="full", **split), flat=flat)
        trainer.forward_backward(0)
        trainer.optimizer_step()
        refs = [weakref.ref(trainer.model), weakref.ref(trainer.ddp),
                weakref.ref(trainer.optimizer)]
        if release:
            trainer.release()
        del trainer
    gc.collect()
    return refs


def _tiny(flat):
    replay = flat is not None and flat.attn_replay  # needs a kernel that keeps its output
    return TinyMoE(num_experts=4, topk=2, num_layers=2, micro_batch_size=1,
                   global_batch_size=2, attention="flash" if replay else "local")


@pytest.mark.parametrize("name", list(CASES))
def test_released_models_are_freed_with_no_growth(megatron_cpu, name):
    flat, split = CASES[name]
    tiny = _tiny(flat)
    _round(tiny, flat, split, release=True)  # the process's one-time caches
    alive, device, host = [], [], []
    with MemoryMeter("cpu") as meter:
        for _ in range(ROUNDS):
            refs = _round(tiny, flat, split, release=True)
            alive.append([ref() is not None for ref in refs])
            device.append(meter.current_device_bytes())
            host.append(meter.current_host_bytes())
    assert alive == [[False] * 3] * ROUNDS
    # Nothing left above the start, and no growth: every round ends where the first did
    # (below the start where the first metered round frees what the warm-up's layout left).
    assert device[0] <= 0 and device == [device[0]] * ROUNDS
    assert host == [0] * ROUNDS


@pytest.mark.parametrize("name", ["stock", "param-offload"])
def test_without_release_models_stay(megatron_cpu, name):
    """The controls: stock's models stay alive; a flat model that frees itself leaves its
    rotary table cached (both grow round by round)."""
    flat, split = CASES[name]
    tiny = _tiny(flat)
    _round(tiny, flat, split, release=True)
    alive, device = [], []
    with MemoryMeter("cpu") as meter:
        for _ in range(2):
            refs = _round(tiny, flat, split, release=False)
            alive.append(refs[0]() is not None)
            device.append(meter.current_device_bytes())
    if name == "stock":
        assert alive == [True, True]
    assert device[0] < device[1]  # the second round left more than the first
    # what the next release frees again (the file's teardown releases every DDP left)
    gc.collect()
