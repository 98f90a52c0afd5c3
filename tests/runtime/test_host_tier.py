"""The host tier: lazy, exact, checked against the node, no silent pageable fallback."""

import gc
import threading

import pytest
import torch

from megatron_flat.runtime import host_tier
from megatron_flat.runtime.host_tier import GIB, HostTier, HostTierError

MIB = 1 << 20


class FakeCudart:
    """``torch.cuda.cudart()`` as a GPU node would answer, recording the calls."""

    def __init__(self, status=0):
        self.status = status
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes, flags))
        return self.status

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def gpu_node(monkeypatch):
    """torch.cuda present (no device is touched: only cudart's host registration)."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_lazy_pool_allocates_nothing_until_first_acquire():
    tier = HostTier(node_budget_bytes=GIB, local_ranks=1)
    pool = tier.lazy_pool("sco", 3 * MIB + 7)
    assert not pool.allocated and tier.allocated_bytes == {}
    assert pool.capacity_bytes == 3 * MIB + 7 and pool.stats()["used_bytes"] == 0
    block = pool.acquire((1000,), torch.uint8)
    assert pool.allocated and tier.allocated_bytes == {"sco": 3 * MIB + 7}  # exact
    pool.release(block)
    assert pool.stats()["used_bytes"] == 0


def test_pin_exact_registers_exactly_the_requested_bytes(gpu_node):
    nbytes = 85 * MIB + 3  # the caching host allocator would round this to 128 MiB
    buffer = host_tier.pin_exact(nbytes)
    assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
    ptr = buffer.data_ptr()
    assert gpu_node.registered == [(ptr, nbytes, 0)]
    del buffer
    gc.collect()
    assert gpu_node.unregistered == [ptr]  # page-locking ends with the memory


def test_tier_counts_pinned_bytes_by_technique(gpu_node):
    tier = HostTier(node_budget_bytes=GIB, local_ranks=2)
    pool = tier.pool("optimizer", 5 * MIB)
    assert tier.allocated_bytes == {"optimizer": 5 * MIB} and tier.pinned_bytes == 5 * MIB
    assert pool.capacity_bytes == 5 * MIB
    second = tier.pool("optimizer", 1 * MIB)  # a second sub-optimizer: same technique, summed
    assert tier.allocated_bytes == {"optimizer": 6 * MIB}
    assert second.capacity_bytes == MIB


def test_node_check_before_anything_is_allocated():
    tier = HostTier(node_budget_bytes=GIB, local_ranks=4)
    tier.declare("sco", 200 * MIB)  # 4 x 200 MiB fits 1 GiB
    with pytest.raises(HostTierError) as err:
        tier.declare("sco", 300 * MIB)
    text = str(err.value)
    assert "4 rank(s) per node" in text and "sco 0.29 GiB" in text
    assert "--flat-host-mem-per-node-gib" in text
    assert tier._declared == {"sco": 200 * MIB}  # the refused budget was not recorded
    tier.declare("sco", 200 * MIB)
    with pytest.raises(HostTierError, match="optimizer 0.10 GiB, sco 0.20 GiB"):
        tier.pool("optimizer", 100 * MIB)  # 4 x 300 MiB: the declared SCO budget counts
    assert tier.allocated_bytes == {}


def test_ranks_per_node_from_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_tier.ranks_per_node() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert host_tier.ranks_per_node() == 1
    assert host_tier.node_memory_bytes() > 0


def test_failed_pinning_raises(gpu_node):
    gpu_node.status = 2  # cudaErrorMemoryAllocation
    tier = HostTier(node_budget_bytes=GIB, local_ranks=1)
    with pytest.raises(HostTierError, match="pinning 1,048,576 bytes of host memory failed"):
        tier.pool("sco", MIB)
    assert tier.allocated_bytes == {}


def test_pageable_fallback_only_when_allowed(gpu_node):
    gpu_node.status = 2
    tier = HostTier(node_budget_bytes=GIB, local_ranks=1, allow_pageable=True)
    with pytest.warns(RuntimeWarning, match="--flat-host-pageable"):
        pool = tier.pool("sco", MIB)
    assert not pool.pinned and tier.pinned_bytes == 0 and tier.allocated_bytes == {"sco": MIB}


def test_tier_buffers_are_host_bytes_for_an_open_meter():
    from megatron_flat.runtime import MemoryMeter

    tier = HostTier(node_budget_bytes=GIB, local_ranks=1)
    with MemoryMeter("cpu") as meter:
        pool = tier.pool("sco", 4 * MIB)
        block = pool.acquire((MIB,), torch.uint8)
        assert meter.current_host_bytes() == MIB
    assert meter.peak_device_bytes < 64 * 1024  # the 4 MiB buffer never counted as device
    pool.release(block)


def test_a_dead_buffer_stops_counting(gpu_node):
    """Re-planning drops a pool and takes a new one: the node check must not count both."""
    tier = HostTier(node_budget_bytes=10 * MIB, local_ranks=1)
    pool = tier.pool("optimizer", 6 * MIB)
    assert tier.allocated_bytes == {"optimizer": 6 * MIB} and tier.pinned_bytes == 6 * MIB
    del pool
    gc.collect()
    assert tier.allocated_bytes == {} and tier.pinned_bytes == 0
    again = tier.pool("optimizer", 6 * MIB)  # 12 MiB ever allocated, 6 MiB held: fits 10
    assert tier.allocated_bytes == {"optimizer": 6 * MIB} and again.capacity_bytes == 6 * MIB


def test_report_what_the_rank_and_the_node_hold(gpu_node):
    tier = HostTier(node_budget_bytes=GIB, local_ranks=8)
    sco = tier.pool("sco", 85 * MIB + 3)
    opt = tier.pool("optimizer", 5 * MIB)
    report = tier.report()
    assert report["allocated_bytes"] == {"sco": 85 * MIB + 3, "optimizer": 5 * MIB}
    assert report["allocated_total_bytes"] == report["pinned_bytes"] == 90 * MIB + 3
    assert report["buffers"] == 2 and report["ranks_per_node"] == 8
    assert report["per_node_bytes"] == 8 * (90 * MIB + 3)
    assert report["node_budget_bytes"] == GIB
    # pin_memory=True would round each buffer up to a power of two: 128 MiB + 8 MiB.
    assert report["caching_allocator_bytes"] == 136 * MIB
    del sco
    gc.collect()
    assert tier.report()["buffers"] == 1 and tier.report()["caching_allocator_bytes"] == 8 * MIB
    del opt


def test_caching_allocator_rounding_rule():
    from megatron_flat.runtime.host_tier import caching_allocator_bytes

    assert [caching_allocator_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096,
                                                                            8192]
    assert caching_allocator_bytes(85 * MIB + 3) == 128 * MIB


def test_a_buffer_freed_by_the_collector_during_an_allocation_does_not_deadlock(monkeypatch):
    """A buffer left in a reference cycle is freed whenever Python's collector runs, which
    can be inside the tier's next allocation, in the same thread, while the tier's lock is
    held; its finalizer takes that lock too."""
    tier = HostTier()

    class Cycle:
        pass

    holder = Cycle()
    holder.me = holder  # freed only by the collector
    holder.buffer = tier.buffer("sco", 1024)
    del holder
    node_memory = host_tier.node_memory_bytes

    def collecting_node_memory():  # the collector runs inside the locked check
        gc.collect()
        return node_memory()

    monkeypatch.setattr(host_tier, "node_memory_bytes", collecting_node_memory)
    result = {}
    worker = threading.Thread(target=lambda: result.update(b=tier.buffer("sco", 2048)),
                              daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the tier deadlocked on its own lock"
    assert tier.allocated_bytes == {"sco": 2048}  # the freed one stopped counting
