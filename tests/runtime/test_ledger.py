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


def test_each_sync_kind_counts_its_blocking_points() -> None:
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
        "bincount": 2,  # its minimum and its maximum
        "repeat_interleave": 4,  # the total and the check that no repeat is negative
        "numpy": 1,
        "equal": 1,
    }
    assert ledger.syncs == 17


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


def test_host_memory_copies_block_unless_non_blocking_as_on_cuda() -> None:
    host = torch.empty(8)
    mark_host_memory(host)
    x = torch.randn(8)
    with CostLedger() as ledger:
        with ledger.section("blocking"):
            host.copy_(x)  # memcpy_and_sync on CUDA, pinned or not
            x.copy_(host)
        with ledger.section("non-blocking"):
            host.copy_(x, non_blocking=True)
            x.copy_(host, non_blocking=True)
    for name in ("blocking", "non-blocking"):
        assert ledger.sections[name].d2h_bytes == 32 and ledger.sections[name].h2d_bytes == 32
    assert ledger.sections["blocking"].sync_kinds == {"d2h_copy": 1, "h2d_copy": 1}
    assert ledger.sections["non-blocking"].syncs == 0


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


# -- uploads: host->device copies that block on CUDA unless pinned and non-blocking ------


def test_to_compute_device_of_host_data_is_one_blocking_upload() -> None:
    x = torch.randn(4)  # device data: x.device is the compute device
    with CostLedger() as ledger:
        host = torch.tensor([1, 2, 3])
        on_device = host.to(x.device)
    assert ledger.sync_kinds == {"h2d_copy": 1}
    assert ledger.h2d_bytes == 24
    # the result is a device copy; the source keeps its host mark
    assert is_device_data(on_device) and not is_device_data(host)
    assert on_device.data_ptr() != host.data_ptr() and torch.equal(on_device, host)


def test_to_cpu_string_names_the_host_and_is_no_upload() -> None:
    with CostLedger() as ledger:
        counts = torch.tensor([3, 1, 4])
        same = counts.to("cpu", torch.long)
        counts.to(device="cpu")
    assert ledger.syncs == 0 and ledger.h2d_bytes == 0
    assert same.data_ptr() == counts.data_ptr() and not is_device_data(same)


def test_upload_from_host_memory_blocks_only_without_non_blocking() -> None:
    x = torch.randn(4)
    staging = torch.arange(8.0)
    mark_host_memory(staging)
    with CostLedger() as quiet:
        staging.to(x.device, non_blocking=True)
    assert quiet.syncs == 0 and quiet.h2d_bytes == 32
    with CostLedger() as blocking:
        staging.to(x.device)
    assert blocking.sync_kinds == {"h2d_copy": 1} and blocking.h2d_bytes == 32
    with CostLedger() as pageable:  # non_blocking from pageable memory still waits
        torch.tensor([1.0, 2.0]).to(x.device, non_blocking=True)
    assert pageable.sync_kinds == {"h2d_copy": 1}


def test_cpu_then_back_to_the_device_is_two_syncs() -> None:
    x = torch.randn(4)
    with CostLedger() as ledger:
        host = x.cpu()  # a sync; host memory
        back = host.to(x.device)  # blocking upload from host memory
        host.to(x.device, non_blocking=True)  # pinned there: no wait
    assert ledger.sync_kinds == {"cpu": 1, "h2d_copy": 1}
    assert ledger.h2d_bytes == 2 * 16 and ledger.d2h_bytes == 16
    assert is_device_data(back)


def test_to_a_device_object_or_a_device_tensor_names_the_compute_device() -> None:
    x = torch.randn(3)
    with CostLedger() as ledger:
        host = torch.tensor([1.0, 2.0, 3.0])
        host.to(x)  # x holds device data
        host.to(device=torch.device("cpu"), dtype=torch.float64)  # a device object
        host.to(host)  # a host tensor: host to host
        host.to(torch.float64)  # a cast, no device
    assert ledger.sync_kinds == {"h2d_copy": 2}
    assert ledger.h2d_bytes == 2 * 12


