"""Ring-DTP cross-entropy: vocabulary projection + loss without ever holding N x V logits.

:func:`ring_dtp_cross_entropy` is the entry point; :class:`RingDTPCrossEntropy` the
autograd Function behind it (architecture.md §2.2). Nothing here imports Megatron: a Megatron
output layer calls it with its vocab-sharded weight over the tensor-parallel group, each
rank passing its own sequence-parallel tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

import torch
import torch.distributed as dist

from megatron_flat.runtime.ledger import mark_host
from megatron_flat.vocab import plan as planning
from megatron_flat.vocab.online_lse import (
    LSEState,
    accumulation_dtype,
    cross_entropy,
    init_state,
    logsumexp,
    merge,
)
from megatron_flat.vocab.plan import (
    IGNORE_INDEX,
    RingPlan,
    describe_rank,
    make_plan,
    relay_piece_rows,
)
from megatron_flat.vocab.ring import Ring
from megatron_flat.vocab.strips import fold_shard, grad_shard

__all__ = ["RingDTPCrossEntropy", "ring_dtp_cross_entropy"]

_W, _STATE = 0, 1  # hop channels: the big tensors, and what must be computed first


# -- forward schedules ------------------------------------------------------------------


def _forward_weights(plan: RingPlan, ring: Optional[Ring], x, w, labels, acc) -> LSEState:
    """Shards circulate; this rank's state never moves. P = 1: the blocked version."""
    p, q = plan.world, plan.rank
    state = init_state(x.shape[0], x.device, acc)
    w_cur = w
    for k in range(p):
        nxt = (q - 1) % p
        hop = (ring.shift([w_cur], [w.new_empty(plan.rows[nxt], plan.hidden)], _W)
               if k < p - 1 else None)
        state = fold_shard(state, x, w_cur, labels, plan.starts[q], plan.blocks(q),
                           plan.tile_rows(q))
        if hop is not None:
            (w_cur,), q = hop.wait(), nxt
    return state


def _forward_activations(plan: RingPlan, ring: Ring, x, w, labels, acc) -> LSEState:
    """(tokens, labels) circulate; partial states follow them, one return hop at the end.

    At step k this rank holds batch ``s = rank - k``; it folds its own shard into a fresh
    state while the batch's partial state (folded by ranks s .. rank-1) is still arriving,
    then merges the two (states are O(N), so the merge is free) and passes it on. The
    state sent at step P-1 is complete and goes to its owner: that is the return hop.
    """
    p, r, n = plan.world, plan.rank, plan.n_tokens
    s, x_cur, lab_cur = r, x, labels
    state_hop = None
    for k in range(p):
        prv = (s - 1) % p
        data_hop = (ring.shift([x_cur, lab_cur],
                               [x.new_empty(n[prv], plan.hidden), labels.new_empty(n[prv])], _W)
                    if k < p - 1 else None)
        local = fold_shard(init_state(n[s], x.device, acc), x_cur, w, lab_cur,
                           plan.starts[r], plan.blocks(r), plan.tile_rows(r))
        if state_hop is not None:
            (packed,) = state_hop.wait()
            local = merge(LSEState.unpack(packed), local)
        state_hop = ring.shift([local.pack()], [torch.empty(3, n[prv], dtype=acc,
                                                            device=x.device)], _STATE)
        del local
        if data_hop is not None:
            (x_cur, lab_cur), s = data_hop.wait(), prv
    (packed,) = state_hop.wait()
    return LSEState.unpack(packed)


# -- backward schedules -----------------------------------------------------------------


