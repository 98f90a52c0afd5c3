"""CostLedger: exact counts for known programs, zero for a block that does none of them."""

import pytest
import torch

from megatron_flat.runtime import HostPool
from megatron_flat.runtime.ledger import (
    CostLedger,
    is_device_data,
    mark_host,
    mark_host_memory,
    record_flops,
)


def test_matmul_flops_exact() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with CostLedger() as ledger:
        a @ b
    assert ledger.flops == 2 * 3 * 4 * 5
    assert ledger.ops == 1
    assert ledger.syncs == 0


def test_linear_forward_backward_flops_and_sections() -> None:
    layer = torch.nn.Linear(4, 6)
    x = torch.randn(2, 3, 4, requires_grad=True)
    with CostLedger() as ledger:
        with ledger.section("forward"):
            y = layer(x)
        with ledger.section("backward"):
            y.sum().backward()
    m, k, n = 6, 4, 6  # 2x3 rows, in 4, out 6
    assert ledger.sections["forward"].flops == 2 * m * k * n
    # backward: dX = dY W (m x n x k) and dW = dY^T X (n x m x k)
    assert ledger.sections["backward"].flops == 2 * (2 * m * k * n)
    assert ledger.flops == 3 * 2 * m * k * n
    assert ledger.sections["forward"].entries == 1


def test_bmm_baddbmm_addmm_mv_flops() -> None:
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    c = torch.randn(2, 3, 5)
    m, v = torch.randn(6, 7), torch.randn(7)
    with CostLedger() as ledger:
        torch.bmm(a, b)
        torch.baddbmm(c, a, b)
        torch.addmm(torch.randn(6), m[:, :6], torch.randn(6, 6))
        torch.mv(m, v)
    bmm = 2 * 2 * 3 * 4 * 5
    assert ledger.flops == 2 * bmm + 2 * 6 * 6 * 6 + 2 * 6 * 7


def test_section_entered_twice_adds_up() -> None:
    a = torch.randn(2, 2)
    with CostLedger() as ledger:
        for _ in range(3):
            with ledger.section("mm"):
                a @ a
    assert ledger.sections["mm"].flops == 3 * 16
    assert ledger.sections["mm"].entries == 3
    assert ledger.flops == 3 * 16


def test_record_flops_for_unseen_kernels() -> None:
    with CostLedger() as outer:
        with CostLedger() as inner:
            with inner.section("gmm"):
                record_flops(1000)
    assert inner.flops == 1000 and inner.sections["gmm"].flops == 1000
    assert outer.flops == 1000


def test_nested_ledgers_both_count() -> None:
    a = torch.randn(2, 3)
    with CostLedger() as outer:
        a @ a.t()
        with CostLedger() as inner:
            a.tolist()
    assert inner.flops == 0 and inner.syncs == 1
    assert outer.flops == 2 * 2 * 3 * 2 and outer.syncs == 1


def test_device_tolist_is_one_sync() -> None:
    x = torch.randn(4)  # made before the block: an input, device data
    with CostLedger() as ledger:
        x.tolist()
    assert ledger.syncs == 1
    assert ledger.sync_kinds == {"tolist": 1}
    assert ledger.d2h_bytes == 16


def test_host_plan_tolist_counts_zero() -> None:
    with CostLedger() as ledger:
        counts = torch.tensor([3, 1, 4, 1])
        order = torch.argsort(counts, descending=True)
        plan = torch.cumsum(counts[order], 0)
        plan.tolist()
        int(plan[-1])
        torch.arange(4).repeat_interleave(counts)
        counts.nonzero()
    assert ledger.syncs == 0
    assert ledger.d2h_bytes == 0


def test_mark_host_makes_a_cached_plan_host_data() -> None:
    cached = torch.tensor([1, 2, 3])  # built outside any ledger: unknown, so device data
    assert is_device_data(cached)
    mark_host(cached)
    with CostLedger() as ledger:
        cached.tolist()
        cached.view(3, 1)[0].item()
    assert ledger.syncs == 0


def test_each_sync_kind_counts_once() -> None:
    x = torch.randn(8)
    counts = torch.tensor([1, 0, 2])
    counts_dev = counts + torch.zeros_like(x[:3], dtype=torch.long)  # device-derived
    with CostLedger() as ledger:
        x.sum().item()
        bool(x[0] > 0)
        int(counts_dev[0])
        float(x[1])
        x.nonzero()
        torch.where(x > 0)
        x[x > 0]
        torch.masked_select(x, x > 0)
        torch.unique(counts_dev)
        torch.bincount(counts_dev)
        torch.repeat_interleave(counts_dev)
        torch.arange(3).repeat_interleave(counts_dev)
        torch.arange(3).repeat_interleave(counts_dev, output_size=3)  # no sync
        x.numpy()
        torch.equal(x, x)
    assert ledger.sync_kinds == {
        "item": 4,
        "nonzero": 2,
        "mask_index": 1,
        "masked_select": 1,
        "unique2": 1,
        "bincount": 1,
        "repeat_interleave": 2,
        "numpy": 1,
        "equal": 1,
    }
    assert ledger.syncs == 14


