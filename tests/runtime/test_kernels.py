"""The ledger's kernel profile: what a GPU would launch, by class and size."""

import torch

from megatron_flat.runtime import kernels
from megatron_flat.runtime.ledger import CostLedger


def test_a_matmul_is_a_gemm_keyed_by_its_output_tiles() -> None:
    a, b = torch.randn(300, 64), torch.randn(64, 200)
    with CostLedger() as ledger:
        a.bfloat16() @ b.bfloat16()
        a @ b
    # 300 x 200 output: 3 x 2 tiles of 128 x 128; an fp32 result runs without tensor cores
    flops = 2 * 300 * 64 * 200
    nbytes = 300 * 64 + 64 * 200 + 300 * 200
    assert ledger.totals.kernels["gemm:6"] == [1, flops, 2 * nbytes]
    assert ledger.totals.kernels["gemm32:6"] == [1, flops, 4 * nbytes]
    assert ledger.totals.host_ops == 0


def test_an_accumulate_by_index_is_atomic_per_source_element() -> None:
    dest = torch.zeros(1000, 8, dtype=torch.bfloat16)
    src = torch.ones(10, 8, dtype=torch.bfloat16)
    idx = torch.arange(10)
    with CostLedger() as ledger:
        dest.index_add_(0, idx, src)
        torch.zeros(1000, 8).index_add(0, idx, src.float())
    k = ledger.totals.kernels
    # in place: the rows it touches (source read, rows written), not the whole destination
    assert k["atomic16"] == [1, 80, 2 * 80 * 2]
    # out of place: the copy of self it starts from as well
    assert k["atomic32"] == [1, 80, 2 * 80 * 4 + 2 * 8000 * 4]


def test_index_put_is_atomic_only_when_it_accumulates() -> None:
    dest, src, idx = torch.zeros(100), torch.ones(10), torch.arange(10)
    assert kernels.atomic_elements(torch.ops.aten.index_put_.default, (dest, [idx], src, True),
                                   {}) == 10
    assert kernels.atomic_elements(torch.ops.aten.index_put_.default, (dest, [idx], src, False),
                                   {}) == 0
    assert kernels.atomic_elements(torch.ops.aten.add.Tensor, (dest, dest), {}) == 0


def test_an_in_place_foreach_update_counts_what_it_writes() -> None:
    xs = [torch.zeros(1024) for _ in range(3)]
    with CostLedger() as ledger:
        torch._foreach_add_(xs, 1.0)
    # read 3 x 4 KiB and write them back: nothing is returned, the writes still count
    assert ledger.totals.mem_bytes == 2 * 3 * 4096
    assert ledger.totals.kernels == {"mem:14": [1, 0, 2 * 3 * 4096]}


def test_host_data_launches_no_kernel() -> None:
    with CostLedger() as ledger:
        torch.tensor([1, 2, 3]).cumsum(0)  # Python data: host data on a GPU too
        torch.zeros(4) + 1  # a factory's buffer: device data
    assert ledger.totals.host_ops == 1
    assert sum(row[0] for row in ledger.totals.kernels.values()) == ledger.totals.ops - 1
    assert ledger.as_dict()["host_ops"] == 1


def test_stream_calls_are_counted_as_a_gpu_makes_them() -> None:
    """Events, waits, stream switches and record_stream are host calls into the CUDA
    runtime that launch nothing; the ledger counts them on CPU as a GPU run makes them."""
    from megatron_flat.runtime.streams import Stream, copy, current_stream, record_stream
    from megatron_flat.runtime.streams import use_stream

    side = Stream(torch.device("cpu"))
    src = torch.zeros(8) + 1  # device data
    dst = torch.empty(8)
    with CostLedger() as ledger:
        side.wait_stream(current_stream("cpu"))  # an event recorded, then waited on
        with use_stream(side):  # switched to, and back
            copy(dst, src)
        event = side.record_event()
        event.wait()
        event.query()
        record_stream(src, side)
        with use_stream(current_stream("cpu")):  # the current stream: no switch
            pass
    assert dict(ledger.totals.stream_calls) == {
        "event_record": 2, "event_wait": 2, "set_stream": 2, "event_query": 1,
        "record_stream": 1}
    assert ledger.as_dict()["stream_calls"]["event_record"] == 2