def test_torch_tensor_and_as_tensor_with_device_are_uploads() -> None:
    x = torch.randn(4)
    with CostLedger() as ledger:
        made = torch.tensor([1, 2, 3], device=x.device)
        torch.tensor([1, 2, 3])  # host data: no upload
        torch.tensor([1, 2, 3], device="cpu")  # the host, by name
    assert ledger.sync_kinds == {"h2d_copy": 1} and ledger.h2d_bytes == 24
    assert is_device_data(made)
    host = torch.tensor([5, 6])
    mark_host(host)
    with CostLedger() as ledger:
        as_list = torch.as_tensor([1, 2], device=x.device)
        as_host = torch.as_tensor(host, device=x.device)
        plain = torch.as_tensor([1, 2])
        torch.as_tensor(x, device=x.device)  # already device data
    assert ledger.sync_kinds == {"h2d_copy": 2} and ledger.h2d_bytes == 32
    assert is_device_data(as_list) and is_device_data(as_host) and not is_device_data(plain)
    assert as_host.data_ptr() != host.data_ptr() and not is_device_data(host)


def test_an_uploads_result_is_device_data_its_source_is_not() -> None:
    x = torch.randn(4)
    with CostLedger() as ledger:
        host = torch.tensor([1, 2, 3])
        on_device = host.to(x.device)
        host.tolist()  # the host's own data: no sync
        on_device.tolist()  # a read of device data: a sync
    assert ledger.sync_kinds == {"h2d_copy": 1, "tolist": 1}


def test_indexing_device_data_with_a_host_index_uploads_it() -> None:
    x = torch.randn(8)
    with CostLedger() as ledger:
        index = torch.tensor([0, 2, 5])
        with ledger.section("getitem"):
            x[index]
        with ledger.section("index_select"):
            x.index_select(0, index)
        with ledger.section("index_put"):
            x.clone()[index] = 1.0  # the index's upload, then the 0-dim value's (below)
        with ledger.section("gather"):
            torch.gather(x, 0, index)
        with ledger.section("searchsorted"):
            torch.searchsorted(torch.sort(x).values, torch.tensor([0.0, 1.0]))
    for name in ("getitem", "index_select", "gather", "searchsorted"):
        assert ledger.sections[name].sync_kinds == {"h2d_implicit": 1}, name
    # with a long index, _index_put_impl_ moves a 0-dim host value with value.to(device)
    assert ledger.sections["index_put"].sync_kinds == {"h2d_implicit": 1, "h2d_scalar": 1}
    assert ledger.sections["getitem"].h2d_bytes == 24
    assert ledger.syncs == 6


def test_factory_index_and_scalars_are_not_uploads() -> None:
    x = torch.randn(8)
    with CostLedger() as ledger:
        x[torch.arange(3)]  # a factory may be on the device: not counted
        x.index_select(0, torch.arange(2) * 2)  # computed from a factory only
        x * torch.tensor(2.0)  # 0-dim: a scalar on CUDA
        y = x.clone()
        y[3:4] = 5  # a slice: fill_ with the host value as a kernel argument
        y.view(2, 4)[1] = 5  # a row (not 0-dim): fill_ too
    assert ledger.syncs == 0 and ledger.h2d_bytes == 0


def test_factory_buffer_filled_with_device_data_is_device_data() -> None:
    src = torch.randn(5)
    dev_index = torch.tensor([0, 1, 1, 2, 0])  # made outside a ledger: device data
    with CostLedger() as ledger:
        acc = torch.zeros(3).index_add_(0, dev_index, src)
        acc.tolist()  # device data now: a sync, no upload anywhere
    assert ledger.sync_kinds == {"tolist": 1}
    assert ledger.h2d_bytes == 0


def test_factory_and_host_taints_are_not_device_data() -> None:
    with CostLedger():
        made = torch.zeros(3)
        host = torch.tensor([1, 2, 3])
        mixed = made + host  # computed from host data: host
        plain = made * 2  # computed only from a factory: factory
    for t in (made, host, mixed, plain):
        assert not is_device_data(t)
    x = torch.randn(3)
    with CostLedger() as ledger:
        x + mixed  # host data beside device data: uploaded on CUDA
        x + plain  # factory data: may live on the device
    assert ledger.sync_kinds == {"h2d_implicit": 1} and ledger.h2d_bytes == 12


def test_mark_host_makes_a_cached_index_an_upload() -> None:
    x = torch.randn(6)
    cached = torch.tensor([1, 3])  # a plan cached before the block
    mark_host(cached)
    with CostLedger() as ledger:
        x[cached]
    assert ledger.sync_kinds == {"h2d_implicit": 1}


