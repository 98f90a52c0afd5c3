"""OffloadStreamAdamW behaviour: errors, skipped steps, memory, host-pool fallback,
state adoption and re-planning (the hooks Megatron's wrappers rely on), the pipeline."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from megatron_flat.optim import OffloadStreamAdamW, plan_buckets
from megatron_flat.optim.host_state import host_bytes_needed
from megatron_flat.optim.pipeline import StagingPipeline
from megatron_flat.runtime import HostPool, MemoryMeter

SHAPES = [(40, 30), (500,), (7,), (64, 64)]


def make_params(dtype=torch.float32, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def set_grads(params, seed, refs=()):
    gen = torch.Generator().manual_seed(1000 + seed)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = g
        if refs:
            refs[i].grad = g.float()


def snapshot(opt, params):
    """Every byte the optimizer owns or writes: host buffers (padding included), params."""
    host = opt._host
    bufs = [host.exp_avg, host.exp_avg_sq] + ([host.master] if host.master is not None else [])
    steps = {i: float(opt.state[p]["step"]) for i, p in enumerate(params) if opt.state.get(p)}
    return [b.clone() for b in bufs], [p.detach().clone() for p in params], steps


def same(a, b) -> bool:
    (bufs_a, params_a, steps_a), (bufs_b, params_b, steps_b) = a, b
    return (all(torch.equal(x.view(torch.int32), y.view(torch.int32))
                for x, y in zip(bufs_a, bufs_b))
            and all(torch.equal(x, y) for x, y in zip(params_a, params_b))
            and steps_a == steps_b)


# -- argument errors --------------------------------------------------------------


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(num_slots=0), ValueError, "num_slots"),
    (dict(num_slots=-2), ValueError, "num_slots"),
    (dict(num_slots=1.5), TypeError, "num_slots"),
    (dict(bucket_numel=0), ValueError, "bucket_numel"),
    (dict(bucket_numel=True), TypeError, "bucket_numel"),
    (dict(lr=-1e-3), ValueError, "learning rate"),
    (dict(eps=-1.0), ValueError, "epsilon"),
    (dict(betas=(1.0, 0.9)), ValueError, "betas"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(foreach=True, fused=True), ValueError, "fused"),
    (dict(host_pool=object()), TypeError, "HostPool"),
])
def test_bad_arguments(kwargs, err, match) -> None:
    with pytest.raises(err, match=match):
        OffloadStreamAdamW(make_params(), **kwargs)


@pytest.mark.parametrize("param,match", [
    (torch.zeros(4, dtype=torch.complex64, requires_grad=True), "complex"),
    (torch.zeros(4, dtype=torch.int64), "floating-point"),
    (torch.zeros(4, 6).t().requires_grad_(), "contiguous"),
    (torch.zeros(4, 4).to_sparse().requires_grad_(), "dense"),
])
def test_bad_params(param, match) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadStreamAdamW([param])


def test_duplicate_and_bad_group_values() -> None:
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="twice"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own duplicate warning comes first
        OffloadStreamAdamW([p, p])
    with pytest.raises(ValueError, match="learning rate"):
        OffloadStreamAdamW([{"params": [p], "lr": -1.0}])


def test_sparse_grad_raises_before_touching_anything() -> None:
    params = make_params()
    opt = OffloadStreamAdamW(params, bucket_numel=256)
    set_grads(params, 0)
    opt.step()
    set_grads(params, 1)
    params[2].grad = params[2].grad.to_sparse()
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert same(before, snapshot(opt, params))


def test_bad_lr_set_later_raises_before_touching_anything() -> None:
    params = make_params()
    opt = OffloadStreamAdamW(params, bucket_numel=256)
    set_grads(params, 0)
    opt.step()
    opt.param_groups[0]["lr"] = -1.0
    set_grads(params, 1)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()
    assert same(before, snapshot(opt, params))


# -- skipping -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_step_check_false_leaves_every_byte_unchanged(dtype) -> None:
    params = make_params(dtype)
    verdict = {"ok": True}
    opt = OffloadStreamAdamW(params, bucket_numel=256, num_slots=2,
                             pre_step_check=lambda: verdict["ok"])
    for s in range(3):
        set_grads(params, s)
        opt.step()
    set_grads(params, 3)
    verdict["ok"] = False
    before = snapshot(opt, params)
    opt.step()
    assert same(before, snapshot(opt, params))
    assert opt.skipped_steps == 1
    verdict["ok"] = True
    opt.step()
    assert not same(before, snapshot(opt, params))
    assert float(opt.state[params[0]]["step"]) == 4


def test_pre_step_check_runs_global_clipping_before_any_bucket() -> None:
    """Clip by the global grad norm in the hook: equal to clipping before AdamW.step."""
    params = make_params()
    refs = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, foreach=False)
    seen = []

    def clip() -> bool:
        # No bucket has been updated yet: params still equal the reference's old values.
        seen.append(all(torch.equal(p, r) for p, r in zip(params, refs)))
        torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
        return True

    opt = OffloadStreamAdamW(params, lr=1e-2, bucket_numel=64, foreach=False,
                             pre_step_check=clip)
    assert len(opt.plan.buckets) > 4
    for s in range(5):
        set_grads(params, s, refs)
        torch.nn.utils.clip_grad_norm_(refs, max_norm=0.5)
        opt.step()
        ref_opt.step()
        assert all(torch.equal(p, r) for p, r in zip(params, refs))
    assert seen == [True] * 5


def test_pre_step_check_may_replace_gradients() -> None:
    params = make_params()
    refs = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, foreach=False)

    def halve_and_drop() -> bool:
        for p in params:
            p.grad = p.grad * 0.5
        params[2].grad = None
        return True

    opt = OffloadStreamAdamW(params, bucket_numel=128, pre_step_check=halve_and_drop)
    set_grads(params, 0, refs)
    for r in refs:
        r.grad = r.grad * 0.5
    refs[2].grad = None
    opt.step()
    ref_opt.step()
    assert all(torch.equal(p, r) for p, r in zip(params, refs))
    assert params[2] not in opt.state


def test_params_without_grads_are_skipped_and_their_state_untouched() -> None:
    params = make_params()
    opt = OffloadStreamAdamW(params, bucket_numel=100)  # splits params 0, 1 and 3
    set_grads(params, 0)
    opt.step()
    set_grads(params, 1)
    params[1].grad = None
    params[3].grad = None
    views = {k: opt.state[params[1]][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    views3 = {k: opt.state[params[3]][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    kept = [params[1].detach().clone(), params[3].detach().clone()]
    opt.step()
    for k in views:
        assert torch.equal(opt.state[params[1]][k], views[k])
        assert torch.equal(opt.state[params[3]][k], views3[k])
    assert torch.equal(params[1], kept[0]) and torch.equal(params[3], kept[1])
    assert float(opt.state[params[1]]["step"]) == 1
    assert float(opt.state[params[0]]["step"]) == 2


def test_zero_grad_then_step_changes_nothing() -> None:
    params = make_params()
    opt = OffloadStreamAdamW(params, bucket_numel=256)
    set_grads(params, 0)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    before = snapshot(opt, params)
    opt.step()
    assert same(before, snapshot(opt, params))


def test_closure_is_evaluated_and_its_loss_returned() -> None:
    params = make_params(shapes=[(10,)])
    opt = OffloadStreamAdamW(params)

    def closure():
        opt.zero_grad()
        loss = (params[0] ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and float(opt.state[params[0]]["step"]) == 1


# -- memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["fused", "single", "foreach"])
def test_staging_is_exactly_slots_times_largest_bucket_times_12_or_16(num_slots, dtype,
                                                                       kernel) -> None:
    """12 B per staged element (master, exp_avg, exp_avg_sq); fp32 gradients on the device are
    read in place, bf16 ones are staged as fp32 (16 B) from the first step on."""
    params = make_params(dtype)
    for s in range(1):
        set_grads(params, s)
    kw = {"fused": dict(fused=True), "single": dict(foreach=False),
          "foreach": dict(foreach=True)}[kernel]
    bucket_numel = 1000
    with MemoryMeter("cpu") as meter:
        opt = OffloadStreamAdamW(params, bucket_numel=bucket_numel, num_slots=num_slots, **kw)
        assert meter.current_device_bytes() == 0  # nothing before the first prepare
        opt.prepare()
        largest = opt.plan.largest_numel
        assert 0 < largest <= bucket_numel
        staging = num_slots * largest * 12
        assert opt.staging_bytes == staging
        assert meter.current_device_bytes() == staging
        # Host state: 8 B/element, + 4 B/element of master for low-precision params.
        flat = opt.plan.flat_numel
        numels = [flat, flat] + ([flat] if dtype != torch.float32 else [])
        assert opt.host_bytes == 4 * sum(numels)
        assert meter.peak_host_bytes == host_bytes_needed(numels)
        for s in range(3):
            opt.step()
        if dtype != torch.float32:
            staging = num_slots * largest * 16
        assert opt.staging_bytes == staging
        # Per step only the update kernel's scratch and step counters come on top.
        largest_piece = max(s.numel for b in opt.plan.buckets for s in b.segments)
        scratch = {"fused": 0, "single": 8 * largest_piece, "foreach": 4 * largest}[kernel]
        counters = 4 * len(params) * 4
        assert staging <= meter.peak_device_bytes <= staging + scratch + counters + 256
        assert meter.current_device_bytes() <= staging + counters


def test_host_state_lives_in_the_pool_and_state_views_are_stable() -> None:
    pool = HostPool(1 << 20)
    params = make_params(torch.bfloat16)
    opt = OffloadStreamAdamW(params, bucket_numel=300, host_pool=pool)
    set_grads(params, 0)
    opt.step()
    views = {k: opt.state[params[0]][k] for k in ("exp_avg", "exp_avg_sq", "master")}
    pool_storage = pool._storage
    for v in views.values():
        assert v.untyped_storage() is pool_storage
    set_grads(params, 1)
    opt.step()
    for k, v in views.items():
        assert opt.state[params[0]][k] is v
    assert opt.host_pinned is pool.pinned  # pinned exactly when CUDA is there
    used = pool.used_bytes
    assert used == host_bytes_needed([opt.plan.flat_numel] * 3)
    del opt, views
    gc.collect()
    assert pool.used_bytes == 0  # blocks go back to a shared pool


@pytest.mark.parametrize("room", ["none", "one_buffer"])
def test_host_budget_not_met_falls_back_with_one_warning(room) -> None:
    params = make_params(torch.bfloat16)
    refs = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, foreach=False)
    flat = plan_buckets([p.numel() for p in params], 256).flat_numel
    budget = 0 if room == "none" else host_bytes_needed([flat])  # room for one buffer
    pool = HostPool(budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = OffloadStreamAdamW(params, bucket_numel=256, host_pool=pool, foreach=False)
        for s in range(4):
            set_grads(params, s, refs)
            opt.step()
            ref_opt.step()
            assert all(torch.equal(p, r.detach().to(p.dtype)) for p, r in zip(params, refs))
        opt.state_dict()
    ours = [w for w in caught if "host pool" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    if room == "none":
        assert opt.host_fallbacks == ["exp_avg", "exp_avg_sq", "master"]
    else:
        assert opt.host_fallbacks == ["exp_avg_sq", "master"]
        assert pool.used_bytes > 0
    for p, r in zip(params, refs):
        assert torch.equal(opt.state[p]["master"], r.detach())
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])


# -- state adoption and re-planning (what Megatron's wrappers do) ----------------------


def test_param_swap_then_load_state_dict_replans() -> None:
    """Float16OptimizerWithFloat16Params: build on model params, swap in fp32 main params,
    then ``load_state_dict(state_dict())``; the plan follows the main params."""
    model = make_params(torch.bfloat16)
    opt = OffloadStreamAdamW(model, bucket_numel=300, foreach=False)
    opt.prepare()
    assert opt.host_bytes == 12 * opt.plan.flat_numel  # bf16 params need a host master
    main = [p.detach().float().requires_grad_() for p in model]
    main_of = {id(p): m for p, m in zip(model, main)}
    for group in opt.param_groups:
        for j, p in enumerate(group["params"]):
            group["params"][j] = main_of[id(p)]
    opt.load_state_dict(opt.state_dict())
    assert opt.host_bytes == 8 * opt.plan.flat_numel  # fp32 main params are their own master
    refs = [m.detach().clone().requires_grad_() for m in main]
    ref_opt = torch.optim.AdamW(refs, foreach=False)
    for s in range(5):
        set_grads(main, s, refs)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(m, r) for m, r in zip(main, refs))


def test_add_param_group_after_steps_carries_state() -> None:
    params = make_params()
    extra = torch.randn(90, requires_grad=True)
    refs = [p.detach().clone().requires_grad_() for p in params]
    ref_extra = extra.detach().clone().requires_grad_()
    opt = OffloadStreamAdamW(params, bucket_numel=128, foreach=False)
    ref_opt = torch.optim.AdamW(refs, foreach=False)
    for s in range(3):
        set_grads(params, s, refs)
        opt.step()
        ref_opt.step()
    opt.add_param_group({"params": [extra], "lr": 5e-3})
    ref_opt.add_param_group({"params": [ref_extra], "lr": 5e-3})
    for s in range(3, 6):
        set_grads(params + [extra], s, refs + [ref_extra])
        opt.step()
        ref_opt.step()
    for p, r in zip(params + [extra], refs + [ref_extra]):
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])


def test_state_assigned_from_outside_is_adopted() -> None:
    """Megatron's init_state_fn assigns zeros_like placeholders, then copy_-s loaded values
    into them; the next step must train from those values."""
    params = make_params()
    refs = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, foreach=False)
    for s in range(3):
        set_grads(refs, s)
        ref_opt.step()
    for p, r in zip(params, refs):
        p.data.copy_(r.detach())
    opt = OffloadStreamAdamW(params, bucket_numel=200, foreach=False)
    for p, r in zip(params, refs):
        st = opt.state[p]
        st["exp_avg"] = torch.zeros_like(p)
        st["exp_avg_sq"] = torch.zeros_like(p)
        st["exp_avg"].copy_(ref_opt.state[r]["exp_avg"])
        st["exp_avg_sq"].copy_(ref_opt.state[r]["exp_avg_sq"])
        st["step"] = torch.tensor(3.0)
    for s in range(3, 6):
        set_grads(params, s, refs)
        opt.step()
        ref_opt.step()
    for p, r in zip(params, refs):
        assert torch.equal(p, r)
        assert opt.state[p]["exp_avg"].untyped_storage() is opt._host.pool._storage


def test_fp32_main_grad_attribute_for_bf16_params() -> None:
    """``grad_attr="main_grad"``: Megatron-style fp32 gradient buffers on bf16 params."""
    params = make_params(torch.bfloat16)
    refs = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, foreach=False)
    opt = OffloadStreamAdamW(params, bucket_numel=300, foreach=False, grad_attr="main_grad")
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        for p, r in zip(params, refs):
            p.main_grad = torch.randn(p.numel(), generator=gen)  # fp32, flat
            r.grad = p.main_grad.view(p.shape).clone()
        opt.step()
        ref_opt.step()
        for p, r in zip(params, refs):
            assert torch.equal(p, r.detach().to(torch.bfloat16))
            assert torch.equal(opt.state[p]["master"], r.detach())
    params[0].main_grad = torch.randn(3)
    with pytest.raises(RuntimeError, match="main_grad of shape"):
        opt.step()


def test_reload_model_params_refreshes_the_master() -> None:
    params = make_params(torch.bfloat16)
    opt = OffloadStreamAdamW(params, bucket_numel=256)
    set_grads(params, 0)
    opt.step()
    new = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
    for p, n in zip(params, new):
        p.data.copy_(n)
    assert not torch.equal(opt.state[params[0]]["master"], new[0].float())
    opt.reload_model_params()
    for p, n in zip(params, new):
        assert torch.equal(opt.state[p]["master"], n.float())


def test_load_state_dict_validates_everything_before_writing() -> None:
    params = make_params()
    opt = OffloadStreamAdamW(params, bucket_numel=256)
    set_grads(params, 0)
    opt.step()
    good = opt.state_dict()
    set_grads(params, 1)
    opt.step()
    before = snapshot(opt, params)
    bad = opt.state_dict()
    bad["state"][3]["exp_avg"] = torch.zeros(5)  # wrong size, last entry
    bad["state"][0]["exp_avg"] = good["state"][0]["exp_avg"]
    with pytest.raises(ValueError, match="elements"):
        opt.load_state_dict(bad)
    assert same(before, snapshot(opt, params))
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="amsgrad"):
        g = dict(good["param_groups"][0], amsgrad=True)
        opt.load_state_dict({"state": good["state"], "param_groups": [g]})
    assert same(before, snapshot(opt, params))


# -- the pipeline -------------------------------------------------------------------------


def test_pipeline_runs_items_in_order_through_rotating_slots() -> None:
    pipe = StagingPipeline(torch.device("cpu"), num_slots=3, slot_numel=10)
    assert pipe.nbytes == 3 * 10 * 12
    assert all(s.buffer.shape == (3, 10) and s.grad is None for s in pipe.slots)
    pipe.stage_grads()
    assert pipe.nbytes == 3 * 10 * 16 and all(s.grad.shape == (10,) for s in pipe.slots)
    log = []
    pipe.run(
        list(range(5)),
        lambda g, slot: log.append(("up", g, slot.index)),
        lambda g, slot: log.append(("upd", g, slot.index)),
        lambda g, slot: log.append(("wb", g, slot.index)),
    )
    expected = []
    for g in range(5):
        expected += [("up", g, g % 3), ("upd", g, g % 3), ("wb", g, g % 3)]
    assert log == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_slots", [1, 2, 3])
@pytest.mark.parametrize("kernel", ["fused", "foreach", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_streams_bitwise_equal_to_adamw(num_slots, kernel, dtype) -> None:
    kw = {"fused": dict(fused=True), "single": dict(foreach=False),
          "foreach": dict(foreach=True)}[kernel]
    gen = torch.Generator().manual_seed(0)
    shapes = [(1000, 257), (4097,), (3,), (512, 512), (77, 1031)]
    params = [torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_() for s in shapes]
    refs = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, **kw)
    torch.cuda.synchronize()
    with MemoryMeter("cuda") as meter:
        opt = OffloadStreamAdamW(params, lr=1e-2, bucket_numel=65_536, num_slots=num_slots, **kw)
        opt.prepare()
        assert meter.current_device_bytes() == opt.staging_bytes == num_slots * 65_536 * 12
    assert opt.host_pinned
    _cuda_steps_bitwise(opt, ref_opt, params, refs, gen, 20, "exp_avg_sq")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_state_is_complete_when_step_returns() -> None:
    """step() returns when its write-backs have landed: the host state is read at once, with
    no other wait in between (the mutation suite's --gpu run delays every side-stream copy,
    so a step that returned earlier would show the previous state here)."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(1024, 1024, generator=gen).cuda().requires_grad_() for _ in range(4)]
    refs = [p.detach().clone().requires_grad_() for p in params]
    grads = [torch.randn(p.shape, generator=gen).cuda() for p in params]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, fused=True)
    for r, grad in zip(refs, grads):
        r.grad = grad.clone()
    ref_opt.step()
    want = [ref_opt.state[r]["exp_avg_sq"].cpu() for r in refs]  # before the step under test
    opt = OffloadStreamAdamW(params, lr=1e-2, bucket_numel=1 << 20, num_slots=2, fused=True)
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    opt.step()
    got = [opt.state[p]["exp_avg_sq"].clone() for p in params]  # host memory, read now
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _cuda_steps_bitwise(opt, ref_opt, params, refs, gen, steps: int, state: str) -> None:
    """``steps`` steps of both optimizers on the same random CUDA gradients: parameters
    bitwise equal after every step, the ``state`` moment after the last."""
    for _ in range(steps):
        for p, r in zip(params, refs):
            # Made by a kernel on the caller's stream (the upload alone would block): under
            # the mutation suite's late-producer runs it lands late, so a step that does not
            # wait for its caller reads the gradient before it is written.
            g = torch.randn(p.shape, generator=gen).to("cuda", p.dtype).mul(2)
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
        for p, r in zip(params, refs):
            assert torch.equal(p, r.detach().to(p.dtype))
    for p, r in zip(params, refs):
        assert torch.equal(opt.state[p][state], ref_opt.state[r][state].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pcie_bytes_per_step(dtype) -> None:
    """Per staged element and step, the host state goes up and comes back: exp_avg and
    exp_avg_sq, plus the fp32 master of low-precision params (fp32 params are their own
    master): 8 or 12 B each way. The gradient never crosses: it is on the device already
    (read in place when fp32; a bf16 one is cast into the slot on the device)."""
    from megatron_flat.runtime import CostLedger

    params = make_params(dtype)
    opt = OffloadStreamAdamW(params, bucket_numel=1000, num_slots=2)
    set_grads(params, 0)
    opt.step()  # allocations and planning out of the way
    set_grads(params, 1)
    with CostLedger() as ledger:
        opt.step()
    staged = sum(b.numel for b in opt.plan.buckets)  # padding between segments included
    per = 8 if dtype == torch.float32 else 12
    assert ledger.h2d_bytes == ledger.d2h_bytes == per * staged


def test_default_kernel_is_fused_on_cuda_and_torchs_elsewhere() -> None:
    from megatron_flat.optim.offload_adamw import kernel_name, resolve_kernel

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_kernel({"foreach": None, "fused": None}, cuda) == {"foreach": None,
                                                                     "fused": True}
    assert resolve_kernel({"foreach": None, "fused": None}, cpu) == {"foreach": None,
                                                                    "fused": None}
    # An explicit choice is torch's to resolve, as given.
    assert resolve_kernel({"foreach": True, "fused": None}, cuda) == {"foreach": True,
                                                                     "fused": None}
    assert resolve_kernel({"foreach": None, "fused": False}, cuda)["fused"] is False
    names = {(f, fu, d.type): kernel_name(resolve_kernel({"foreach": f, "fused": fu}, d), d)
             for f in (None, True, False) for fu in (None, True) for d in (cuda, cpu)
             if not (f and fu)}
    assert names[(None, None, "cuda")] == "fused" and names[(None, None, "cpu")] == "single"
    assert names[(True, None, "cpu")] == "foreach" and names[(False, None, "cuda")] == "single"
    assert names[(None, True, "cpu")] == "fused"
    params = make_params(torch.float32)
    assert OffloadStreamAdamW(params).kernels == ["single"]
    assert OffloadStreamAdamW(params, fused=True).kernels == ["fused"]


def test_megatron_keeps_a_stock_torch_adamws_kernel() -> None:
    """In Megatron the offloaded step runs the stock torch AdamW's kernel (bitwise equal to
    it); in place of another optimizer (TE's or apex's FusedAdam) OffloadStreamAdamW's
    default: fused on CUDA."""
    from megatron_flat.megatron.optimizer import _stock_kernel

    params = make_params(torch.float32)
    assert _stock_kernel(torch.optim.AdamW(params)) == {"foreach": None, "fused": None}
    assert _stock_kernel(torch.optim.AdamW(params, foreach=False)) == {"foreach": False,
                                                                      "fused": None}
    assert _stock_kernel(torch.optim.SGD(params, lr=0.1)) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_default_is_fused_and_bitwise_equal_to_unbucketed_fused_adamw(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(1000, 257), (4097,), (3,), (77, 1031)]
    params = [torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_() for s in shapes]
    refs = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, fused=True)
    opt = OffloadStreamAdamW(params, lr=1e-2, bucket_numel=40_000, num_slots=2)
    assert opt.kernels == ["fused"]
    _cuda_steps_bitwise(opt, ref_opt, params, refs, gen, 10, "exp_avg")
