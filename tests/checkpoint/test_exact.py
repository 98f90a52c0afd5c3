"""SCO is bitwise plain non-reentrant checkpointing, whatever the budget, order or inputs."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from megatron_flat.checkpoint import SelectiveCheckpointOffload
from megatron_flat.runtime import HostPool

DEPTH = 6


def _budget(kind: str, stack) -> int:
    return {"zero": 0, "partial": 3 * stack.boundary_bytes(), "unlimited": 1 << 24}[kind]


@pytest.mark.filterwarnings("ignore:SCO. host pool full")
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("budget", ["zero", "partial", "unlimited"])
def test_equal_to_plain_checkpoint(stack, budget, prefetch):
    blocks, x = stack.make_stack(DEPTH), stack.make_input()
    ref = stack.step(blocks, x, stack.plain)
    sco = SelectiveCheckpointOffload(_budget(budget, stack), prefetch=prefetch, device="cpu")
    got = stack.step(blocks, x, sco.checkpoint)
    stack.assert_bitwise(ref, got)

    s = sco.stats
    assert s.checkpoints == DEPTH
    offloaded = {"zero": 0, "partial": 3, "unlimited": DEPTH}[budget]
    assert s.boundaries_offloaded == offloaded
    assert s.boundaries_kept == DEPTH - offloaded
    assert s.bytes_offloaded == offloaded * stack.boundary_bytes()
    # every host byte is back in the pool and no restored boundary outlives backward
    assert s.host_bytes_in_use == 0 and s.restored_on_device == 0
    if offloaded:
        assert s.max_restored_on_device == min(prefetch + 1, offloaded)
        assert s.prefetch_hits + s.reloads_on_demand == offloaded


def test_dropout_is_active(stack):
    """The exactness tests would be vacuous if dropout drew no random numbers."""
    blocks, x = stack.make_stack(DEPTH), stack.make_input()
    a = stack.step(blocks, x, stack.plain, seed=7)
    b = stack.step(blocks, x, stack.plain, seed=8)
    assert not torch.equal(a[0], b[0])


@pytest.mark.parametrize("order", ["fifo", "lifo", "1f1b", "layerwise"])
def test_microbatches_interleaved(stack, order):
    """Several forwards alive before their backwards (pipeline microbatches).

    ``layerwise`` runs the microbatches' forwards layer by layer, alternating: a region's
    predecessor in time is then another microbatch's, and prefetching by call order
    would park that microbatch's boundaries on the device until its own backward.
    """
    blocks = stack.make_stack(DEPTH)
    inputs = [stack.make_input(seed=10 + i) for i in range(3)]
    schedule = {
        "fifo": ["F0", "F1", "F2", "B0", "B1", "B2"],
        "lifo": ["F0", "F1", "F2", "B2", "B1", "B0"],
        "1f1b": ["F0", "F1", "B0", "F2", "B1", "B2"],
        "layerwise": ["F*", "B0", "B1", "B2"],
    }[order]

    def run(ck):
        for p in blocks.parameters():
            p.grad = None
        torch.manual_seed(3)
        xs = [x.clone().requires_grad_() for x in inputs]
        losses = {}
        for op in schedule:
            if op == "F*":
                hs = [x * 1.0 for x in xs]
                for block in blocks:
                    hs = [ck(block, h) for h in hs]
                losses = {i: h.float().square().mean() for i, h in enumerate(hs)}
                del hs
                continue
            i = int(op[1])
            if op[0] == "F":
                losses[i] = stack.forward(blocks, xs[i], ck)
            else:
                losses.pop(i).backward()
        return [x.grad for x in xs] + [p.grad for p in blocks.parameters()]

    ref = run(stack.plain)
    # room for 1.5 microbatches: the pool fills, drains in backward, refills in 1f1b
    budget = DEPTH * 3 // 2 * stack.boundary_bytes()
    sco = SelectiveCheckpointOffload(budget, prefetch=1, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(sco.checkpoint)
    for u, v in zip(ref, got):
        assert torch.equal(u, v)
    s = sco.stats
    assert s.max_restored_on_device <= 2
    assert s.host_bytes_in_use == 0 and s.restored_on_device == 0
    # chains follow dataflow: each microbatch misses at most its first offloaded region
    assert s.reloads_on_demand <= 3
    assert s.prefetch_hits >= s.boundaries_offloaded - 3


def _poison(pool: HostPool) -> None:
    """Overwrite every byte of the pool through public API (a zero-size acquire is a view)."""
    whole = pool.acquire(0, torch.uint8)
    storage = whole.untyped_storage()
    torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)).fill_(0x7F)


def test_reload_reads_the_host_copy(stack):
    """Corrupting the host copies corrupts the gradients: backward really reads them.

    This is also what makes the exactness tests able to fail.
    """
    blocks, x = stack.make_stack(DEPTH), stack.make_input()
    ref = stack.step(blocks, x, stack.plain)
    sco = SelectiveCheckpointOffload(1 << 24, device="cpu")
    for p in blocks.parameters():
        p.grad = None
    xg = x.clone().requires_grad_()
    torch.manual_seed(7)
    loss = stack.forward(blocks, xg, sco.checkpoint)
    sco.synchronize()  # the offloads are done: what is poisoned now is what backward reads
    _poison(sco.pool)
    loss.backward()
    got = (loss.detach(), xg.grad, [p.grad.clone() for p in blocks.parameters()])
    assert torch.equal(ref[0], got[0])  # the forward was fine
    assert stack.differs(ref, got)


@pytest.mark.inline_copies(reason="device storage freed when offloads finish at issue")
def test_device_copies_released_after_offload(stack):
    """Intermediate boundaries' device storage is freed in forward; backward uses the host."""

    def run(ck):
        refs = []

        def tracking(block, h):
            out = ck(block, h)
            refs.append(weakref.ref(out.untyped_storage()))
            return out

        blocks, x = stack.make_stack(DEPTH), stack.make_input()
        for p in blocks.parameters():
            p.grad = None
        xg = x.clone().requires_grad_()
        torch.manual_seed(7)
        loss = stack.forward(blocks, xg, tracking)
        gc.collect()
        alive = [r() is not None for r in refs[:-1]]  # the last output feeds the loss
        loss.backward()
        return alive, (loss.detach(), xg.grad, [p.grad.clone() for p in blocks.parameters()])

    alive_plain, ref = run(stack.plain)
    sco = SelectiveCheckpointOffload(1 << 24, device="cpu")
    alive_sco, got = run(sco.checkpoint)
    assert all(alive_plain)  # plain checkpoint holds every boundary on the device
    assert not any(alive_sco)  # SCO holds only host copies
    stack.assert_bitwise(ref, got)