class _TravellingSum:
    """The gradient that travels the ring (weights: shard gradients; activations: dX).

    At step k this rank adds its contribution for item ``i = rank - k`` (a shard or a token
    batch, whose owner is rank i). Step 0 is its own item: the contribution goes straight
    into ``home`` (the final gradient, e.g. Megatron's ``main_grad``). Steps 1 .. P-1 add into
    one relay buffer (zeros at step 1, then the partial sum of ranks i+1 .. rank-1, received
    in place) that is passed on after each step; after step P-1 what arrives is this rank's
    own item, summed over every other rank, and is added to ``home``. One buffer of the
    largest item plus a relay slot (1/``RELAY_PIECES`` of it) is in flight, never more.
    """

    def __init__(self, plan: RingPlan, ring: Ring, home: torch.Tensor, sizes, width: int):
        self.plan, self.ring, self.home, self.sizes = plan, ring, home, sizes
        self.buffer = torch.zeros(max(sizes), width, dtype=home.dtype, device=home.device)
        self.piece_rows = relay_piece_rows(sizes)
        self.pending = None

    def target(self, k: int, item: int) -> torch.Tensor:
        return self.home if k == 0 else self.buffer[: self.sizes[item]]

    def arrived(self) -> None:
        """Make the compute stream wait for the relay still arriving (if any)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def pass_on(self, item: int) -> None:
        """After this rank's step on ``item`` (k >= 1): relay the sum to the next rank and
        take the previous rank's sum for ``item - 1`` (this rank's next item) in its place."""
        self.arrived()
        nxt = (item - 1) % self.plan.world
        self.pending = self.ring.relay(self.buffer, self.sizes[item], self.sizes[nxt],
                                       self.piece_rows, _STATE)

    def finish(self) -> None:
        self.arrived()
        self.home.add_(self.buffer[: self.sizes[self.plan.rank]])
        self.buffer = None


def _backward_blocked(plan: RingPlan, x, w, labels, lse, coef, dw_home):
    """P = 1: every block's dW is written once, straight into the input-dtype gradient
    (or accumulated into ``dw_home``, Megatron's ``main_grad``, when given)."""
    acc, q = lse.dtype, plan.rank
    dx = torch.zeros(x.shape[0], plan.hidden, dtype=acc, device=x.device) if plan.needs_dx else None
    direct = plan.needs_dw and dw_home is None
    dw = torch.zeros_like(w) if direct else dw_home if plan.needs_dw else None
    grad_shard(x, w, labels, lse, coef, plan.starts[q], plan.blocks(q), dx, dw, dw_direct=direct,
               tile_rows=plan.tile_rows(q))
    return dx, dw


def _backward_weights(plan: RingPlan, ring: Ring, x, w, labels, lse, coef, dw_home):
    """Shards circulate again; their fp32 gradients travel with them (:class:`_TravellingSum`).

    Step k: post the next shard's hop, then compute this rank's tokens' strips for shard q
    (overlapping the hop and the gradient relay still arriving) into dX (local) and into
    shard q's travelling gradient, which is then relayed on. The relay after step P-1 brings
    this rank's shard gradient home.
    """
    p, q, acc = plan.world, plan.rank, lse.dtype
    dx = torch.zeros(x.shape[0], plan.hidden, dtype=acc, device=x.device) if plan.needs_dx else None
    dw = travel = None
    if plan.needs_dw:
        dw = dw_home if dw_home is not None else torch.zeros(
            plan.rows[q], plan.hidden, dtype=acc, device=x.device)
        travel = _TravellingSum(plan, ring, dw, plan.rows, plan.hidden)
    w_cur = w
    for k in range(p):
        nxt = (q - 1) % p
        w_hop = (ring.shift([w_cur], [w.new_empty(plan.rows[nxt], plan.hidden)], _W)
                 if k < p - 1 else None)
        grad_shard(x, w_cur, labels, lse, coef, plan.starts[q], plan.blocks(q), dx,
                   travel.target(k, q) if travel is not None else None,
                   before_write=travel.arrived if travel is not None else None,
                   tile_rows=plan.tile_rows(q))
        if travel is not None and k > 0:
            travel.pass_on(q)
        if w_hop is not None:
            (w_cur,), q = w_hop.wait(), nxt
    if travel is not None:
        travel.finish()
    return dx, dw


def _backward_activations(plan: RingPlan, ring: Ring, x, w, labels, lse, coef, dw_home):
    """(tokens, labels, lse, grad) circulate; dX sums travel with them (:class:`_TravellingSum`).

    This rank's shard gradient accumulates where the shard lives, over all P batches,
    straight into ``dw_home`` when given (no hop); each batch's dX sum travels the ring like
    the forward state and arrives home with the relay after step P-1.
    """
    p, r, n, acc = plan.world, plan.rank, plan.n_tokens, lse.dtype
    dw = None
    if plan.needs_dw:
        dw = dw_home if dw_home is not None else torch.zeros(
            w.shape[0], plan.hidden, dtype=acc, device=x.device)
    dx = travel = None
    if plan.needs_dx:
        dx = torch.zeros(n[r], plan.hidden, dtype=acc, device=x.device)
        travel = _TravellingSum(plan, ring, dx, n, plan.hidden)
    s, x_cur, lab_cur, aux_cur = r, x, labels, torch.stack((lse, coef))
    for k in range(p):
        prv = (s - 1) % p
        data_hop = (ring.shift(
            [x_cur, lab_cur, aux_cur],
            [x.new_empty(n[prv], plan.hidden), labels.new_empty(n[prv]),
             aux_cur.new_empty(2, n[prv])], _W) if k < p - 1 else None)
        grad_shard(x_cur, w, lab_cur, aux_cur[0], aux_cur[1], plan.starts[r], plan.blocks(r),
                   travel.target(k, s) if travel is not None else None, dw,
                   before_write=travel.arrived if travel is not None else None,
                   tile_rows=plan.tile_rows(r))
        if travel is not None and k > 0:
            travel.pass_on(s)
        if data_hop is not None:
            (x_cur, lab_cur, aux_cur), s = data_hop.wait(), prv
    if travel is not None:
        travel.finish()
    return dx, dw


def _main_grad(weight: torch.Tensor, acc: torch.dtype) -> Optional[torch.Tensor]:
    """Megatron DDP's gradient buffer for ``weight`` when the shard's gradient can accumulate
    there in place (same shape, device and accumulation dtype), else None."""
    home = getattr(weight, "main_grad", None)
    if (not isinstance(home, torch.Tensor) or home.shape != weight.shape
            or home.dtype != acc or home.device != weight.device):
        return None
    return home


# -- autograd ---------------------------------------------------------------------------


class RingDTPCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``hidden @ W.T`` with ``W`` vocab-sharded over a ring of P.

    Inputs (this rank): ``hidden [N_r, H]``, ``weight [V/P, H]`` (its shard, rows
    ``plan.starts[r] ..``, padding rows past ``vocab_size`` ignored), ``labels [N_r]``,
    ``active [N_r]`` bool (False = masked or ignored). Outputs: loss ``[N_r]`` in the
    accumulation dtype (fp32; fp64 for fp64 inputs), 0 where not active, and ``top1 [N_r]``
    bool (not differentiable): active and the label's logit is the row's largest (a tie
    counts), from the online state at no extra cost. ``N_r`` may differ
    between ranks (any N_r >= 0); the shards may differ in rows.

    Communication, forward (``plan.mode``):
      * ``weights``: P-1 hops of one shard (``V/P x H`` input-dtype elements) to rank+1,
        each overlapped with the current shard's strips. States never move: no return hop.
      * ``activations``: P-1 hops of (``N x H`` tokens, ``N`` labels) overlapped with the
        strips, and P hops of the ``3 x N`` partial state, the last one the return hop.
      * ``blocked`` (P = 1): none.
      (Before the Function runs, :func:`ring_dtp_cross_entropy` all-gathers one row of
      integers per rank: sizes, vocab ranges and the label range; see :mod:`.plan`.)

    Communication, backward:
      * ``weights``: P-1 hops of one shard again, and P-1 relays of a shard's fp32
        gradient sum (``V/P x H``), the last one taking this rank's finished sum home.
      * ``activations``: P-1 hops of (tokens, labels, lse and grad: ``N x H + 3N``) and P-1
        relays of a batch's fp32 dX sum (``N x H``), the last one home. Shard gradients
        accumulate where the shard lives.
      * ``blocked``: none.
      A relay goes in ``RELAY_PIECES`` pieces, in place (:meth:`.Ring.relay`).

    Saved for backward: the inputs themselves (no copies), ``lse = m + log z`` (``N`` fp32)
    and ``active``. Backward recomputes each strip from ``lse``:
    ``dlogits = (softmax - onehot) * grad_output`` — no logits are kept.

    Memory bound (per rank; strip = ``N x B`` accumulation-dtype elements, ``B`` =
    ``block_size`` rows, default the whole shard ``V/P`` when P > 1): one strip live
    (1.25 with half inputs: its input-dtype copy is made a quarter at a time), never
    ``N x V``; ``B < V/P`` lowers it below ``N x V/P``. Besides the strip, ``weights``:
    2 shards in flight and, in backward, dX (``N x H`` fp32), this rank's shard gradient
    (fp32 ``V/P x H``; none when the weight has Megatron's ``main_grad``: it accumulates
    there in place, strip by strip, and backward returns no shard-sized gradient) and ONE
    travelling fp32 shard-gradient sum plus its relay slot (1/``RELAY_PIECES`` of it);
    ``activations``: 2 token batches in flight and, in backward, dX, one travelling dX sum
    plus its slot, and the shard gradient (again ``main_grad`` itself when there is one).
    Each ``V/P x H`` buffer is ``H/N`` strips and each ``N x H`` one ``H/(V/P)`` strips, so
    with ``auto`` (moving the smaller operand) the buffers stay small against the strip
    when ``H << V/P``.

    Weight gradient and Megatron DDP: when ``weight`` has a ``main_grad`` of its shape in
    the accumulation dtype, every strip's ``dW`` is added there in place (as Megatron's
    fused weight-gradient accumulation does, whatever ``gradient_accumulation_fusion``
    says) and, under DDP, ``grad_added_to_main_grad`` is set; see
    :func:`_added_to_main_grad`. A ``main_grad`` of another dtype is left to DDP's hook.

    Exactness: mathematically exact cross-entropy and gradient. Numerically: logits, state
    and all accumulation over strips, shards and ranks are fp32 (fp64 for fp64 inputs),
    summed in a different order than a dense implementation, so results match a dense
    fp32 computation to fp32 reduction-order tolerance (not bitwise). Half-precision inputs:
    logits come out of an input-dtype matmul (fp32 inside; on CUDA written as fp32
    directly where ``torch.mm(out_dtype=)`` allows), the logit gradient is rounded once to
    the input dtype for the backward matmuls, as in a dense half-precision model (without
    ``out_dtype``, each quarter-strip's matmul product is also rounded to the input dtype
    before it is added to the fp32 accumulator); grads are returned in the input dtypes.

    Every rank of the group must call forward and backward (collectives inside); in
    particular, if any rank's inputs require grad, every rank's must (a rank whose loss does
    not require grad never runs backward, and its peers would wait for it).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, active, plan: RingPlan, ring: Optional[Ring]):
        acc = accumulation_dtype(hidden.dtype)
        x, w = hidden.detach(), weight.detach().contiguous()
        schedule = _forward_activations if plan.mode == "activations" else _forward_weights
        state = schedule(plan, ring, x, w, labels, acc)
        zero = torch.zeros((), dtype=acc, device=x.device)
        loss = torch.where(active, cross_entropy(state), zero)
        lse = logsumexp(state)
        # Top-1: the label's logit is the largest (ties count as top-1), read off the state.
        top1 = active & (state.t >= state.m)
        del state
        ctx.save_for_backward(hidden, weight, labels, active, lse)
        ctx.plan, ctx.ring = plan, ring
        ctx.mark_non_differentiable(top1)
        return loss, top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_top1=None):
        hidden, weight, labels, active, lse = ctx.saved_tensors
        plan, ring = ctx.plan, ctx.ring
        x, w = hidden.detach(), weight.detach().contiguous()
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        coef = torch.where(active, grad_loss.to(lse.dtype), zero)
        home = _main_grad(weight, lse.dtype) if ctx.needs_input_grad[1] else None
        if ring is None:
            dx, dw = _backward_blocked(plan, x, w, labels, lse, coef, home)
        elif plan.mode == "activations":
            dx, dw = _backward_activations(plan, ring, x, w, labels, lse, coef, home)
        else:
            dx, dw = _backward_weights(plan, ring, x, w, labels, lse, coef, home)
        dx = dx.to(hidden.dtype) if ctx.needs_input_grad[0] and dx is not None else None
        if home is not None:
            dw = _added_to_main_grad(weight)
        else:
            dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] and dw is not None else None
        return dx, dw, None, None, None, None


