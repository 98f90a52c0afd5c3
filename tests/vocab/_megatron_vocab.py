"""Helpers for the Ring-DTP-in-Megatron tests (``test_megatron_vocab*.py``).

Loaded by path (``importlib``) from the test modules, like ``tests/dispatch/_moe_layers.py``.

* :func:`check_against_megatron` — the integration's output module
  (``RingDTPOutputLoss``) against Megatron's own output path at one TP size: projection by
  the TP rank's weight shard, then ``tensor_parallel.vocab_parallel_cross_entropy`` (which
  overwrites its input logits in place: it gets a fresh tensor nobody else reads), the
  hidden-state gradient all-reduced over TP as the stock output layer's backward does.
  Compared: per-token loss ``[b, s]``, this rank's hidden-state gradient, this rank's
  weight-shard gradient.
* :func:`gpt_step` — a full tiny MoE GPT step through the equivalence harness with Ring-DTP
  on, against the stock single-rank model.

Tolerances. Both sides are fp32 computations of the same cross-entropy whose sums run in a
different order (strips and ring vs one softmax over the gathered shards), so they agree to
fp32 rounding: with L the largest |logit| and G the largest gradient, loss within
``32 u max(1, L)`` and gradients within ``32 u max(1, L) G`` (u = 2**-24; twice the bound
each side keeps to the float64 truth in ``conftest.py``), rtol 1e-5. bf16 inputs: both
round the logits to bf16 (Megatron materialises them in bf16, Ring-DTP rounds the logit
gradient once), so twice the half-precision bound of ``conftest.py``: loss ``4 u L``,
gradients ``16 u G`` with u = 2**-8.
"""


from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


@dataclass(frozen=True)
class Case:
    seq: int  # s (global: all TP ranks' tokens of one micro-batch)
    batch: int = 2
    hidden: int = 16
    rows: int = 6  # vocab rows per TP rank (V = tp * rows; Megatron's padded V)
    sequence_parallel: bool = True
    dtype: torch.dtype = torch.float32
    mask_every: int = 0  # loss_mask = 0 on every k-th token (0: no mask)
    logit_scale: float = 1.0


CASES = {
    "sp": Case(seq=8),
    "sp-more-tokens-than-rows": Case(seq=16, batch=3, rows=3),
    "no-sp-uneven-split": Case(seq=7, sequence_parallel=False),
    "sp-loss-mask": Case(seq=8, mask_every=3),
    "sp-bf16": Case(seq=8, dtype=torch.bfloat16),
    "sp-huge-logits": Case(seq=8, logit_scale=1e4),
}


