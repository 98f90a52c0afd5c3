"""OffloadStreamAdamW is bitwise equal to torch.optim.AdamW with the same kernel choice.

Every run trains two copies side by side for 20 steps on identical gradients — the
reference is ``torch.optim.AdamW`` on fp32 tensors (for low-precision models, on fp32
master copies whose result is then cast) — and compares parameters every step and the
full state (step, exp_avg, exp_avg_sq, master) at the end with ``torch.equal``.
Several param groups with different hyperparameters, weight decay on and off, params
skipped on some steps (grad None), bucket sizes that split parameters and one bigger
than the model, 1-3 staging slots, LR schedules, state-dict round trips.
"""

from __future__ import annotations

import io
from typing import Callable, Optional

import pytest
import torch

from megatron_flat.optim import OffloadStreamAdamW

STEPS = 20
# 0-d, empty, odd and 64-multiple sizes; 1,859 elements in all.
SHAPES = [(13, 11), (300,), (5,), (), (24, 24), (0, 3), (130,), (31, 23)]
KERNELS = {"single": dict(foreach=False), "foreach": dict(foreach=True),
           "fused": dict(fused=True), "default": {}}
BIG = 10**9


def group_spec(weight_decay: bool = True) -> list[dict]:
    """Three groups over SHAPES' indices, each with its own hyperparameters."""
    wd = (lambda x: x) if weight_decay else (lambda x: 0.0)
    return [
        dict(idx=[0, 1, 2], lr=1e-2, weight_decay=wd(0.1)),
        dict(idx=[3, 4, 5], lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
        dict(idx=[6, 7], weight_decay=wd(0.05)),
    ]


def make_groups(params: list[torch.Tensor], spec: list[dict]) -> list[dict]:
    return [dict({k: v for k, v in g.items() if k != "idx"}, params=[params[i] for i in g["idx"]])
            for g in spec]


def initial_values(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def skipped(step: int, i: int) -> bool:
    """Param i has no grad at this step (param 7 never before step 5)."""
    return (i == 7 and step < 5) or (i in (1, 4) and step % 4 == 3)


class Pair:
    """The reference AdamW (fp32) and OffloadStreamAdamW (params of ``dtype``)."""

    def __init__(self, *, dtype=torch.float32, kernel="single", bucket_numel=BIG,
                 num_slots=2, weight_decay=True, seed=0):
        values = initial_values(seed)
        self.dtype = dtype
        self.params = [v.to(dtype).requires_grad_() for v in values]
        # Reference on the fp32 values the offload optimizer starts from (its master).
        self.ref = [p.detach().float().clone().requires_grad_() for p in self.params]
        spec = group_spec(weight_decay)
        self.ref_opt = torch.optim.AdamW(make_groups(self.ref, spec), **KERNELS[kernel])
        self.opt = OffloadStreamAdamW(make_groups(self.params, spec), bucket_numel=bucket_numel,
                                      num_slots=num_slots, **KERNELS[kernel])
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step_index = 0

    def set_grads(self) -> None:
        for i, (p, r) in enumerate(zip(self.params, self.ref)):
            g = torch.randn(p.shape, generator=self.gen).to(self.dtype)
            if skipped(self.step_index, i):
                p.grad = r.grad = None
            else:
                p.grad = g
                r.grad = g.float()

    def step(self) -> None:
        self.set_grads()
        self.ref_opt.step()
        self.opt.step()
        self.step_index += 1
        self.check_params()

    def check_params(self) -> None:
        for i, (p, r) in enumerate(zip(self.params, self.ref)):
            assert torch.equal(p, r.detach().to(self.dtype)), f"param {i} after step {self.step_index}"

    def check_state(self, opt: Optional[OffloadStreamAdamW] = None,
                    params: Optional[list] = None) -> None:
        opt = opt or self.opt
        params = params or self.params
        for i, (p, r) in enumerate(zip(params, self.ref)):
            ours, theirs = opt.state.get(p, {}), self.ref_opt.state.get(r, {})
            assert bool(ours) == bool(theirs), f"param {i}: state presence"
            if not theirs:
                continue
            assert float(ours["step"]) == float(theirs["step"]), f"param {i}: step"
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours[key], theirs[key]), f"param {i}: {key}"
            if p.dtype == torch.float32:
                assert "master" not in ours
            else:
                assert torch.equal(ours["master"], r.detach()), f"param {i}: master"


def train(pair: Pair, steps: int = STEPS, after_step: Optional[Callable[[], None]] = None) -> None:
    for _ in range(steps):
        pair.step()
        if after_step is not None:
            after_step()


def splits_a_param(opt: OffloadStreamAdamW) -> bool:
    return any(len(opt.plan.segments_of(i)) > 1 for i in range(len(SHAPES)))


CASES = [
    # kernel, bucket_numel, num_slots
    ("single", 50, 1),  # < SPLIT_ALIGN: unaligned splits, no padding
    ("single", 64, 2),
    ("single", 300, 3),
    ("single", BIG, 2),
    ("foreach", 29, 2),
    ("foreach", 100, 3),
    ("foreach", BIG, 1),
    ("fused", 64, 1),
    ("fused", 192, 2),
    ("fused", BIG, 3),
    ("default", 128, 2),
]


@pytest.mark.parametrize("kernel,bucket_numel,num_slots", CASES)
def test_fp32_bitwise_equal_to_adamw(kernel, bucket_numel, num_slots) -> None:
    pair = Pair(kernel=kernel, bucket_numel=bucket_numel, num_slots=num_slots)
    if bucket_numel == BIG:
        assert len(pair.opt.plan.buckets) == 1
    else:
        assert splits_a_param(pair.opt)
    train(pair)
    pair.check_state()


@pytest.mark.parametrize("kernel", ["single", "fused"])
def test_weight_decay_off_everywhere(kernel) -> None:
    pair = Pair(kernel=kernel, bucket_numel=128, weight_decay=False)
    train(pair)
    pair.check_state()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel,bucket_numel,num_slots",
                         [("single", 100, 2), ("fused", 64, 3), ("foreach", BIG, 1)])
