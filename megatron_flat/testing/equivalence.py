"""Equivalence harness: the same tiny model under a parallel layout vs one rank.

Every technique proves exactness here. The reference is the unsplit model run on the
whole global batch inside one process (every rank computes it redundantly, so no
collective is involved); the layout run builds the split model, loads the reference's
initial weights shard by shard, trains with Megatron's own schedule, DDP and optimizer,
and gathers every parameter and gradient back to full tensors for comparison.

Shards are located through Megatron's ``sharded_state_dict`` metadata (global key,
global shape, offsets, replica id), so TP, EP, PP and DP splits — including SwiGLU's
interleaved fc1 and experts placed by global index — are handled by one mechanism.
Replicated pieces (DP replicas, norm weights under TP) must agree bitwise; a
disagreement is reported as a mismatch rather than averaged away.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import (
    TinyMoE,
    build_tiny_gpt,
    global_batch,
    reset_mtp_tracker,
    transformer_config,
)
from megatron_flat.testing.training import CLIP_GRAD, LR, Layout, Trainer

__all__ = ["Layout", "RunResult", "run_reference", "run_layout", "full_tensors", "load_full",
           "mismatches", "assert_equivalent", "RTOL", "ATOL", "PARAM_ATOL", "PARAM_OUTLIERS"]

# Reductions are reordered by every split (row-parallel partial sums, DP averaging,
# expert grads summed in another order), so fp32 results agree to rounding, not bitwise.
# Measured worst case on the tiny model (gradients up to ~0.3): losses 6e-8 relative,
# gradients within 3% of this bound. A wrong shard or a missing reduction is O(1); one
# corrupted expert weight moved the loss by 9e-5 relative, which 1e-4 let pass.
RTOL = 1e-5
ATOL = 1e-6

# Parameters after AdamW steps are compared more loosely: Adam normalises every update
# to about ``lr``, so an element whose gradient is at rounding level (|g| ~ 1e-8) can
# move by a visible fraction of ``lr`` when g changes by one ulp. The bound is 1% of one
# step; a wrong gradient shard, a missed reduction or a skipped update moves by ~lr.
PARAM_ATOL = 1e-2 * LR
# Which elements have rounding-level gradients depends on the processor's summation order
# (seen: one element of 24,576 in a TP=2 attention weight at 2% of lr on one machine, none
# on another), so a parameter may have a few such elements: at most PARAM_OUTLIERS of its
# elements (none in a parameter of fewer than 1,000) may exceed PARAM_ATOL, each by no more than Adam's largest move
# (lr per step). The step-0 gradients are compared at the tight RTOL / ATOL throughout, and
# every real error moves many elements or moves them further.
PARAM_OUTLIERS = 1e-3

@dataclass
class RunResult:
    """What a run produced: per-step mean loss, step-0 gradients and final parameters."""

    losses: List[float]
    grads: Optional[Dict[str, torch.Tensor]]
    params: Dict[str, torch.Tensor]
    initial_params: Dict[str, torch.Tensor]
    # This rank's AdamW state after the last step ("<inner>.<param index>.<key>" for the
    # moments and step count of each inner optimizer); only layout runs record it.
    optimizer_state: Optional[Dict[str, torch.Tensor]] = None


# --------------------------------------------------------------------------- shards
@dataclass
class _Shard:
    key: str
    global_shape: Tuple[int, ...]
    prepend: int
    offset: Tuple[int, ...]
    main: bool
    data: torch.Tensor

    def index(self) -> tuple:
        pre = tuple(self.offset[: self.prepend])
        rest = tuple(
            slice(o, o + s) for o, s in zip(self.offset[self.prepend :], self.data.shape)
        )
        return pre + rest


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _shards(chunks: Sequence[torch.nn.Module]) -> List[_Shard]:
    """This rank's ShardedTensors of ``chunks`` (factories applied; data are views)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )

    out = []
    for chunk in chunks:
        sd = _unwrap(chunk).sharded_state_dict()
        apply_factories(sd)
        for v in nested_values(sd):
            if not isinstance(v, ShardedTensor) or v.key.endswith("_extra_state"):
                continue
            if v.flattened_range is not None:
                raise NotImplementedError(f"flattened shard {v.key} is not a model parameter")
            out.append(_Shard(v.key, tuple(v.global_shape), v.prepend_axis_num,
                              tuple(v.global_offset), is_main_replica(v.replica_id), v.data))
    return out