def _problem(case: Case, tp: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    vocab = tp * case.rows
    s = (case.logit_scale / case.hidden) ** 0.5 if case.logit_scale > 1 else 1.0
    x = (torch.randn(case.seq, case.batch, case.hidden, generator=gen) * s).to(case.dtype)
    w = (torch.randn(vocab, case.hidden, generator=gen) * s).to(case.dtype)
    labels = torch.randint(0, vocab, (case.batch, case.seq), generator=gen)
    grad = torch.randn(case.batch, case.seq, generator=gen)
    mask = None
    if case.mask_every:
        mask = torch.ones(case.batch, case.seq)
        mask.view(-1)[1:: case.mask_every] = 0
    return x, w, labels, grad, mask


def megatron_side(x, w_shard, labels, grad, mask, tp_group):
    """Megatron's output layer + loss: (loss [b, s], full d hidden [s, b, H], d shard)."""
    from megatron_flat.megatron import compat

    x = x.clone().requires_grad_()
    w = w_shard.clone().requires_grad_()
    logits = torch.matmul(x, w.t())  # [s, b, V/TP]; consumed in place by the loss below
    loss = compat.vocab_parallel_cross_entropy(logits, labels.t().contiguous(), tp_group)
    loss = loss.t()  # [b, s]
    if mask is not None:
        loss = loss * mask
    loss.backward(grad)
    dx = x.grad.contiguous()
    dist.all_reduce(dx, group=tp_group)  # the stock output layer's backward (SP: + scatter)
    return loss.detach(), dx, w.grad


def check_against_megatron(case_name: str, mode: str, tp: int,
                           tile_bytes: Optional[int] = None) -> None:
    """Run one case at the current Megatron layout (TP = ``tp``) on this rank and compare."""
    from megatron.core import parallel_state

    from megatron_flat.megatron.vocab import RingDTPOutputLoss

    case = CASES[case_name]
    group = parallel_state.get_tensor_model_parallel_group()
    assert dist.get_world_size(group) == tp
    r = dist.get_rank(group)
    x, w, labels, grad, mask = _problem(case, tp, seed=len(case_name) + 7 * tp)
    w_shard = w[r * case.rows: (r + 1) * case.rows]
    want_loss, want_dx, want_dw = megatron_side(x, w_shard, labels, grad, mask, group)

    module = RingDTPOutputLoss(group, sequence_parallel=case.sequence_parallel, mode=mode,
                               tile_bytes=tile_bytes)
    if case.sequence_parallel:
        per = case.seq // tp
        mine = slice(r * per, (r + 1) * per)
        xs = x[mine].clone().requires_grad_()
        want_dx = want_dx[mine]
    else:
        xs = x.clone().requires_grad_()
    ws = w_shard.clone().requires_grad_()
    loss = module(xs, ws, labels, mask)
    assert loss.shape == (case.batch, case.seq) and loss.dtype == torch.float32
    loss.backward(grad)
    got_loss = loss.detach() if mask is None else loss.detach() * mask

    u = U[case.dtype]
    big_l = max(1.0, float(torch.matmul(x.double(), w.double().t()).abs().max()))
    big_g = max(1.0, float(want_dx.abs().max()), float(want_dw.abs().max()))
    if case.dtype == torch.float32:
        loss_tol, grad_tol, rtol = 32 * u * big_l, 32 * u * big_l * big_g, 1e-5
    else:
        loss_tol, grad_tol, rtol = 4 * u * big_l, 16 * u * big_g, 16 * u
    torch.testing.assert_close(got_loss, want_loss.float(), atol=loss_tol, rtol=rtol)
    assert xs.grad.dtype == case.dtype and ws.grad.dtype == case.dtype
    torch.testing.assert_close(xs.grad.float(), want_dx.float(), atol=grad_tol, rtol=rtol)
    torch.testing.assert_close(ws.grad.float(), want_dw.float(), atol=grad_tol, rtol=rtol)
    if mask is not None:  # masked tokens: exactly no loss, exactly no hidden gradient
        assert torch.count_nonzero(loss.detach()[mask == 0]) == 0


# --------------------------------------------------------------------------- GPT step
def ring_wrapper(mode: str = "auto", block_size: Optional[int] = None, seen: list = None,
                 tile_bytes: Optional[int] = None):
    """A harness ``wrap_model`` turning Ring-DTP on; records, per model chunk, its Ring-DTP
    module (None off the last pipeline stage), calls of it and of the stock output layer
    (must stay 0 in a step with labels), whether it is a last stage, and its output weight
    (whose gradient Ring-DTP adds to DDP's ``main_grad`` itself)."""
    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron.vocab import enable_ring_dtp, ring_dtp_output

    flat = FlatConfig(vocab=True, vocab_mode=mode,
                      **({} if block_size is None else {"vocab_block_size": block_size}),
                      **({} if tile_bytes is None else {"vocab_tile_bytes": tile_bytes}))

    def wrap(model):
        enable_ring_dtp(model, flat)
        ring = ring_dtp_output(model)
        if seen is not None:
            calls = {"stock": 0, "ring": 0}
            if ring is not None:
                model.output_layer.register_forward_pre_hook(
                    lambda *_: calls.__setitem__("stock", calls["stock"] + 1))
                ring.register_forward_pre_hook(
                    lambda *_: calls.__setitem__("ring", calls["ring"] + 1))
            weight = None
            if model.post_process:
                weight = (model.shared_embedding_or_output_weight()
                          if model.share_embeddings_and_output_weights
                          else model.output_layer.weight)
            seen.append((ring, calls, bool(model.post_process), weight))
        return model

    return wrap


def gpt_step(tiny, reference, layout_kwargs: dict, mode: str = "auto",
             block_size: Optional[int] = None, tile_bytes: Optional[int] = None):
    """Run the harness with Ring-DTP on (``tile_bytes``: FlatConfig's default when None);
    returns (result, [(ring module or None, calls, last stage, output weight)])."""
    from megatron_flat.testing.equivalence import Layout, run_layout

    seen: list = []
    result = run_layout(tiny, Layout(**layout_kwargs), reference,
                        wrap_model=ring_wrapper(mode, block_size, seen, tile_bytes))
    return result, seen
