"""A plain PyTorch layer stack with Megatron-shaped boundaries [s, b, h], for SCO tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

S, B, H = 32, 2, 16  # boundary = S*B*H fp32 = 4 KiB


class Block(nn.Module):
    """Pre-norm residual MLP block: x + drop(fc2(drop(gelu(fc1(ln(x))))))."""

    def __init__(self, h: int, p: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(F.gelu(self.fc1(self.ln(x))), self.p, self.training)
        return x + F.dropout(self.fc2(y), self.p, self.training)


def make_stack(depth: int, h: int = H, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Block(h) for _ in range(depth))


def make_input(seed: int = 1, s: int = S, b: int = B, h: int = H) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, h, generator=g)


def plain(fn, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def forward(blocks: nn.ModuleList, x: torch.Tensor, ck: Callable) -> torch.Tensor:
    """Loss of the stack with every block checkpointed by ``ck(block, h)``."""
    h = x * 1.0  # a non-leaf first boundary, like an embedding output
    for block in blocks:
        h = ck(block, h)
    return h.float().square().mean()


def step(blocks: nn.ModuleList, x: torch.Tensor, ck: Callable, seed: int = 7):
    """(loss, x.grad, param grads) of one forward+backward from a fixed RNG state."""
    for p in blocks.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    loss = forward(blocks, x, ck)
    loss.backward()
    return loss.detach(), x.grad, [p.grad.clone() for p in blocks.parameters()]


def assert_bitwise(a, b) -> None:
    """Every tensor in two (loss, x.grad, grads) results is torch.equal."""
    la, xa, ga = a
    lb, xb, gb = b
    assert torch.equal(la, lb), (la, lb)
    assert torch.equal(xa, xb)
    assert len(ga) == len(gb)
    for i, (u, v) in enumerate(zip(ga, gb)):
        assert torch.equal(u, v), f"grad {i} differs (max {(u - v).abs().max().item()})"


def differs(a, b) -> bool:
    return not torch.equal(a[1], b[1]) or any(not torch.equal(u, v) for u, v in zip(a[2], b[2]))


def boundary_bytes(s: int = S, b: int = B, h: int = H) -> int:
    return s * b * h * 4


@pytest.fixture
def stack():
    """Helpers for the plain layer stack."""
    return SimpleNamespace(
        S=S,
        B=B,
        H=H,
        Block=Block,
        make_stack=make_stack,
        make_input=make_input,
        plain=plain,
        forward=forward,
        step=step,
        assert_bitwise=assert_bitwise,
        differs=differs,
        boundary_bytes=boundary_bytes,
    )
