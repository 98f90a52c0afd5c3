"""The pieces of ``megatron_flat.release`` on one process: a gradient accumulator's hooks go,
OffloadStreamAdamW and ParamOffload give back their host memory and refuse to be used again,
a method cache keyed on modules is emptied. (Whole models: test_release_world2.py.)"""

import functools
import gc
import weakref

import pytest
import torch

from megatron_flat.megatron.release import clear_node_hooks, release
from megatron_flat.optim.offload_adamw import OffloadStreamAdamW
from megatron_flat.params import ParamOffload, ParamOffloadError
from megatron_flat.runtime import host_tier as host_tiers
from megatron_flat.testing.expert_stack import make_weights


def test_an_accumulators_hooks_are_removed():
    param = torch.nn.Parameter(torch.ones(3))
    node = param.expand_as(param).grad_fn.next_functions[0][0]
    calls = []
    node.register_hook(lambda *args: calls.append("a"))
    node.register_hook(lambda *args: calls.append("b"))
    (param * 2).sum().backward()
    assert calls == ["a", "b"]
    clear_node_hooks(node)
    (param * 2).sum().backward()
    assert calls == ["a", "b"]  # neither ran, nor the no-op used to reach them


class _Holder:
    """A hook closure holding its owner, as Megatron's DDP's does, and the owner holding an
    autograd graph that reaches the accumulator, as Megatron's MoE dispatcher holds its
    routing probabilities."""

    def __init__(self, param):
        self.param = param
        node = param.expand_as(param).grad_fn.next_functions[0][0]
        node.register_hook(lambda *args: self)
        self.kept = param * 2  # its graph: MulBackward -> the accumulator
        self.nodes = [node]


def test_a_cycle_through_an_accumulator_is_cut():
    holder = _Holder(torch.nn.Parameter(torch.ones(2)))
    ref = weakref.ref(holder)
    del holder
    gc.collect()
    assert ref() is not None  # the cycle runs through C++: the collector cannot see it
    clear_node_hooks(ref().nodes.pop())
    gc.collect()
    assert ref() is None


def test_offload_stream_adamw_closes():
    params = [torch.nn.Parameter(torch.randn(300)) for _ in range(2)]
    opt = OffloadStreamAdamW(params, bucket_numel=128)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.host_bytes > 0 and opt.state
    opt.close()
    opt.close()  # idempotent
    assert not opt.state
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_param_offload_closes_and_gives_back_its_tier():
    tier = host_tiers.HostTier()
    offload = ParamOffload(make_weights(3), tier=tier)
    host = weakref.ref(offload._host.untyped_storage())
    offload.close()
    offload.close()
    gc.collect()
    assert host() is None  # the tier's buffer is freed
    with pytest.raises(ParamOffloadError, match="closed"):
        offload.acquire(0)


class _Cached(torch.nn.Module):
    @functools.lru_cache(maxsize=4)
    def table(self, n):
        return torch.zeros(n)


def test_method_caches_keyed_on_modules_are_emptied():
    module = _Cached()
    module.table(3)
    ref = weakref.ref(module)
    release(module)
    del module
    gc.collect()
    assert ref() is None