def _added_to_main_grad(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """What backward returns for a weight whose gradient went into ``main_grad``.

    As Megatron's fused weight-gradient accumulation does: under Megatron DDP (the weight
    has ``grad_added_to_main_grad``) flag it and return a zero gradient, so DDP's hook still
    runs (it marks the bucket ready) but adds nothing of ours again (a tied embedding's
    ``zero_out_wgrad`` makes the hook add the embedding lookup's gradient, which autograd
    summed with these zeros). The zeros are one broadcast scalar, not a shard-sized buffer.
    Without DDP: None.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


# -- entry point ------------------------------------------------------------------------


def _local_error(hidden, weight_shard, labels, loss_mask) -> Optional[str]:
    """What is wrong with this rank's inputs alone, or None."""
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight_shard, labels)):
        return "hidden, weight_shard and labels must be tensors"
    if hidden.dim() < 1 or weight_shard.dim() != 2:
        return (f"hidden must be [..., H] and weight_shard [V/P, H]; got "
                f"{tuple(hidden.shape)} and {tuple(weight_shard.shape)}")
    if hidden.shape[-1] != weight_shard.shape[1]:
        return (f"hidden size {hidden.shape[-1]} does not match weight_shard "
                f"{tuple(weight_shard.shape)}")
    if not hidden.dtype.is_floating_point or weight_shard.dtype != hidden.dtype:
        return (f"hidden and weight_shard must share a float dtype, got {hidden.dtype} "
                f"and {weight_shard.dtype}")
    if labels.shape != hidden.shape[:-1]:
        return f"labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)}[:-1]"
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        return f"labels must be an integer tensor, got {labels.dtype}"
    if loss_mask is not None and loss_mask.shape != labels.shape:
        return f"loss_mask {tuple(loss_mask.shape)} must match labels {tuple(labels.shape)}"
    devices = {t.device for t in (hidden, weight_shard, labels)}
    if loss_mask is not None:
        devices.add(loss_mask.device)
    if len(devices) != 1:
        return f"all inputs must be on one device, got {sorted(map(str, devices))}"
    return None


