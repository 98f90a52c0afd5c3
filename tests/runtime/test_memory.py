"""Exact byte accounting of MemoryMeter on CPU (and its CUDA path where present)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_flat.runtime import HostPool, MemoryMeter
from megatron_flat.runtime import memory

F32 = 4


def test_allocations_and_frees_are_exact() -> None:
    with MemoryMeter("cpu") as meter:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        assert meter.current_device_bytes() == 8000
        del a
        assert meter.current_device_bytes() == 4000
        c = torch.empty(250, dtype=torch.int16)  # 500 B
        assert meter.current_device_bytes() == 4500
        assert meter.peak_device_bytes == 8000  # readable during the block
        del b, c
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 8000


def test_views_and_in_place_ops_count_once() -> None:
    with MemoryMeter("cpu") as meter:
        a = torch.zeros(256)  # 1024 B
        views = [a.view(16, 16), a[10:20], a.unsqueeze(0), a.detach()]
        a.add_(1)
        a.mul_(2)
        views[0].fill_(3)
        assert meter.current_device_bytes() == 1024
        b = a + 1  # out of place: a new 1024 B storage
        assert meter.current_device_bytes() == 2048
        del a, views, b
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 2048


def test_storage_shared_by_two_tensors_counts_once() -> None:
    with MemoryMeter("cpu") as meter:
        a = torch.zeros(100)  # 400 B
        b = torch.empty(0).set_(a.untyped_storage(), 0, (50,))
        assert meter.current_device_bytes() == 400
        del a
        # b keeps the storage alive.
        assert meter.current_device_bytes() == 400
        del b
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 400


def test_freed_tensor_keeps_peak_but_lowers_current() -> None:
    with MemoryMeter("cpu") as meter:
        big = torch.empty(10_000)  # 40000 B
        del big
        small = torch.empty(10)  # 40 B
        assert meter.current_device_bytes() == 40
        assert meter.peak_device_bytes == 40_000
        del small
    assert meter.peak_device_bytes == 40_000


def test_pre_existing_tensor_freed_inside_block() -> None:
    pre = torch.zeros(1000)  # 4000 B, live at entry
    kept = torch.zeros(10)
    view_owner = kept[2:5]  # a view keeps kept's storage alive
    with MemoryMeter("cpu") as meter:
        del pre
        assert meter.current_device_bytes() == -4000
        del kept
        assert meter.current_device_bytes() == -4000
        new = torch.empty(500)  # 2000 B
        assert meter.current_device_bytes() == -2000
        del new
    # Nothing ever rose above the entry level.
    assert meter.peak_device_bytes == 0
    del view_owner


def test_resize_and_set_are_tracked() -> None:
    with MemoryMeter("cpu") as meter:
        a = torch.empty(0)
        a.resize_(1000)
        assert meter.current_device_bytes() == 4000
        a.resize_(2000)
        assert meter.current_device_bytes() == 8000
        out = torch.empty(0)
        torch.add(a, a, out=out)  # out= grows `out` in place
        assert meter.current_device_bytes() == 16_000
        del out
        b = torch.zeros(100)  # 400 B
        b.set_(torch.zeros(50).untyped_storage())  # old 400 B freed, 200 B kept
        assert meter.current_device_bytes() == 8000 + 200
        del a, b
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 16_000


def test_storage_level_resize_is_seen_at_next_op() -> None:
    with MemoryMeter("cpu") as meter:
        a = torch.zeros(100)  # 400 B
        a.untyped_storage().resize_(1000)  # bypasses the dispatcher
        a.add_(0)  # an op touching the storage re-measures it
        assert meter.current_device_bytes() == 1000
        del a
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 1000


class _Scale(torch.autograd.Function):
    """y = x * w, saving w for backward; backward allocates exactly g * w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return grad * w, None


def test_autograd_saved_tensor_held_until_backward_then_freed() -> None:
    n = 1024 * F32
    x = torch.randn(1024, requires_grad=True)
    with MemoryMeter("cpu") as meter:
        w = torch.full((1024,), 2.0)
        y = _Scale.apply(x, w)
        del w
        # w lives on as a saved tensor of the graph.
        assert meter.current_device_bytes() == 2 * n
        grad_out = torch.ones(1024)
        y.backward(grad_out)
        # Backward ran under the meter: x.grad was counted, w was freed.
        assert x.grad is not None
        assert meter.current_device_bytes() == 3 * n  # y, grad_out, x.grad
        del y, grad_out
        assert meter.current_device_bytes() == n
        # Peak: y, w, grad_out and the new gradient, all live at once.
        assert meter.peak_device_bytes == 4 * n