def test_cpu_of_device_data_is_a_sync_and_its_result_is_host() -> None:
    x = torch.randn(5)
    with CostLedger() as ledger:
        host = x.cpu()
        host.tolist()  # already on the host: no second sync
        host.sum().item()
    assert ledger.sync_kinds == {"cpu": 1}
    assert ledger.d2h_bytes == 20
    assert torch.equal(host, x) and host.data_ptr() != x.data_ptr()
    # outside a ledger .cpu() is torch's again
    assert x.cpu().data_ptr() == x.data_ptr()


def test_device_data_written_into_a_host_factory_buffer() -> None:
    x = torch.randn(4)
    with CostLedger() as ledger:
        buf = torch.zeros(4)
        buf.tolist()  # host data so far
        buf.add_(x)  # now holds device data
        buf.tolist()
    assert ledger.syncs == 1


def test_pool_copies_count_as_host_device_bytes() -> None:
    pool = HostPool(4096)
    host = pool.acquire((16,), torch.float32)
    x = torch.randn(16)
    with CostLedger() as ledger:
        host.copy_(x, non_blocking=True)  # device -> host
        back = torch.empty(16)
        back.copy_(host, non_blocking=True)  # host -> device
        back.copy_(x)  # device -> device: not counted
    assert ledger.d2h_bytes == 64
    assert ledger.h2d_bytes == 64
    assert ledger.syncs == 0
    pool.release(host)


def test_marked_host_memory_copies_count_and_cpu_copies_are_not_syncs() -> None:
    host = torch.empty(8)
    mark_host_memory(host)
    x = torch.randn(8)
    with CostLedger() as ledger:
        host.copy_(x)  # blocking on CPU by design; on CUDA the flag decides
        x.copy_(host)
    assert ledger.d2h_bytes == 32 and ledger.h2d_bytes == 32
    assert ledger.syncs == 0


def test_inplace_matmuls_count() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    c = torch.zeros(3, 5)
    with CostLedger() as ledger:
        c.addmm_(a, b)
        torch.zeros(2, 3, 5).baddbmm_(a.expand(2, 3, 4), b.expand(2, 4, 5))
    assert ledger.flops == 2 * 3 * 4 * 5 * 3


def test_state_made_in_a_ledger_warm_up_keeps_its_origin() -> None:
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([w], foreach=False)
    w.grad = torch.randn(4, 4)
    with CostLedger():  # warm-up: AdamW makes its step counter from Python data
        opt.step()
    with CostLedger() as ledger:
        opt.step()
    assert ledger.syncs == 0  # the step counter's .item() reads host data
    opt2 = torch.optim.AdamW([w], foreach=False)
    opt2.step()  # made outside any ledger: unknown, so device data
    with CostLedger() as ledger:
        opt2.step()
    assert ledger.sync_kinds == {"item": 1}


def test_empty_block_and_quiet_block_count_zero() -> None:
    x = torch.randn(4)
    with CostLedger() as empty:
        pass
    with CostLedger() as quiet:
        y = [1, 2, 3]
        sum(y)
    for ledger in (empty, quiet):
        figures = ledger.as_dict()
        assert figures["flops"] == figures["syncs"] == figures["ops"] == 0
        assert figures["h2d_bytes"] == figures["d2h_bytes"] == 0
        assert figures["collective_bytes"] == {} and figures["sections"] == {}
    assert x.tolist()  # still a plain tolist afterwards


def test_views_are_not_ops() -> None:
    x = torch.randn(4, 4)
    with CostLedger() as ledger:
        x.view(2, 8).transpose(0, 1).unsqueeze(0)[0].t()
    assert ledger.ops == 0


def test_entered_once_and_section_needs_open_ledger() -> None:
    ledger = CostLedger()
    with pytest.raises(RuntimeError):
        with ledger.section("x"):
            pass
    with ledger:
        pass
    with pytest.raises(RuntimeError):
        ledger.__enter__()


def test_autograd_backward_is_counted() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    with CostLedger() as ledger:
        (x @ w).pow(2).sum().backward()
    # forward mm + backward dW mm (dX is not needed: x does not require grad)
    assert ledger.flops == 2 * (2 * 2 * 3 * 3)


def test_pool_made_inside_a_ledger_is_host_memory() -> None:
    x = torch.randn(16)
    with CostLedger():
        pool = HostPool(4096)
    host = pool.acquire((16,), torch.float32)
    with CostLedger() as ledger:
        host.copy_(x, non_blocking=True)
    assert ledger.d2h_bytes == 64
    pool.release(host)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counts_agree_with_sync_debug_mode() -> None:
    x = torch.randn(1024, device="cuda")
    host = torch.empty(1024, pin_memory=True)
    with CostLedger(cuda_sync_check=True) as ledger:
        x.sum().item()
        x.nonzero()
        x.tolist()
        host.copy_(x, non_blocking=True)  # d2h into pinned memory: no sync
        x.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    assert ledger.syncs == 3
    assert ledger.cuda_sync_warnings >= 3
    assert ledger.h2d_bytes == 4096 + 0 and ledger.d2h_bytes == 4096 + 4096  # tolist's too
    with CostLedger(cuda_sync_check=True) as quiet:
        y = x * 2
        y.add_(1)
    assert quiet.syncs == 0 and quiet.cuda_sync_warnings == 0