@contextlib.contextmanager
def _params_showing_grads(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Temporarily point every parameter's data at its gradient (main_grad or grad).

    Lets the sharded-state-dict metadata locate gradient shards exactly as it locates
    parameter shards, whatever views and factories sit in between.
    """
    saved = []
    for chunk in chunks:
        for p in chunk.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
            saved.append((p, p.data))
            p.data = grad.view_as(p)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def full_tensors(chunks: Sequence[torch.nn.Module], *, grads: bool = False,
                 gather: bool = True) -> Dict[str, torch.Tensor]:
    """Every parameter (or gradient) of the model as full, unsplit tensors by global key.

    With ``gather`` this is a collective over the world (all ranks get the result); it
    raises ``AssertionError`` if replicated pieces disagree or a tensor is not covered.
    """
    with (_params_showing_grads(chunks) if grads else contextlib.nullcontext()):
        local = [dataclasses.replace(s, data=s.data.detach().float().clone())
                 for s in _shards(chunks)]
    pieces: List[_Shard] = local
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: List[Optional[List[_Shard]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        pieces = [s for rank_pieces in gathered for s in rank_pieces]
    full: Dict[str, torch.Tensor] = {}
    covered: Dict[str, torch.Tensor] = {}
    for s in sorted(pieces, key=lambda s: not s.main):  # main replicas first
        if s.key not in full:
            full[s.key] = torch.zeros(s.global_shape)
            covered[s.key] = torch.zeros(s.global_shape, dtype=torch.bool)
        idx = s.index()
        if covered[s.key][idx].any():
            if not torch.equal(full[s.key][idx], s.data):
                raise AssertionError(f"replicas of {s.key} disagree")
            continue
        full[s.key][idx] = s.data
        covered[s.key][idx] = True
    for key, mask in covered.items():
        if not mask.all():
            raise AssertionError(f"{key}: {int((~mask).sum())} elements not covered by any shard")
    return full


def load_full(chunks: Sequence[torch.nn.Module], full: Dict[str, torch.Tensor]) -> None:
    """Copy each local shard of ``full`` into the model's parameters (no collective).

    As a distributed-checkpoint load does: every ShardedTensor of the model's sharded state
    dict gets its slice of ``full``, factories merge their pieces back (0.16's GroupedMLP
    hands out transposed expert blocks, not views of ``weight1``), and the results are
    copied into the parameters of the same names. A parameter the state dict does not reach
    raises ``NotImplementedError`` (a silent miss would compare the wrong weights)."""
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace,
        extract_matching_values,
    )
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    def slice_of(v):
        if isinstance(v, ShardedTensor) and not v.key.endswith("_extra_state"):
            shard = _Shard(v.key, tuple(v.global_shape), v.prepend_axis_num,
                           tuple(v.global_offset), True, v.data)
            return full[v.key][shard.index()].to(v.data.dtype).clone()
        return v

    with torch.no_grad():
        for chunk in chunks:
            module = _unwrap(chunk)
            sd = module.sharded_state_dict()
            factories, _ = extract_matching_values(
                sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True)
            apply_factories(sd)
            dict_list_map_inplace(slice_of, sd)
            loaded = apply_factory_merges(sd, factories)
            params = dict(module.named_parameters())
            reached = set()
            for name, value in _flat_items(loaded):
                if name in params and isinstance(value, torch.Tensor):
                    params[name].copy_(value.view_as(params[name]))
                    reached.add(name)
            missed = sorted(set(params) - reached)
            if missed:
                raise NotImplementedError(f"the sharded state dict does not reach {missed}: "
                                          "the equivalence harness cannot load them")


def _flat_items(tree, prefix: str = ""):
    """(key, leaf) of a nested state dict (keys joined as the module's state dict does)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_items(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    else:
        yield prefix, tree


# --------------------------------------------------------------------------- reference
def run_reference(tiny: TinyMoE, *, steps: int = 2,
                  config_overrides: Optional[dict] = None) -> RunResult:
    """The unsplit model on the whole global batch, in this process only.

    Made once per process for each ``(tiny, steps, config_overrides)`` (the run is a pure
    function of them: fixed seeds, one rank, no collective) and handed out as a copy, so the
    files of one pytest session share it and no caller can change another's.

    Loss per microbatch is the mean token loss; a step's loss is the mean over
    microbatches (what Megatron's schedule and DP averaging compute). The optimizer is
    ``torch.optim.AdamW`` with Megatron's hyperparameters and global-norm clipping.

    With ``config_overrides={"calculate_per_token_loss": True}`` the step's loss is the
    masked token-loss sum over the global batch's unmasked token count (``TinyMoE.
    masked_fraction``'s masks, passed to the model too), each microbatch backpropagating
    its sum over that count; the MTP heads' losses are the model's own per-token form
    (release-specific) scaled by the same 1 / count, as ``finalize_model_grads`` scales them.
    """
    per_token = bool((config_overrides or {}).get("calculate_per_token_loss"))
    if tiny.masked_fraction and not per_token:
        raise ValueError("TinyMoE.masked_fraction needs calculate_per_token_loss: the mean-loss "
                         "reference counts every token")
    key = (tiny, steps, tuple(sorted((config_overrides or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(tiny, steps, config_overrides, per_token)
    return copy.deepcopy(_REFERENCES[key])


_REFERENCES: Dict[tuple, RunResult] = {}


def _reference_run(tiny: TinyMoE, steps: int, config_overrides: Optional[dict],
                   per_token: bool) -> RunResult:
    backward = _per_token_backward if per_token else _mean_backward
    with megatron_layout(1, 1, 1, seed=tiny.seed):
        torch.manual_seed(tiny.seed)
        config = transformer_config(tiny, **(config_overrides or {}))
        model = build_tiny_gpt(tiny, config)
        initial = full_tensors([model], gather=False)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0)
        losses, grads = [], None
        for step in range(steps):
            opt.zero_grad(set_to_none=False)
            losses.append(backward(model, config, global_batch(tiny, step), step))
            if step == 0:
                grads = full_tensors([model], grads=True, gather=False)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
            opt.step()
        params = full_tensors([model], gather=False)
    return RunResult(losses, grads, params, initial)


def _mean_backward(model, config, batch, step: int) -> float:
    """Back-propagate one step's mean token loss per microbatch, averaged over the
    microbatches; returns that loss."""
    total = 0.0
    # MTP heads' losses reach the gradient through MTPLossAutoScaler, scaled as
    # Megatron's schedule scales them: 1 / microbatches, like the main loss.
    _set_mtp_scale(config, 1.0 / len(batch))
    for mb in batch:
        loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels).float().mean()
        (loss / len(batch)).backward()
        total += loss.item()
    return total / len(batch)


def _per_token_backward(model, config, batch, step: int) -> float:
    """Back-propagate one step's masked token-loss sum over its unmasked token count (the
    MTP heads scaled by the same 1 / count); returns that loss."""
    masks = [torch.ones(mb.labels.shape) if mb.loss_mask is None else mb.loss_mask
             for mb in batch]
    count = sum(float(m.sum()) for m in masks)
    if count == 0:
        raise ValueError(f"step {step}: every token of the global batch is masked")
    total = 0.0
    _set_mtp_scale(config, 1.0 / count)
    for mb, mask in zip(batch, masks):
        per_token = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                          loss_mask=mb.loss_mask)
        loss_sum = (per_token.float() * mask).sum()
        (loss_sum / count).backward()
        total += loss_sum.item()
    return total / count


def _set_mtp_scale(config, scale: float) -> None:
    if getattr(config, "mtp_num_layers", None):
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))
        reset_mtp_tracker()



# --------------------------------------------------------------------------- layouts
def run_layout(tiny: TinyMoE, layout: Layout, reference: RunResult, *, steps: int = 2,
               config_overrides: Optional[dict] = None,
               wrap_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
               flat=None, inspect: Optional[Callable[[Trainer], None]] = None) -> RunResult:
    """Train the tiny model split by ``layout`` from the reference's initial weights.

    Uses Megatron's DDP (grads reduced in fp32), ``get_megatron_optimizer`` (distributed
    when the layout says so), ``finalize_model_grads`` and the schedule for the pipeline
    size (1F1B when PP > 1). ``flat``: a ``FlatConfig`` whose techniques the trainer turns
    on (see ``Trainer``). ``inspect(trainer)`` runs after the last step (to check what the
    run used). Collective over the world.
    """
    with megatron_layout(layout.tp, layout.ep, layout.pp, seed=tiny.seed, etp=layout.etp,
                         cp=layout.cp):
        trainer = Trainer(tiny, layout, config_overrides=config_overrides, wrap_model=wrap_model,
                          init=lambda model: load_full([model], reference.initial_params),
                          flat=flat)
        losses, grads = [], None
        for step in range(steps):
            losses.append(trainer.forward_backward(step))
            if step == 0 and not layout.distributed_optimizer:
                # With the distributed optimizer each rank holds only its reduced shard of
                # the grads; that layout is checked through the parameters after the step.
                grads = full_tensors([trainer.ddp], grads=True)
            trainer.optimizer_step()
        params = full_tensors([trainer.ddp])
        state = optimizer_state(trainer.optimizer)
        if inspect is not None:
            inspect(trainer)
        trainer.release()
    return RunResult(losses, grads, params, reference.initial_params, state)


_ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


def optimizer_state(megatron_optimizer) -> Dict[str, torch.Tensor]:
    """This rank's AdamW state under Megatron's optimizer: for every inner optimizer (one per
    parameter kind), each parameter's moments and step count, keyed by position. The same
    layout gives the same positions, so two runs' states compare key by key (no collective).
    """
    from megatron_flat.megatron.optimizer import inner_optimizers

    out = {}
    for i, inner in enumerate(inner_optimizers(megatron_optimizer)):
        for index, entry in inner.state_dict()["state"].items():
            for key in _ADAM_STATE:
                if key in entry:
                    value = torch.as_tensor(entry[key])
                    out[f"{i}.{index}.{key}"] = value.detach().float().cpu().clone()
    return out


# --------------------------------------------------------------------------- comparing
def mismatches(result: RunResult, reference: RunResult, *, rtol: float = RTOL,
               atol: float = ATOL, param_atol: float = PARAM_ATOL) -> List[str]:
    """Human-readable differences between a layout run and the reference (empty = equal)."""
    out = []
    if len(result.losses) != len(reference.losses):
        out.append(f"ran {len(result.losses)} steps, reference {len(reference.losses)}")
    for step, (a, b) in enumerate(zip(result.losses, reference.losses)):
        if abs(a - b) > atol + rtol * abs(b):
            out.append(f"step {step} loss {a!r} != reference {b!r}")
    steps = max(1, len(reference.losses))
    pairs = [("param", result.params, reference.params, param_atol)]
    if result.grads is not None:
        pairs.append(("grad", result.grads, reference.grads, atol))
    for what, got, want, abs_tol in pairs:
        if set(got) != set(want):
            out.append(f"{what} keys differ: {sorted(set(got) ^ set(want))}")
        for key in sorted(set(got) & set(want)):
            if got[key].shape != want[key].shape:
                out.append(f"{what} {key}: shape {tuple(got[key].shape)} != "
                           f"{tuple(want[key].shape)}")
            elif not torch.allclose(got[key], want[key], rtol=rtol, atol=abs_tol):
                diff = (got[key] - want[key]).abs()
                err = diff.max().item()
                bad = int((diff > abs_tol + rtol * want[key].abs()).sum())
                if what == "param" and bad <= int(PARAM_OUTLIERS * diff.numel()) \
                        and err <= steps * LR:
                    continue  # rounding-level gradients flipped by Adam (see PARAM_OUTLIERS)
                out.append(f"{what} {key}: max abs error {err:.3g} ({bad} of {diff.numel()} "
                           f"elements)")
    return out


def assert_equivalent(result: RunResult, reference: RunResult, **tolerances) -> None:
    problems = mismatches(result, reference, **tolerances)
    if problems:
        raise AssertionError("not equivalent to the single-rank reference:\n  "
                             + "\n  ".join(problems))