def test_low_precision_params_keep_an_exact_fp32_master(dtype, kernel, bucket_numel,
                                                         num_slots) -> None:
    pair = Pair(dtype=dtype, kernel=kernel, bucket_numel=bucket_numel, num_slots=num_slots)
    train(pair)
    pair.check_state()
    # The master is in host memory and really is higher precision than the param.
    p = pair.params[1]
    assert pair.opt.state[p]["master"].dtype == torch.float32
    assert not torch.equal(pair.opt.state[p]["master"], p.float())


def test_mixed_dtypes_in_one_model() -> None:
    pair = Pair(kernel="single", bucket_numel=100)
    # Reset to a model whose even params are bf16 and odd ones fp32.
    values = initial_values()
    pair.dtype = None
    pair.params = [v.to(torch.bfloat16 if i % 2 == 0 else torch.float32).requires_grad_()
                   for i, v in enumerate(values)]
    pair.ref = [p.detach().float().clone().requires_grad_() for p in pair.params]
    spec = group_spec()
    pair.ref_opt = torch.optim.AdamW(make_groups(pair.ref, spec), foreach=False)
    pair.opt = OffloadStreamAdamW(make_groups(pair.params, spec), bucket_numel=100,
                                  foreach=False)
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        for i, (p, r) in enumerate(zip(pair.params, pair.ref)):
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad, r.grad = g, g.float()
        pair.ref_opt.step()
        pair.opt.step()
        for p, r in zip(pair.params, pair.ref):
            assert torch.equal(p, r.detach().to(p.dtype))
    pair.check_state()


def lambda_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))


def onecycle_schedule(opt):
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[2e-2, 5e-3, 1e-2], total_steps=STEPS, cycle_momentum=True
    )


@pytest.mark.parametrize("make_schedule", [lambda_schedule, onecycle_schedule],
                         ids=["lambda", "onecycle"])
