"""CostLedger on collectives at world size 2: bytes this rank puts on its links, calls."""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.runtime.ledger import CostLedger

pytestmark = pytest.mark.world(2)


def test_all_to_all_known_splits(dist_world) -> None:
    rank = dist.get_rank()
    # rank 0 sends 2 rows to itself and 3 to rank 1; rank 1 sends 1 to rank 0 and 4 to itself
    send = [[2, 3], [1, 4]][rank]
    recv = [[2, 1], [3, 4]][rank]
    x = torch.randn(sum(send), 6)
    out = torch.empty(sum(recv), 6)
    with CostLedger() as ledger:
        dist.all_to_all_single(out, x, recv, send)
    row = 6 * 4
    assert ledger.collective_bytes == {"all_to_all_single": [3, 1][rank] * row}
    assert ledger.collective_calls == {"all_to_all_single": 1}
    assert ledger.all_to_all_bytes == [3, 1][rank] * row
    assert ledger.other_collective_bytes == 0
    assert ledger.syncs == 0


def test_other_collectives_ring_bytes(dist_world) -> None:
    rank = dist.get_rank()
    x = torch.randn(8)  # 32 bytes
    with CostLedger() as ledger:
        with ledger.section("gather"):
            dist.all_gather_into_tensor(torch.empty(16), x)
        dist.reduce_scatter_tensor(torch.empty(4), x)
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        peer = 1 - rank
        work = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(8), peer)]
        )
        for w in work:
            w.wait()
    assert ledger.collective_bytes == {
        "all_gather_into_tensor": 32,
        "reduce_scatter_tensor": 16,
        "all_reduce": 32,
        "broadcast": 32,
        "send": 32,
        "recv": 0,
    }
    assert all(n == 1 for n in ledger.collective_calls.values())
    assert ledger.sections["gather"].collective_bytes == {"all_gather_into_tensor": 32}
    assert ledger.all_to_all_bytes == 0


def test_collective_output_is_device_data(dist_world) -> None:
    counts = torch.tensor([1, 2])
    counts.add_(torch.zeros(2, dtype=torch.long))  # pre-existing zeros: device data
    with CostLedger() as ledger:
        host = torch.tensor([5, 6])
        host.tolist()  # host plan: no sync
        got = torch.empty(2, dtype=torch.long)
        dist.all_to_all_single(got, counts)
        got.tolist()  # device data received: a sync
    assert ledger.syncs == 1