def ring_dtp_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    mode: str = "auto",
    loss_mask: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    *,
    block_size: Optional[int] = None,
    tile_bytes: Optional[int] = None,
    debug_checks: bool = False,
    plan_key: Optional[Hashable] = None,
    return_top1: bool = False,
):
    """Per-token cross-entropy of ``hidden @ W.T`` against ``labels``; W vocab-sharded.

    Args:
        hidden: this rank's tokens ``[..., H]`` (``[N, H]`` usually), any float dtype.
        weight_shard: this rank's rows of the projection ``[V/P, H]``, same dtype.
        labels: ``[...]`` (hidden's leading shape), integer vocab ids.
        group: the ring's process group. ``None`` (or a group of one) runs the blocked
            single-device version: no collective at all. Note: None is not WORLD here;
            pass ``torch.distributed.group.WORLD`` for the whole job.
        mode: ``"weights"`` (shards circulate), ``"activations"`` (tokens circulate) or
            ``"auto"``: activations when ``N <= V/P``, else weights, ``N`` being the largest
            per-rank token count in the group (all ranks must agree; see
            :func:`.plan.resolve_mode`). Ignored when P = 1.
        loss_mask: optional, labels' shape; tokens where it is 0/False give zero loss and
            zero gradient (it is a switch, not a weight: multiply the loss yourself).
        ignore_index: label of tokens that give zero loss and zero gradient.
        vocab_start: first vocab id of this rank's shard; default the sum of the shard rows
            of lower group ranks (``rank * V/P`` for equal shards).
        vocab_size: the true, unpadded V. Shard rows at ids ``>= vocab_size`` are padding:
            they never contribute to the loss and get zero gradient. Default: the end of
            the last shard (no padding).
        block_size: vocab rows per strip (keyword only). Default: ``DEFAULT_BLOCK_SIZE``
            for P = 1, the whole shard for P > 1. Smaller strips lower the peak further.
        tile_bytes: token tiles (keyword only): each strip is computed a tile of tokens at a
            time, as many as fit ``tile_bytes`` (accumulation dtype; strips are narrowed to
            fit one token when even that would not), so the live strip no longer grows with
            N. Default None: whole strips. Every rank of the ring must pass the same value.

    Returns: loss ``[...]`` (labels' shape), fp32 (fp64 for fp64 inputs); differentiable
    w.r.t. ``hidden`` and ``weight_shard`` (the shard's gradient sums all ranks' tokens).
    With ``return_top1``: ``(loss, top1)``, ``top1`` bool of labels' shape: the token is
    active and its label's logit is the largest of its row (a tie counts), as a top-1
    accuracy or MTP acceptance count needs, without any logits.

    Raises ValueError, on every rank of the group alike and before any ring hop, when some
    rank's inputs are malformed, ranks disagree on H/dtype/mode/vocab_size/block_size/tile_bytes or
    the shards do not tile ``[0, vocab_size)``. The check costs one all-gather of a few
    integers per rank, issued first: a rank that found a problem still joins it, so every
    rank learns of the problem and raises instead of leaving its neighbours waiting in a
    hop. Reading the gathered table is a host sync. ``plan_key``: a hashable equal on every
    rank of the ring for this call, that determines every rank's shapes and settings (the
    global batch shape, say): the plan is kept under it, and a later call with the same key
    neither gathers nor waits for the device. An active label (not masked, not
    ``ignore_index``) outside ``[0, vocab_size)`` (in the padded rows, say) makes its
    token's loss NaN.

    ``debug_checks=True`` (``--flat-debug-checks``) gathers and checks on every call and
    raises for such labels instead, naming the ranks and ranges (reading the labels' range
    is a host sync).
    """
    error = _local_error(hidden, weight_shard, labels, loss_mask)
    ring = None
    if group is not None and dist.get_world_size(group) > 1:
        device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
        ring = Ring(group, device)
    row = None
    active = None
    if error is None:
        labels = labels.to(torch.int64)  # one label dtype on every rank of the ring
        active = labels != ignore_index
        if loss_mask is not None:
            active = active & (loss_mask != 0)
        try:
            row = describe_rank(
                hidden.reshape(-1, hidden.shape[-1]), weight_shard, labels.reshape(-1),
                active.reshape(-1), mode=mode, vocab_start=vocab_start,
                vocab_size=vocab_size, block_size=block_size, check_labels=debug_checks,
                tile_bytes=tile_bytes,
            )
        except (TypeError, ValueError) as exc:
            error = str(exc)
    rank = ring.rank if ring is not None else 0
    key = None
    if plan_key is not None and not debug_checks:
        key = (id(group) if ring is not None else None, ignore_index, plan_key)
    cached = _cached(key, group) if key is not None else None
    if cached is not None:
        if error is not None:
            raise ValueError(f"ring_dtp_cross_entropy: {error}")
        kept_row, plan = cached
        if not torch.equal(kept_row, row):
            # Every rank found plan_key cached and skips the gather: this rank cannot ask
            # its peers about its new shapes; the caller broke plan_key's contract.
            raise ValueError(
                f"ring_dtp_cross_entropy: plan_key {plan_key!r} was planned for other shapes "
                f"or settings on this rank ({kept_row.tolist()} then, {row.tolist()} now); "
                "plan_key must determine every rank's shapes")
        _PLANS.move_to_end(key)
    else:
        if row is None:
            row = planning.error_row()
        table = ring.gather_rows(row) if ring is not None else row.unsqueeze(0)
        if error is not None:
            raise ValueError(f"ring_dtp_cross_entropy: {error}")
        planning.raise_for_peer_errors(table)
        plan = make_plan(table, rank, ignore_index)
        if key is not None:
            _remember(key, group, row, plan)
    shape = labels.shape
    flat_labels, flat_active = labels.reshape(-1), active.reshape(-1)
    loss, top1 = RingDTPCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight_shard, flat_labels, flat_active, plan,
        ring,
    )
    if not debug_checks:
        # The label range, judged on the device: an active label outside [0, V) makes its
        # token's loss NaN (Megatron's NaN check then stops the run) instead of waiting for
        # the device to raise here; --flat-debug-checks raises with the ranks and ranges.
        bad = flat_active & ((flat_labels < 0) | (flat_labels >= plan.vocab_size))
        loss = torch.where(bad, torch.full((), float("nan"), dtype=loss.dtype,
                                           device=loss.device), loss)
    if return_top1:
        return loss.view(shape), top1.view(shape)
    return loss.view(shape)


# Plans by (id(group), ignore_index, plan_key), with the group itself and this rank's row of
# shapes and settings. Every rank of a ring makes the same calls with the same plan_key, so
# the caches of all ranks hold the same keys: all ranks find a plan, or none does and all
# gather. The entry holds its group so that the id cannot be reused while it is cached: a
# group destroyed and another created at the same address on one rank only (each process
# frees and allocates on its own) would otherwise find the old plan there and skip the
# gather its peers wait in.
_PLANS: "OrderedDict[tuple, tuple[object, torch.Tensor, RingPlan]]" = OrderedDict()
_PLANS_KEPT = 64


def _cached(key: tuple, group) -> Optional[tuple]:
    """``(row, plan)`` kept under ``key`` for this very ``group``, else None."""
    entry = _PLANS.get(key)
    if entry is None or entry[0] is not group:
        return None
    return entry[1], entry[2]


def _remember(key: tuple, group, row: torch.Tensor, plan: RingPlan) -> None:
    mark_host(row)  # a host-side table: comparing it later waits for no device
    _PLANS[key] = (group, row, plan)
    _PLANS.move_to_end(key)
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