def test_copy_of_host_data_into_device_data_is_a_blocking_upload() -> None:
    x = torch.randn(3)
    with CostLedger() as ledger:
        with ledger.section("host"):
            x.copy_(torch.tensor([1.0, 2.0, 3.0]), non_blocking=True)  # pageable: waits
        with ledger.section("factory"):
            x.copy_(torch.arange(3.0))  # may be device data: not counted
        with ledger.section("into a factory buffer"):
            buf = torch.empty(3)
            buf.copy_(torch.tensor([0.0, 2.0, 1.0]))  # host to host
            buf.tolist()
    assert ledger.sections["host"].sync_kinds == {"h2d_copy": 1}
    assert ledger.sections["host"].h2d_bytes == 12
    assert ledger.sections["factory"].syncs == 0
    assert ledger.sections["into a factory buffer"].syncs == 0
    assert not is_device_data(buf)  # host data written into a factory buffer: host data
    with CostLedger() as later:
        x[buf.long()]
    assert later.sync_kinds == {"h2d_implicit": 1}


def test_pool_reload_into_a_factory_buffer_is_device_data() -> None:
    pool = HostPool(4096)
    host = pool.acquire((4,), torch.float32)
    host.copy_(torch.ones(4))
    x = torch.randn(4)
    with CostLedger() as ledger:
        buf = torch.empty(4)
        buf.copy_(host, non_blocking=True)  # a reload: h2d, no sync (CPU copies by design)
        x + buf  # device data now, not host data beside device data
    assert ledger.h2d_bytes == 16 and ledger.syncs == 0
    assert is_device_data(buf)
    pool.release(host)


def test_upload_patches_are_removed_after_the_block() -> None:
    originals = (torch.Tensor.to, torch.Tensor.cuda, torch.tensor, torch.as_tensor)
    with CostLedger():
        with CostLedger():
            assert torch.Tensor.to is not originals[0] and torch.tensor is not originals[2]
        assert torch.Tensor.to is not originals[0]  # the outer ledger still counts
    assert (torch.Tensor.to, torch.Tensor.cuda, torch.tensor, torch.as_tensor) == originals
    host = torch.tensor([1, 2])
    assert host.to(torch.device("cpu")) is host  # torch's own again


def test_a_cuda_patched_while_open_is_left_in_place() -> None:
    original = torch.Tensor.cuda

    def identity(self, *args, **kwargs):
        return self

    try:
        with CostLedger():
            torch.Tensor.cuda = identity  # e.g. a CPU backend installed inside a ledger
        assert torch.Tensor.cuda is identity
    finally:
        torch.Tensor.cuda = original


def test_cuda_made_the_identity_uploads_host_data() -> None:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # a CPU backend's .cuda()
    try:
        x = torch.randn(2)
        with CostLedger() as ledger:
            batch = torch.tensor([1, 2, 3]).cuda()
            x.cuda()  # device data already
        assert ledger.sync_kinds == {"h2d_copy": 1} and is_device_data(batch)
    finally:
        torch.Tensor.cuda = original


def test_flagged_syncs_leave_out_the_waits_cuda_does_not_flag() -> None:
    from megatron_flat.runtime.ledger import record_sync, sync_mismatch, sync_mismatches

    x = torch.randn(4)
    with CostLedger() as ledger:
        x.sum().item()
        record_sync("event_synchronize")  # blocks on a GPU, but set_sync_debug_mode is silent
        record_sync("stream_synchronize")
    record = ledger.as_dict()
    assert record["syncs"] == 3 and record["flagged_syncs"] == 2
    assert sync_mismatch(record) is None  # a CPU run: nothing to compare
    assert sync_mismatch({**record, "cuda_sync_warnings": 2}) is None
    assert "counted 2 flagged syncs, CUDA's sync-debug mode warned 3 times" in sync_mismatch(
        {**record, "cuda_sync_warnings": 3})
    lines = sync_mismatches({"agrees": {**record, "cuda_sync_warnings": 2},
                             "differs": {**record, "cuda_sync_warnings": 3}})
    assert len(lines) == 1 and lines[0].startswith("differs: the ledger counted 2")


def test_a_number_written_into_a_factory_buffer_leaves_it_a_factorys() -> None:
    """A 0-dim host value is a kernel argument, not host data: a factory-made buffer it is
    written into may still be on the device (Megatron's cross-entropy masks a batch's
    labels with 0), so indexing device data with it uploads nothing."""
    x = torch.randn(8)
    with CostLedger() as ledger:
        index = torch.arange(4)
        index[index > 2] = 0
        x[index]
        from_host = torch.tensor(3) * 2  # a host number stays the host's
    assert ledger.syncs == 0 and ledger.h2d_bytes == 0
    assert not is_device_data(index)
    with CostLedger() as later:
        x[:1].copy_(from_host.float())  # into device data: its blocking upload
    assert later.sync_kinds == {"h2d_scalar": 1}
