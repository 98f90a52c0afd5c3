"""The deferred-exchange model (runtime.deferred): with delayed copies, a hop, a relay and an
all-to-all in flight run at their wait. Before it their receive buffers are poison, a write
into a send buffer is what arrives, and outside the mode nothing is deferred."""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.dispatch.exchange import all_to_all
from megatron_flat.runtime.deferred import defer, deferred_count
from megatron_flat.runtime.streams import delayed_copies
from megatron_flat.vocab.ring import Ring

pytestmark = pytest.mark.world(2)


def test_a_hop_runs_at_its_wait(dist_world):
    ring = Ring(dist.group.WORLD, torch.device("cpu"))
    rank, p = dist.get_rank(), dist.get_world_size()
    send = torch.full((3,), float(rank))
    recv = torch.empty(3)
    with delayed_copies():
        before = deferred_count()
        hop = ring.shift([send], [recv])
        assert deferred_count() == before + 1
        assert torch.isnan(recv).all()  # read before the wait: poison
        send.add_(10)  # written before the wait: this is what the next rank receives
        (got,) = hop.wait()
    assert got is recv and torch.equal(recv, torch.full((3,), (rank - 1) % p + 10.0))


def test_a_relay_sends_what_its_buffer_holds_at_the_wait(dist_world):
    ring = Ring(dist.group.WORLD, torch.device("cpu"))
    rank, p = dist.get_rank(), dist.get_world_size()
    buffer = torch.full((5, 2), float(rank))
    with delayed_copies():
        hop = ring.relay(buffer, 5, 5, 2)
        assert torch.equal(buffer, torch.full((5, 2), float(rank)))  # nothing moved yet
        buffer.add_(100)
        (got,) = hop.wait()
    assert torch.equal(got, torch.full((5, 2), (rank - 1) % p + 100.0))


def test_an_all_to_all_in_flight_runs_at_its_wait(dist_world):
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.arange(p * 2, dtype=torch.float32) + 100 * rank
    with delayed_copies():
        pending = all_to_all([x], [2] * p, [2] * p, dist.group.WORLD, p, async_op=True)
        assert torch.isnan(pending.outputs[0]).all()
        (got,) = pending.wait()
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r
                      for r in range(p)])
    assert torch.equal(got, want)
    # A blocking all-to-all is never deferred.
    with delayed_copies():
        (now,) = all_to_all([x], [2] * p, [2] * p, dist.group.WORLD, p).outputs
        assert torch.equal(now, want)


def test_nothing_is_deferred_outside_the_mode(dist_world):
    ring = Ring(dist.group.WORLD, torch.device("cpu"))
    assert defer(lambda: None, [torch.empty(1)]) is None
    recv = torch.empty(2)
    before = deferred_count()
    hop = ring.shift([torch.ones(2)], [recv])
    hop.wait()
    assert deferred_count() == before and torch.equal(recv, torch.ones(2))