def test_backward_of_graph_built_before_the_block_is_seen() -> None:
    x = torch.randn(1024, requires_grad=True)
    loss = (x * 3).sum()
    with MemoryMeter("cpu") as meter:
        loss.backward()
        assert x.grad is not None
        assert meter.current_device_bytes() == x.grad.nbytes == 1024 * F32
        # The 4 B seed gradient is alive while x's gradient is produced.
        assert meter.peak_device_bytes == 1024 * F32 + F32


def test_nested_meters_keep_their_own_peaks() -> None:
    with MemoryMeter("cpu") as outer:
        a = torch.empty(1000)  # 4000 B
        with MemoryMeter("cpu") as inner:
            b = torch.empty(2000)  # 8000 B
            del b
            assert inner.current_device_bytes() == 0
        assert inner.peak_device_bytes == 8000
        c = torch.empty(250)  # 1000 B
        assert outer.current_device_bytes() == 5000
        del a, c
    assert outer.peak_device_bytes == 12_000
    # The inner figure is frozen at its exit.
    assert inner.peak_device_bytes == 8000


def test_sections_are_relative_to_their_entry_and_keep_the_max() -> None:
    with MemoryMeter("cpu") as meter:
        base = torch.empty(1000)  # 4000 B before any section
        with meter.section("fwd"):
            a = torch.empty(250)  # 1000 B
            del a
        with meter.section("bwd"):
            b = torch.empty(500)  # 2000 B
            with meter.section("inner"):
                c = torch.empty(100)  # 400 B
            del b, c
        with meter.section("fwd"):
            a = torch.empty(100)  # 400 B: smaller than the first entry
            del a
        del base
    assert meter.sections["fwd"].peak_device_bytes == 1000
    assert meter.sections["fwd"].entries == 2
    assert meter.sections["bwd"].peak_device_bytes == 2400
    assert meter.sections["inner"].peak_device_bytes == 400
    assert meter.peak_device_bytes == 4000 + 2400


def test_host_pool_bytes_go_to_host_not_device() -> None:
    with MemoryMeter("cpu") as meter:
        pool = HostPool(4096, alignment=512)
        # The pool's buffer is host memory, not a device allocation.
        assert meter.current_device_bytes() == 0
        t = pool.acquire((100,), torch.float32)  # 400 B, reserves 512
        assert t is not None
        src = torch.arange(100, dtype=torch.float32)  # 400 B of device memory
        t.copy_(src)
        t.mul_(2)
        assert meter.current_device_bytes() == 400
        assert meter.current_host_bytes() == 512
        u = pool.acquire((1024,), torch.uint8)  # 1024 B
        assert meter.current_host_bytes() == 1536
        pool.release(t)
        pool.release(u)
        assert meter.current_host_bytes() == 0
        del src
    assert meter.peak_host_bytes == 1536
    assert meter.peak_device_bytes == 400


def test_host_bytes_relative_to_entry_and_pool_death() -> None:
    pool = HostPool(2048, alignment=256)
    held = pool.acquire((256,), torch.uint8)  # in use before the meter
    with MemoryMeter("cpu") as meter:
        assert meter.current_host_bytes() == 0
        with meter.section("offload"):
            t = pool.acquire((512,), torch.uint8)
        assert meter.sections["offload"].peak_host_bytes == 512
        del pool  # bytes still handed out stop counting when the pool dies
        assert meter.current_host_bytes() == -256
        assert meter.current_device_bytes() == 0
        del t
    assert meter.peak_host_bytes == 512
    assert meter.peak_device_bytes == 0
    del held


def test_register_host_storage_removes_counted_bytes() -> None:
    with MemoryMeter("cpu") as meter:
        a = torch.empty(1000)
        assert meter.current_device_bytes() == 4000
        memory.register_host_storage(a.untyped_storage())
        assert meter.current_device_bytes() == 0
        del a
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 4000
    with pytest.raises(TypeError):
        memory.register_host_storage(torch.empty(1))  # type: ignore[arg-type]


