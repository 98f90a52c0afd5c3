"""Ring-DTP as ``GPTModel``'s output layer + loss (megatron-core 0.16.1 and 0.19.x).

With Ring-DTP on, a ``GPTModel`` given labels never builds its ``[s, b, V/TP]`` logits: its
vocab-sharded output weight — exactly the ``ColumnParallelLinear`` shard Megatron holds
(``V/TP`` rows, ``V`` already padded by Megatron-LM to a multiple), or the word embedding when
``share_embeddings_and_output_weights`` — goes to :func:`ring_dtp_cross_entropy` over the
tensor-parallel group. Each rank keeps its own tokens: with sequence parallelism the
``s/TP`` rows the decoder left it (no all-gather of the hidden states), without it a
``1/TP`` slice of the replicated ones; a strip is ``(N/TP) x (V/TP)``. The per-token loss
comes back as Megatron returns it, ``[b, s]`` fp32 on every TP rank, by an all-gather of
the loss alone (N floats). With TP = 1 the op is the blocked single-device version, strips
of ``FlatConfig.vocab_block_size`` rows; with TP > 1 each rank's V/TP shard is folded in
strips of at most that many rows (at the paper's V/TP = 25,000 the default 8,192 gives 4
strips per shard, the peak the benchmark's ``ring-auto-B/4`` row measures).

How it plugs in: ``GPTModel._postprocess`` (the one place both releases turn decoder output
into logits or loss; ``forward`` and the combined-1F1B schedule plan both call it) is wrapped
once, process-wide. For a model with Ring-DTP on (:func:`enable_ring_dtp`, or every GPT model
once ``megatron_flat.install`` ran with ``--flat-vocab``) and labels given outside
inference, the wrapper

* 0.19: passes Megatron's own ``output_processor=`` hook (unless the caller passed one), so
  Megatron runs everything up to the projection as usual and then calls Ring-DTP;
* 0.16 (no such hook): runs the same processor in place of the projection + loss tail.

Every other call (no labels: logits for inference/evaluation; an inference context; a
model without Ring-DTP) runs Megatron's path unchanged. See ``compat`` for the gates.

Loss mask: when given, masked tokens get loss 0 and no gradient (Megatron's stock loss
keeps their cross-entropy, which its loss function multiplies by the mask's 0: the same
training signal). Labels equal to ``ignore_index`` (-100) likewise count as masked; any other
label outside ``[0, V)`` on an active token makes its loss NaN (``--flat-debug-checks``: an
error; Megatron's stock loss would silently use a target logit of 0).

Multi-token prediction (``mtp_num_layers``): Megatron's own MTP loop runs (the block, the
chunks, the label and mask rolls, masking, scaling, logging and ``MTPLossAutoScaler``) with
:class:`RingDTPHeads` standing in for the output layer and the loss, so every head's
projection + loss goes through the same Ring-DTP module (same ring, strips and mask rules)
and no head forms logits; 0.19's acceptance counts come from the ring's top-1 flags. Not
supported (refused when enabled): ``defer_embedding_wgrad_compute``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flat.config import FlatConfig
from megatron_flat.megatron import compat
from megatron_flat.runtime import patching
from megatron_flat.vocab import IGNORE_INDEX, ring_dtp_cross_entropy

__all__ = ["RingDTPOutputLoss", "enable_ring_dtp", "ring_dtp_output", "unsupported_settings",
           "wire_vocab"]

# Where a model's Ring-DTP module lives: a plain attribute, not a registered submodule, so
# the model's parameters, state dicts and module tree are exactly the stock model's.
_ATTR = "_flat_ring_dtp"

# torch >= 2.12 names it all_gather_single (all_gather_into_tensor warns as deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------- token split
def token_split(total: int, parts: int) -> List[int]:
    """Rows per rank when ``total`` rows split over ``parts`` ranks (first ranks +1)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class GatherTokenLoss(torch.autograd.Function):
    """Concatenate each TP rank's per-token loss rows (dim 0, the sequence) in rank order.

    Forward: one ``all_gather`` of ``max(counts) x b`` fp32 per rank — the loss only, N floats
    in all (rows padded to the largest count when the split is uneven). Backward: this rank's
    rows of the incoming gradient, no communication: Megatron's loss function runs on every
    TP rank alike, so each holds the same gradient of the full loss (the stock vocab-parallel
    cross-entropy relies on the same fact). Saves nothing. Exact (data movement only).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: Sequence[int], rank: int, group):
        width = max(counts)
        padded = local
        if local.shape[0] < width:
            padded = local.new_zeros((width,) + tuple(local.shape[1:]))
            padded[: local.shape[0]] = local
        out = local.new_empty((len(counts) * width,) + tuple(local.shape[1:]))
        _all_gather(out, padded.contiguous(), group=group)
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        if all(c == width for c in counts):
            return out
        return torch.cat([out[i * width: i * width + c] for i, c in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start: ctx.start + ctx.count], None, None, None


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group (sum).

    Megatron's ``copy_to_tensor_model_parallel_region``, here so the output path needs no
    release-specific mapping: without sequence parallelism every TP rank holds the same
    hidden states and uses a slice of them, so the full gradient is the sum of the ranks'
    (zero outside their slice) — one ``N x H`` all-reduce, as the stock output layer does.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# --------------------------------------------------------------------------- the module
class RingDTPOutputLoss(torch.nn.Module):
    """Per-token loss ``[b, s]`` of a vocab-sharded output projection, through Ring-DTP.

    ``forward(hidden_states, weight, labels, loss_mask=None)``: ``hidden_states`` the decoder
    output this rank holds, ``[s/TP, b, H]`` with sequence parallelism else ``[s, b, H]``;
    ``weight`` this rank's ``[V/TP, H]`` rows (Megatron's shard: rank r holds ids
    ``[r V/TP, (r+1) V/TP)``); ``labels``/``loss_mask`` ``[b, s]`` as GPTModel takes them.
    Returns fp32 ``[b, s]``, the same on every TP rank; with ``with_top1`` also a bool
    ``[b, s]``: the label is the token's top-1 (a tie counts). Holds no parameters.
    """

    def __init__(self, tp_group, *, sequence_parallel: bool, mode: str = "auto",
                 block_size: Optional[int] = None, tile_bytes: Optional[int] = None,
                 logit_scale: float = 1.0, ignore_index: int = IGNORE_INDEX,
                 debug_checks: bool = False) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.sequence_parallel = bool(sequence_parallel) and self.tp > 1
        self.mode = mode
        self.block_size = block_size
        self.tile_bytes = tile_bytes or None  # 0: whole strips
        self.logit_scale = float(logit_scale)
        self.ignore_index = ignore_index
        self.debug_checks = bool(debug_checks)

    @classmethod
    def for_model(cls, model: torch.nn.Module, flat: FlatConfig) -> "RingDTPOutputLoss":
        config = model.config
        return cls(model.pg_collection.tp,
                   sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
                   mode=flat.vocab_mode, block_size=flat.vocab_block_size,
                   tile_bytes=flat.vocab_tile_bytes, logit_scale=compat.logit_multiplier(config), debug_checks=flat.debug_checks)

    def extra_repr(self) -> str:
        return (f"tp={self.tp}, sequence_parallel={self.sequence_parallel}, mode={self.mode}, "
                f"block_size={self.block_size}, tile_bytes={self.tile_bytes}")

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                loss_mask: Optional[torch.Tensor] = None, *, with_top1: bool = False):
        s_local, b = hidden_states.shape[0], hidden_states.shape[1]
        labels = labels.transpose(0, 1)  # [s, b], as the decoder lays out tokens
        mask = loss_mask.transpose(0, 1) if loss_mask is not None else None
        seq = labels.shape[0]
        if tuple(labels.shape) != (self._full_rows(s_local), b):
            raise ValueError(
                f"Ring-DTP output: labels {tuple(labels.shape[::-1])} [b, s] do not match hidden "
                f"states {tuple(hidden_states.shape)} [s{'/TP' if self.sequence_parallel else ''}"
                f", b, H] at TP={self.tp}")
        if self.tp == 1:
            counts, x = [seq], hidden_states
        elif self.sequence_parallel:
            counts, x = [s_local] * self.tp, hidden_states
        else:
            counts = token_split(seq, self.tp)
            x = CopyToTensorParallel.apply(hidden_states, self.tp_group)
        start = sum(counts[: self.tp_rank])
        rows = slice(start, start + counts[self.tp_rank])
        if self.tp > 1 and not self.sequence_parallel:
            x = x[rows]
        if self.logit_scale != 1.0:
            x = x * self.logit_scale  # (c x) W^T = c (x W^T): MuP's output multiplier
        out = ring_dtp_cross_entropy(
            x, weight, labels[rows], group=self.tp_group if self.tp > 1 else None,
            mode=self.mode, loss_mask=None if mask is None else mask[rows],
            ignore_index=self.ignore_index,
            block_size=self.block_size, tile_bytes=self.tile_bytes,
            debug_checks=self.debug_checks,
            # Every TP rank's share and settings follow from these, alike on every rank.
            plan_key=("megatron-output", tuple(labels.shape), tuple(x.shape),
                      tuple(weight.shape), x.dtype, x.requires_grad, weight.requires_grad,
                      mask is not None, self.mode, self.block_size, self.tile_bytes),
            return_top1=with_top1,
        )
        if with_top1:  # one gather for both: [s, b, 2] = (loss, top-1 as 0/1)
            loss, top1 = out
            out = torch.stack((loss, top1.to(loss.dtype)), dim=-1)
        if self.tp > 1:
            out = GatherTokenLoss.apply(out, counts, self.tp_rank, self.tp_group)
        out = out.transpose(0, 1).contiguous()  # [s, b, ...] -> [b, s, ...]
        return (out[..., 0], out[..., 1] != 0) if with_top1 else out

    def _full_rows(self, s_local: int) -> int:
        return s_local * self.tp if self.sequence_parallel else s_local

    # The signature of megatron-core 0.19's ``GPTModel.forward(output_processor=...)`` hook.
    def output_processor(self, *, hidden_states, output_layer, output_weight, labels,
                         loss_mask=None, **_: Any) -> torch.Tensor:
        weight = output_weight if output_weight is not None else output_layer.weight
        return self(hidden_states, weight, labels, loss_mask)


# --------------------------------------------------------------------------- MTP heads
class RingDTPHeads:
    """Megatron's multi-token-prediction loop, with every head's projection + loss on Ring-DTP.

    Stands in for ``output_layer`` (called) and ``compute_language_model_loss`` (:meth:`loss`)
    while Megatron runs its MTP loop (see ``compat``): the "projection" keeps the weight it
    is given (or the output layer's) and passes the head's hidden states through as its
    "logits"; the loss sends them with the labels Megatron rolled through the model's
    Ring-DTP module, under this module's own copy of the loss mask rolled alike, so masked
    tokens and the rolled-in tail cost no gradient and never look at their label. Megatron
    keeps everything else: the chunks, the rolls, masking, ``num_tokens``, the scaling, the
    loss tracker and ``MTPLossAutoScaler``. On 0.16 the main head comes through the same
    pair (recognised by its labels, the caller's tensor) and gets the caller's mask.
    Top-1 acceptance (0.19) comes from :meth:`acceptance_counts`: each head's ring reports
    which tokens' label was their top-1 (a tie counts; Megatron's argmax takes the first).
    """

    def __init__(self, model: torch.nn.Module, ring: RingDTPOutputLoss, labels: torch.Tensor,
                 loss_mask: Optional[torch.Tensor], packed_seq_params=None,
                 count_top1: bool = False) -> None:
        self._layer = model.output_layer
        self._ring = ring
        self._labels = labels
        self._mask = loss_mask
        self._rolled = loss_mask if loss_mask is not None else torch.ones_like(labels)
        self._cp = compat.cp_group(model)
        self._packed = packed_seq_params
        self._count_top1 = count_top1
        self._weight = None
        self._top1 = None

    @property
    def weight(self) -> torch.Tensor:  # what Megatron reads as output_layer.weight
        return self._layer.weight

    def __call__(self, hidden_states, weight=None, runtime_gather_output=None, **_: Any):
        self._weight = weight if weight is not None else self._layer.weight
        return hidden_states, None

    def loss(self, labels: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if labels is self._labels:
            mask = self._mask
        else:  # an MTP head: Megatron just rolled its labels and mask left by one
            self._rolled = compat.roll_left(self._rolled, self._cp, self._packed)
            mask = self._rolled
        if not self._count_top1:
            return self._ring(hidden_states, self._weight, labels, mask)
        loss, self._top1 = self._ring(hidden_states, self._weight, labels, mask, with_top1=True)
        return loss

    def acceptance_counts(self, loss_mask: torch.Tensor):
        """(correct, total) fp32 scalars of the last head, as Megatron's counter returns."""
        valid = loss_mask.bool()
        correct = (self._top1 & valid).sum().float() if self._top1 is not None else \
            torch.zeros((), device=loss_mask.device)
        return correct, valid.sum().float()


# --------------------------------------------------------------------------- enabling
def unsupported_settings(megatron: Any) -> List[str]:
    """Reasons Ring-DTP cannot replace the output layer of a model configured by
    ``megatron`` (a TransformerConfig or Megatron-LM args); empty when it can."""
    problems = []
    if getattr(megatron, "defer_embedding_wgrad_compute", False):
        problems.append("--defer-embedding-wgrad-compute computes the output weight's "
                        "gradient from buffers the Ring-DTP path does not fill")
    return problems


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def enable_ring_dtp(model: torch.nn.Module, flat: Optional[FlatConfig] = None, *,
                    mode: Optional[str] = None, block_size: Optional[int] = None,
                    tile_bytes: Optional[int] = None) -> torch.nn.Module:
    """Turn Ring-DTP on for one ``GPTModel`` (possibly wrapped); returns ``model``.

    ``flat`` gives the mode and the P = 1 block size (default ``FlatConfig(vocab=True)``);
    ``mode``/``block_size``/``tile_bytes`` override it (tiles are on by default: 128 MiB). Usable as the equivalence harness's ``wrap_model``.
    A model that is not a pipeline's last stage is left as it is (it has no output layer).
    """
    from megatron.core.models.gpt import GPTModel

    inner = _unwrap(model)
    if not isinstance(inner, GPTModel):
        raise TypeError(f"Ring-DTP replaces GPTModel's output layer; got {type(inner).__name__}")
    problems = unsupported_settings(inner.config)
    if problems:
        raise ValueError("Ring-DTP cannot run this model:\n  - " + "\n  - ".join(problems))
    flat = flat if flat is not None else FlatConfig(vocab=True)
    overrides = {k: v for k, v in (("vocab_mode", mode), ("vocab_block_size", block_size),
                                   ("vocab_tile_bytes", tile_bytes)) if v is not None}
    if overrides:
        flat = FlatConfig(**{**flat.to_dict(), **overrides})
    _patch_gpt_postprocess()
    if inner.post_process:
        object.__setattr__(inner, _ATTR, RingDTPOutputLoss.for_model(inner, flat))
    return model


def _installed_vocab() -> Optional[FlatConfig]:
    from megatron_flat.megatron.state import installed

    flat = installed()
    return flat if flat is not None and flat.vocab else None


def ring_dtp_output(model: torch.nn.Module) -> Optional[RingDTPOutputLoss]:
    """The model's Ring-DTP module, or None when Ring-DTP is off for it.

    Once ``install`` ran with ``--flat-vocab``, every last-stage ``GPTModel`` gets one (here,
    or at its first forward with labels).
    """
    inner = _unwrap(model)
    ring = inner.__dict__.get(_ATTR)
    if ring is None and getattr(inner, "post_process", False):
        flat = _installed_vocab()
        if flat is not None:
            enable_ring_dtp(inner, flat)
            ring = inner.__dict__.get(_ATTR)
    return ring


def wire_vocab(flat: FlatConfig, megatron: Any = None) -> None:
    """``megatron_flat.install`` wiring for ``--flat-vocab``: every ``GPTModel`` computes its
    loss through Ring-DTP from now on. Checks the megatron-core release and, when given, the
    Megatron settings; raises ``ValueError`` listing what does not fit."""
    compat.check_supported()
    if megatron is not None:
        problems = unsupported_settings(megatron)
        if problems:
            raise ValueError("--flat-vocab cannot run this configuration:\n  - "
                             + "\n  - ".join(problems))
    _patch_gpt_postprocess()


# --------------------------------------------------------------------------- the patch
_PATCHES: list = []  # Ring-DTP's applied patches (runtime.patching), for _unpatch_for_tests
# The Ring-DTP module of the _postprocess call in progress (0.19: read by the MTP loop's
# wrapper, so MTP heads go through Ring-DTP exactly when the main head does).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ring_dtp_active", default=None)


def _patch(owner: Any, name: str, make, why: str) -> None:
    patch = patching.Patch(patching.path_of(owner), name,
                           lambda stock: functools.wraps(stock)(make(stock)),
                           expects=f"Megatron's {name}", why=why)
    patching.apply(patch)
    _PATCHES.append(patch)


def _patch_gpt_postprocess() -> None:
    """Wrap ``GPTModel._postprocess`` once (idempotent; inert for models without Ring-DTP),
    and on 0.19 the MTP loop and its acceptance counter it calls."""
    if _PATCHES:
        return
    from megatron.core.models.gpt import GPTModel

    use_hook = compat.postprocess_has_output_processor()
    signature = inspect.signature(GPTModel._postprocess)

    def make_postprocess(stock):
        def _postprocess(self, *args: Any, **kwargs: Any):
            bound = signature.bind(self, *args, **kwargs)
            call = bound.arguments
            if call.get("labels") is None or not self.post_process or compat.inference_active(
                    call.get("inference_context")):
                return stock(self, *args, **kwargs)
            ring = ring_dtp_output(self)
            if ring is None:
                return stock(self, *args, **kwargs)
            if use_hook:  # 0.19: Megatron's own hook, after its MTP loop (wrapped below)
                if call.get("output_processor") is not None:
                    return stock(self, *args, **kwargs)
                token = _ACTIVE.set(ring)
                try:
                    return stock(self, *args, **{**kwargs,
                                                 "output_processor": ring.output_processor})
                finally:
                    _ACTIVE.reset(token)
            if getattr(self.config, "mtp_num_layers", None):
                # 0.16 with MTP: the stock loop runs, with the heads' stand-ins in place of
                # the output layer and the loss (the main head comes through them too).
                heads = RingDTPHeads(self, ring, call["labels"], call.get("loss_mask"),
                                     call.get("packed_seq_params"))
                with _shadowed(self, output_layer=heads, compute_language_model_loss=heads.loss):
                    return stock(self, *args, **kwargs)
            # 0.16: the projection + loss tail of _postprocess.
            weight = (self.shared_embedding_or_output_weight()
                      if self.share_embeddings_and_output_weights else self.output_layer.weight)
            return ring(call["hidden_states"], weight, call["labels"], call.get("loss_mask"))
        return _postprocess

    _patch(GPTModel, "_postprocess", make_postprocess,
           "Ring-DTP replaces the output projection and the loss together")
    mtp_loop = compat.mtp_loss_function()
    if mtp_loop is not None:
        _patch(*mtp_loop, _make_mtp_loop, "MTP heads go through Ring-DTP when the main head does")
    counter = compat.mtp_acceptance_function()
    if counter is not None:
        _patch(*counter, _make_acceptance_counter,
               "Ring-DTP heads keep no logits to count MTP acceptance from")


def _make_mtp_loop(stock):
    """0.19's ``process_mtp_loss`` (all keywords), every head on Ring-DTP while a model's
    ``_postprocess`` runs its main head through Ring-DTP."""
    def process_mtp_loss(**kwargs: Any):
        ring = _ACTIVE.get()
        if ring is None or kwargs.get("labels") is None:
            return stock(**kwargs)
        model = getattr(kwargs["compute_language_model_loss"], "__self__", None)
        if model is None:
            return stock(**kwargs)
        heads = RingDTPHeads(model, ring, kwargs["labels"], kwargs.get("loss_mask"),
                             kwargs.get("packed_seq_params"),
                             count_top1=bool(kwargs.get("is_training")))
        # MuP's output multiplier is the ring's logit_scale (as for the main head).
        return stock(**{**kwargs, "output_layer": heads,
                        "compute_language_model_loss": heads.loss, "scale_logits_fn": None})
    return process_mtp_loss


def _make_acceptance_counter(stock):
    """0.19's MTP acceptance counter: for Ring-DTP heads, the top-1 flags their ring
    reported (there are no logits to take an argmax of)."""
    def _compute_mtp_acceptance_counts(mtp_logits, mtp_labels, loss_mask, output_layer,
                                       *args: Any, **kwargs: Any):
        if isinstance(output_layer, RingDTPHeads):
            return output_layer.acceptance_counts(loss_mask)
        return stock(mtp_logits, mtp_labels, loss_mask, output_layer, *args, **kwargs)
    return _compute_mtp_acceptance_counts


@contextlib.contextmanager
def _shadowed(module: torch.nn.Module, **attributes: Any):
    """Instance attributes that hide ``module``'s own (submodules included) for a block."""
    for name, value in attributes.items():
        object.__setattr__(module, name, value)  # __dict__ wins over nn.Module's lookup
    try:
        yield
    finally:
        for name in attributes:
            module.__dict__.pop(name, None)


def _unpatch_for_tests() -> None:
    for patch in reversed(_PATCHES):
        patching.revert(patch)
    _PATCHES.clear()
