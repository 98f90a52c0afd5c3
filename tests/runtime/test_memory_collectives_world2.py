"""The CPU memory meter around collectives: figures that do not depend on load.

A gloo worker thread keeps a collective's tensors until it drops the finished work; a
tensor the caller has let go of meanwhile dies whenever the worker gets the CPU, so an
allocation right after could see it still live. The meter runs collectives on shadows of
their tensors (the same memory through a storage that does not own it) and lets go of
the tensors themselves at the first op after the collective completed (runtime.memory
``_Collectives``). Here each round allocates a tensor, runs a collective on it, drops
it and allocates the next: the peak is one round's bytes, every time, while two other
processes load the cores (without the settling it was two rounds' in many of 200
rounds)."""

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from megatron_flat.runtime.memory import MemoryMeter

pytestmark = pytest.mark.world(2)

N = 4096  # fp32 elements per rank


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _rounds(collective, rounds: int = 200) -> int:
    with MemoryMeter("cpu") as meter:
        for _ in range(rounds):
            a = torch.ones(2 * N)
            collective(a)
            del a
    return meter.peak_device_bytes


COLLECTIVES = {
    "all_reduce": lambda a: dist.all_reduce(a),
    "all_gather_into_tensor": lambda a: dist.all_gather_into_tensor(a, a[:N].clone()),
    "all_to_all_single": lambda a: dist.all_to_all_single(a, a.clone()),
    "broadcast": lambda a: dist.broadcast(a, 0),
    "async all_reduce": lambda a: dist.all_reduce(a, async_op=True).wait(),
}


@pytest.fixture(scope="module")
def load():
    """Two busy processes: the worker threads compete for the cores."""
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_spin, args=(120,), daemon=True) for _ in range(2)]
    for hog in hogs:
        hog.start()
    yield
    for hog in hogs:
        hog.terminate()


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_peak_is_one_round_under_load(dist_world, load, name):
    one_round = 2 * N * 4
    extra = {"all_gather_into_tensor": N * 4, "all_to_all_single": 2 * N * 4}[name] \
        if name in ("all_gather_into_tensor", "all_to_all_single") else 0
    assert _rounds(COLLECTIVES[name]) == one_round + extra


def test_the_data_is_the_collectives(dist_world):
    """Aliases change nothing of what arrives (in place, into views, split sizes)."""
    rank = dist.get_rank()
    with MemoryMeter("cpu"):
        a = torch.full((4,), float(rank + 1))
        dist.all_reduce(a)
        out = torch.zeros(8)
        dist.all_gather_into_tensor(out, out[4 * rank:4 * rank + 4].fill_(rank + 1))
        got = torch.empty(4)
        splits = [1, 3] if rank == 0 else [3, 1]
        dist.all_to_all_single(got, torch.arange(4.0) + 10 * rank, splits, splits)
        # point to point, the send buffer dropped before the wait (the work keeps it)
        recv = torch.empty(3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), rank + 5.0),
                                                   1 - rank),
                                        dist.P2POp(dist.irecv, recv, 1 - rank)])
        for work in works:
            work.wait()
    assert torch.equal(a, torch.full((4,), 3.0))
    assert torch.equal(out, torch.tensor([1.0] * 4 + [2.0] * 4))
    want = {0: [0.0, 10.0, 11.0, 12.0], 1: [1.0, 2.0, 3.0, 13.0]}[rank]
    assert got.tolist() == want
    assert recv.tolist() == [6.0 - rank] * 3
