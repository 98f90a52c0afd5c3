"""The demo's "model state" row at 2 ranks (examples/train_tiny_moe.py): what the trainer
holds between steps, measured by the memory meter, stock and flat, with and without param
offload."""

import argparse
import dataclasses
import importlib.util
import pathlib

import pytest
import torch.distributed as dist

from megatron_flat.testing.training import MODEL_STATE

pytestmark = pytest.mark.world(2)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location(
        "train_tiny_moe", ROOT / "examples" / "train_tiny_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_table_model_state(megatron_cpu):
    demo = _demo()
    tiny = demo.DEMO_MODEL.with_(num_layers=4, hidden_size=64, ffn_hidden_size=128,
                                 moe_ffn_hidden_size=64, vocab_size=2048, seq_length=128)
    args = argparse.Namespace(steps=2, lr=1e-3, timeline="", cp=1, tp=1)
    flat = dataclasses.replace(demo.DEMO_FLAT, dispatch_chunk_tokens=32,
                               optimizer_bucket_numel=4096, vocab_block_size=512)
    assert flat.param_offload  # the demo runs every technique
    rank = dist.get_rank()
    runs = {}
    base, losses, initial = demo.run(tiny, None, args, rank, "stock", quiet=True,
                                     model_state=True)
    runs["stock"] = base
    resident = dataclasses.replace(flat, param_offload=False)
    for name, cfg in (("resident", resident), ("flat", flat), ("resident again", resident)):
        runs[name], flat_losses, _ = demo.run(tiny, cfg, args, rank, name, init=initial,
                                              quiet=True, model_state=True)
        assert flat_losses == pytest.approx(losses, rel=1e-6)
    device = {k: r.device[MODEL_STATE] for k, r in runs.items()}
    host = {k: r.host[MODEL_STATE] for k, r in runs.items()}
    # What the trainer holds is counted from the trainer, not from what the process holds:
    # the same run measures the same before and after another.
    assert device["resident"] == device["resident again"] > 0
    assert host["resident"] == host["resident again"] > 0  # OffloadStreamAdamW's state
    assert host["stock"] == 0 and device["flat"] < device["resident"] < device["stock"]
    # Param offload moves every MoE layer's expert weights and fp32 gradients (the host
    # tier's growth) and keeps two layers' slots of them on the device: with 4 equal MoE
    # layers the device drops by half of what the host gains (a few bytes of the offload's
    # own scalars aside).
    tier = host["flat"] - host["resident"]
    layers = tiny.num_layers
    assert tier > 0
    assert abs((device["resident"] - device["flat"]) - tier * (layers - 2) // layers) <= 64, (
        device, host)