@pytest.mark.parametrize("kernel,dtype", [("single", torch.float32), ("fused", torch.bfloat16)])
def test_lr_schedule_mutating_param_groups(make_schedule, kernel, dtype) -> None:
    pair = Pair(kernel=kernel, dtype=dtype, bucket_numel=128, num_slots=2)
    scheds = [make_schedule(pair.ref_opt), make_schedule(pair.opt)]

    def advance() -> None:
        for s in scheds:
            s.step()
        ours = [(g["lr"], g["betas"]) for g in pair.opt.param_groups]
        theirs = [(g["lr"], g["betas"]) for g in pair.ref_opt.param_groups]
        assert ours == theirs

    train(pair, after_step=advance)
    pair.check_state()
    assert pair.opt.param_groups[0]["lr"] != 1e-2  # the schedule really moved


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel,first,second",
                         [("single", (100, 2), (64, 3)), ("single", (64, 1), (BIG, 2)),
                          ("fused", (BIG, 3), (128, 1))])
def test_state_dict_round_trip_mid_training_then_continue(dtype, kernel, first, second) -> None:
    pair = Pair(kernel=kernel, dtype=dtype, bucket_numel=first[0], num_slots=first[1])
    sched = [lambda_schedule(pair.ref_opt), lambda_schedule(pair.opt)]
    for _ in range(STEPS // 2):
        pair.step()
        for s in sched:
            s.step()
    saved = roundtrip({"optim": pair.opt.state_dict(), "sched": sched[1].state_dict(),
                       "model": [p.detach().clone() for p in pair.params]})
    # A fresh model and optimizer, another bucket size and slot count, as after a restart.
    params = [t.clone().requires_grad_() for t in saved["model"]]
    spec = group_spec()
    opt = OffloadStreamAdamW(make_groups(params, spec), bucket_numel=second[0],
                             num_slots=second[1], **KERNELS[kernel])
    new_sched = lambda_schedule(opt)
    new_sched.load_state_dict(saved["sched"])
    opt.load_state_dict(saved["optim"])
    pair.check_state(opt, params)
    pair.opt, pair.params, sched[1] = opt, params, new_sched
    for _ in range(STEPS - STEPS // 2):
        pair.step()
        for s in sched:
            s.step()
    pair.check_state()


def test_state_dict_format_matches_torch_adamw() -> None:
    pair = Pair(kernel="single", dtype=torch.bfloat16, bucket_numel=64)
    train(pair, steps=6)
    ours, theirs = pair.opt.state_dict(), pair.ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()  # never-stepped params: no entry
    for k, entry in ours["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "master"}
        p = pair.params[k]
        for key in ("exp_avg", "exp_avg_sq", "master"):
            t = entry[key]
            assert t.dtype == torch.float32 and t.shape == p.shape and t.device.type == "cpu"
            # Compact copies, not views of the host pool.
            assert t.untyped_storage().nbytes() == t.numel() * 4
        assert entry["step"].dtype == torch.float32 and entry["step"].dim() == 0
    for g_ours, g_theirs in zip(ours["param_groups"], theirs["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "params", "amsgrad", "maximize"):
            assert g_ours[key] == g_theirs[key]


def test_interchangeable_with_torch_adamw_state_dict() -> None:
    """fp32: torch AdamW → ours and ours → torch AdamW, then both continue bitwise."""
    pair = Pair(kernel="single", bucket_numel=100)
    train(pair, steps=7)
    # torch → ours: a fresh OffloadStreamAdamW picks up the reference's state.
    params = [r.detach().clone().requires_grad_() for r in pair.ref]
    opt = OffloadStreamAdamW(make_groups(params, group_spec()), bucket_numel=64, foreach=False)
    opt.load_state_dict(roundtrip(pair.ref_opt.state_dict()))
    pair.check_state(opt, params)
    # ours → torch: a fresh torch AdamW picks up ours.
    ref = [p.detach().clone().requires_grad_() for p in pair.params]
    ref_opt = torch.optim.AdamW(make_groups(ref, group_spec()), foreach=False)
    ref_opt.load_state_dict(roundtrip(pair.opt.state_dict()))
    pair.ref, pair.ref_opt, pair.params, pair.opt = ref, ref_opt, params, opt
    train(pair, steps=STEPS - 7)
    pair.check_state()