def test_inputs_overwritten_after_forward(stack):
    """The caller keeps every boundary and overwrites it after the forward.

    Plain checkpoint refuses, as torch does for modified saved inputs; so does SCO, for
    boundaries kept on the device and for offloaded ones alike (on a GPU the offload copy
    may still be reading the tensor when it is overwritten: never a silent wrong answer).
    """
    blocks, x = stack.make_stack(DEPTH), stack.make_input()

    def run(ck):
        for p in blocks.parameters():
            p.grad = None
        held = []

        def holding(block, h):
            held.append(h)
            return ck(block, h)

        xg = x.clone().requires_grad_()
        torch.manual_seed(7)
        loss = stack.forward(blocks, xg, holding)
        with torch.no_grad():
            for h in held:
                h.fill_(123.0)
        loss.backward()
        return loss.detach(), xg.grad, [p.grad.clone() for p in blocks.parameters()]

    with pytest.raises(RuntimeError, match=r"offloaded by SCO\) is at version"):
        run(SelectiveCheckpointOffload(1 << 24, device="cpu").checkpoint)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(stack.plain)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(SelectiveCheckpointOffload(0, device="cpu").checkpoint)


def test_pool_exhausted_mid_forward(stack):
    """Another user of the pool takes its free space halfway through the forward."""
    blocks, x = stack.make_stack(DEPTH), stack.make_input()
    ref = stack.step(blocks, x, stack.plain)
    pool = HostPool(DEPTH * stack.boundary_bytes())
    sco = SelectiveCheckpointOffload(None, pool=pool, device="cpu")
    grabbed = []

    def grab(module, args):
        if not grabbed:  # forward only (the hook fires again in the recompute)
            grabbed.append(pool.acquire((pool.free_bytes,), torch.uint8))

    handle = blocks[DEPTH // 2].register_forward_pre_hook(grab)
    with pytest.warns(UserWarning, match="host pool full") as record:
        got = stack.step(blocks, x, sco.checkpoint)
    handle.remove()
    stack.assert_bitwise(ref, got)
    assert len([w for w in record if "host pool full" in str(w.message)]) == 1
    s = sco.stats
    # boundaries are saved before the block runs, so the grab lands after DEPTH//2 + 1
    assert s.boundaries_offloaded == DEPTH // 2 + 1
    assert s.boundaries_kept == DEPTH - s.boundaries_offloaded

    # the space comes back: the next step offloads everything, and warns no more
    pool.release(grabbed[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = stack.step(blocks, x, sco.checkpoint)
    stack.assert_bitwise(ref, got)
    assert sco.stats.boundaries_offloaded == s.boundaries_offloaded + DEPTH


def test_retain_graph_and_autograd_grad(stack):
    blocks, x = stack.make_stack(DEPTH), stack.make_input()

    def run(ck):
        for p in blocks.parameters():
            p.grad = None
        xg = x.clone().requires_grad_()
        torch.manual_seed(7)
        loss = stack.forward(blocks, xg, ck)
        (gx,) = torch.autograd.grad(loss, xg, retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()
        return [gx, xg.grad] + [p.grad for p in blocks.parameters()]

    ref = run(stack.plain)
    sco = SelectiveCheckpointOffload(1 << 24, device="cpu")
    got = run(sco.checkpoint)
    for u, v in zip(ref, got):
        assert torch.equal(u, v)
    gc.collect()
    assert sco.stats.host_bytes_in_use == 0  # kept while the graph was retained, then freed
    assert sco.stats.reloads_on_demand + sco.stats.prefetch_hits == 3 * DEPTH


def test_argument_kinds(stack):
    """kwargs, non-tensor args, containers, no-grad inputs, aliasing inputs."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    base = torch.randn(6, 8)

    def fn(a, a_again, a_rows, a_t, k, tag, *, mask, pair, cfg, none=None):
        assert tag == "t" and none is None and cfg["n"] == 2
        assert a_again.data_ptr() == a.data_ptr()  # aliasing survives the round trip
        y = torch.nn.functional.dropout(a @ w, 0.2) * mask + a_rows.sum() + a_t.t() * k
        return (y * pair[0]).tanh() + pair[1] * cfg["scale"], cfg["n"]

    def run(ck):
        w.grad = None
        a = (base * 1.0).requires_grad_()
        mask = (torch.arange(8) % 3 != 0).float()  # no grad
        g = torch.Generator().manual_seed(2)
        pair = [torch.full((6, 8), 0.5), torch.randn(6, 8, generator=g)]
        pair[1].requires_grad_()
        cfg = {"n": 2, "scale": torch.tensor(3.0, requires_grad=True)}
        torch.manual_seed(5)
        out, n = ck(fn, a, a, a[1:4], a.t(), 2.0, "t", mask=mask, pair=pair, cfg=cfg)
        assert n == 2
        out.square().sum().backward()
        return [a.grad, w.grad, pair[1].grad, cfg["scale"].grad]

    ref = run(lambda f, *a, **k: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False, **k))
    sco = SelectiveCheckpointOffload(1 << 20, device="cpu")
    got = run(sco.checkpoint)
    for u, v in zip(ref, got):
        assert torch.equal(u, v)
    s = sco.stats
    # a, a, a[1:4], a.t() share one span: a's 192 bytes copied once
    assert s.bytes_offloaded == 6 * 8 * 4 + 8 * 4 + 2 * 6 * 8 * 4 + 4
    assert s.tensors_offloaded == 8 and s.tensors_skipped == 0


def test_grad_disabled_and_nested(stack):
    blocks, x = stack.make_stack(2), stack.make_input()
    sco = SelectiveCheckpointOffload(1 << 24, device="cpu")
    with torch.no_grad():
        y = sco.checkpoint(blocks[0], x)
    assert y.shape == x.shape and not y.requires_grad
    assert sco.stats.checkpoints == 0

    def outer(ck):
        return lambda block, h: ck(lambda t: ck(block, t) * 2.0, h)

    ref = stack.step(blocks, x, outer(stack.plain))
    with pytest.warns(UserWarning, match="other saved-tensor hooks"):
        got = stack.step(blocks, x, outer(sco.checkpoint))
    stack.assert_bitwise(ref, got)
    assert sco.stats.plain_fallbacks >= 2 and sco.stats.checkpoints == 2


def test_rejects_reentrant_and_bad_options():
    sco = SelectiveCheckpointOffload(0, device="cpu")
    with pytest.raises(ValueError):
        sco.checkpoint(lambda t: t, torch.ones(1), use_reentrant=True)
    with pytest.raises(ValueError):
        SelectiveCheckpointOffload(0, prefetch=-1, device="cpu")
    with pytest.raises(ValueError):
        SelectiveCheckpointOffload(None, device="cpu")
    with pytest.raises(ValueError):
        SelectiveCheckpointOffload(10, pool=HostPool(10), device="cpu")


def test_offload_policy(stack):
    """Only tensors on SCO's device (and chosen by ``offload=``) go to the host."""
    blocks, x = stack.make_stack(3), stack.make_input()
    ref = stack.step(blocks, x, stack.plain)
    other = SelectiveCheckpointOffload(1 << 20, device="cuda")  # CPU tensors are not its device
    stack.assert_bitwise(ref, stack.step(blocks, x, other.checkpoint))
    assert other.stats.tensors_offloaded == 0 and other.stats.tensors_skipped == 3
    calls = []

    def every_other(t):
        calls.append(t.shape)
        return len(calls) % 2 == 1

    picky = SelectiveCheckpointOffload(1 << 20, offload=every_other, device="cpu")
    stack.assert_bitwise(ref, stack.step(blocks, x, picky.checkpoint))
    assert picky.stats.tensors_offloaded == 2 and picky.stats.tensors_skipped == 1


def test_input_without_grad(stack):
    """The first boundary is data that requires no grad; parameters still get theirs."""
    blocks, x = stack.make_stack(3), stack.make_input()

    def run(ck):
        for p in blocks.parameters():
            p.grad = None
        torch.manual_seed(7)
        h = x
        for block in blocks:
            h = ck(block, h)
        h.square().mean().backward()
        return [p.grad for p in blocks.parameters()]

    ref = run(stack.plain)
    sco = SelectiveCheckpointOffload(1 << 20, device="cpu")
    for u, v in zip(ref, run(sco.checkpoint)):
        assert torch.equal(u, v)
    assert x.grad is None and sco.stats.boundaries_offloaded == 3


@pytest.mark.parametrize("between", ["residual", "norm", "dropout"])
def test_prefetch_whatever_sits_between_regions(stack, between):
    """``h = h + checkpoint(f, h)`` (or a norm / dropout between regions): no region's input
    is the previous region's output, yet every boundary is prefetched (none on demand)."""
    blocks, x = stack.make_stack(8), stack.make_input()
    norm = torch.nn.LayerNorm(x.shape[-1])

    def forward(ck):
        for p in list(blocks.parameters()) + list(norm.parameters()):
            p.grad = None
        h = x.clone().requires_grad_()
        torch.manual_seed(7)
        inp = h
        for block in blocks:
            out = ck(block, h)
            if between == "residual":
                h = h + out
            elif between == "norm":
                h = norm(out)
            else:
                h = torch.nn.functional.dropout(out, p=0.1, training=True)
        loss = h.square().mean()
        loss.backward()
        return loss.detach(), inp.grad, [p.grad.clone() for p in blocks.parameters()]

    ref = forward(stack.plain)
    sco = SelectiveCheckpointOffload(1 << 24, prefetch=1, device="cpu")
    stack.assert_bitwise(ref, forward(sco.checkpoint))
    s = sco.stats
    assert s.boundaries_offloaded == 8 and s.reloads_on_demand == 0
    assert s.prefetch_hits == 8 and s.max_restored_on_device <= 2