def test_timeline_records_each_change_with_monotonic_times() -> None:
    with MemoryMeter("cpu", timeline=True) as meter:
        a = torch.empty(100)  # 400 B
        b = torch.empty(200)  # 800 B
        del a
        del b
    times = [t for t, _ in meter.timeline]
    values = [v for _, v in meter.timeline]
    assert times == sorted(times)
    assert times[0] == 0.0
    # Entry sample, two allocations, two frees, exit sample.
    assert values == [0, 400, 1200, 800, 0, 0]


def test_fake_and_meta_tensors_are_ignored() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with MemoryMeter("cpu") as meter:
        m = torch.empty(1000, device="meta")
        with FakeTensorMode():
            f = torch.empty(1000)
            g = f * 2
        assert meter.current_device_bytes() == 0
        del m, f, g
    assert meter.peak_device_bytes == 0


def test_tensor_from_python_data_is_counted() -> None:
    with MemoryMeter("cpu") as meter:
        t = torch.tensor([1.0, 2.0, 3.0])  # built outside the dispatcher, then lifted
        assert meter.current_device_bytes() == 12
        del t
    assert meter.peak_device_bytes == 12


def test_free_from_another_thread_lowers_live_bytes() -> None:
    with MemoryMeter("cpu") as meter:
        box = [torch.empty(1000)]
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()
        assert meter.current_device_bytes() == 0
    assert meter.peak_device_bytes == 4000


def test_scan_from_another_thread_leaves_open_meters_unchanged() -> None:
    seen: list[int] = []

    def worker(outer: MemoryMeter) -> None:
        # This thread has no meter open, so this allocation is not seen...
        unseen = torch.empty(1000)
        # ...and the scan at this entry must not show it to `outer` either.
        with MemoryMeter("cpu") as inner:
            keep = torch.empty(10)  # 40 B, seen by both meters
            seen.append(inner.current_device_bytes())
            seen.append(outer.current_device_bytes())
            del keep, unseen

    with MemoryMeter("cpu") as outer:
        thread = threading.Thread(target=worker, args=(outer,))
        thread.start()
        thread.join()
    assert seen == [40, 40]
    assert outer.peak_device_bytes == 40


def test_meter_misuse_raises() -> None:
    meter = MemoryMeter("cpu")
    assert meter.peak_device_bytes == 0
    with pytest.raises(RuntimeError):
        meter.current_device_bytes()
    with meter:
        pass
    with pytest.raises(RuntimeError):
        with meter:
            pass
    with pytest.raises(RuntimeError):
        meter.current_device_bytes()
    with pytest.raises(RuntimeError):
        with meter.section("late"):
            pass
    with pytest.raises(ValueError):
        MemoryMeter("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_meter_without_cuda_raises() -> None:
    with pytest.raises(ValueError):
        MemoryMeter("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_nested_meters_and_sections_do_not_corrupt_outer_peak() -> None:
    mib = 1 << 20
    torch.cuda.synchronize()
    with MemoryMeter("cuda", timeline=True) as outer:
        a = torch.empty(mib, dtype=torch.uint8, device="cuda")
        with MemoryMeter("cuda") as inner:
            b = torch.empty(2 * mib, dtype=torch.uint8, device="cuda")
            del b
        with outer.section("s"):
            c = torch.empty(mib // 2, dtype=torch.uint8, device="cuda")
            del c
        assert outer.current_device_bytes() == mib
        outer.sample()
        pool = HostPool(mib)
        t = pool.acquire((mib,), torch.uint8)
        assert outer.current_device_bytes() == mib  # pinned host bytes are not device
        pool.release(t)
        del a
    assert inner.peak_device_bytes == 2 * mib
    assert outer.sections["s"].peak_device_bytes == mib // 2
    assert outer.peak_device_bytes == 3 * mib
    assert outer.peak_host_bytes == mib
    times = [t for t, _ in outer.timeline]
    assert times == sorted(times)


def test_peak_rise_counts_from_the_lowest_level_before_it():
    """Bytes live at entry and freed inside the block would hide part of a later peak from
    the entry-relative figure; the rise is measured from the lowest level before it."""
    from megatron_flat.runtime.memory import MemoryMeter

    leftover = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB, live at entry
    with MemoryMeter("cpu") as meter:
        del leftover  # freed inside: the level drops 1 MiB below the entry
        peak = torch.empty(3 << 20, dtype=torch.uint8)  # then 3 MiB on top
        del peak
        small = torch.empty(1 << 19, dtype=torch.uint8)
        del small
    assert meter.peak_device_bytes == 2 << 20  # 3 MiB - 1 MiB above the entry
    assert meter.peak_rise_bytes == 3 << 20
