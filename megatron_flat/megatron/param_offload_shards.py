"""The offloaded experts cut as Megatron's distributed optimizer would cut them.

With ``--use-distributed-optimizer`` Megatron shards every parameter's fp32 optimizer state
over its data-parallel group: each rank owns contiguous pieces of DDP's buffer, steps them,
and all-gathers the updated weights. Param offload keeps the routed experts out of DDP's
buffers, so it makes the same cut itself (:mod:`~megatron_flat.megatron.distopt_layout`:
the experts laid out as DDP's expert buffer would lay them out, over the expert
data-parallel group) and follows it:

* :class:`ExpertShards` — the cut of one DDP's offloaded experts and this rank's pieces;
* :func:`piece_params` — each owned piece as a Parameter viewing the host-tier weight
  (the optimizer's fp32 master and moments are then the pieces' only: 12 bytes per owned
  element, ``1/expert-DP`` of the experts), with the model Parameter's tensor-parallel and
  norm attributes, so Megatron's norm, zero count and inf/nan check read exactly the
  pieces its distributed optimizer would on this rank;
* :func:`gather_weights` — after the step, every rank's updated pieces to every replica,
  bucket range by bucket range (Megatron's all-gather of the updated parameters), in
  chunks of at most ``GATHER_CHUNK_NUMEL`` elements per rank;
* :func:`sharded_state` / :func:`pieces_of` — the optimizer state in a checkpoint as
  whole tensors in model space (``optimizer.state.<name>.<parameter key>``, Megatron's
  ``fully_reshardable`` layout and the unsharded optimizer's): gathered on the replica
  that writes it when saving, sliced to this rank's pieces when loading, so a checkpoint
  loads at any expert data-parallel size.

Pure data movement around an element-wise update: the weights are bitwise those of the
unsharded step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_flat.megatron.distopt_layout import BufferLayout, buffer_layout, group_order
from megatron_flat.params import ParamOffloadError

__all__ = ["GATHER_CHUNK_NUMEL", "ExpertShards", "expert_shards", "gather_state",
           "gather_weights", "piece_params", "pieces_of", "sharded_state"]

# Elements each rank contributes to one all-gather round of updated weights: the round's
# staging is (1 + world) x this many elements (on the device too with NCCL; the planner's
# plan.param_offload.GATHER_CHUNK_NUMEL is the same number).
GATHER_CHUNK_NUMEL = 1 << 20

# What Megatron reads of a parameter to pick and reduce its gradient (norm, zero count,
# clipping): tensor-parallel attributes, sharedness, 0.19's grad-norm groups.
_COPIED_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                 "allreduce", "is_embedding_or_output_parameter", "grad_norm_group",
                 "sequence_parallel")


class ExpertShards:
    """Where the distributed optimizer would cut one DDP's offloaded experts: the
    Parameters in DDP's order, their host-tier weights, the buffer layout over the expert
    data-parallel ``group`` and this rank's pieces (``distopt_layout.Piece``)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], host: Sequence[torch.Tensor],
                 layout: BufferLayout, group) -> None:
        self.params = list(params)
        self.host = list(host)
        self.layout = layout
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.pieces = layout.pieces(self.rank)

    @property
    def world(self) -> int:
        return self.layout.world

    def owned(self, group_of: Dict[int, int], num_groups: int = 0) -> List[list]:
        """This rank's pieces as ``(param index, start, stop)``, one list per param group
        in the order the distributed optimizer lists them (``group_of``: id(Parameter) ->
        its group's index)."""
        groups = group_order(self.pieces, [group_of[id(p)] for p in self.params],
                             [p.dtype == torch.float32 for p in self.params], num_groups)
        return [[(x.param, x.start, x.stop) for x in group] for group in groups]


def expert_shards(ddp, module, offload) -> ExpertShards:
    """The :class:`ExpertShards` of ``offload``'s Parameters (a ``ModuleParamOffload``) for
    this DDP: collected as DDP collects its expert buffer's (``named_parameters()``
    order), with DDP's bucket size, padding rule and expert data-parallel group."""
    where = {id(p): (layer, j) for layer, params in enumerate(offload.params)
             for j, p in enumerate(params)}
    params = [p for _, p in module.named_parameters() if id(p) in where]
    kinds = {(p.dtype, torch.float32 if ddp.ddp_config.grad_reduce_in_fp32 else p.dtype)
             for p in params}
    if len(kinds) > 1:
        raise ParamOffloadError(
            "param offload with the distributed optimizer: the routed experts mix parameter "
            f"dtypes ({sorted(str(k[0]) for k in kinds)}); Megatron would shard them over "
            "several buffers, which the host tier does not follow")
    group = ddp.intra_expt_dp_group
    layout = buffer_layout(
        [p.numel() for p in params], group.size(), ddp.bucket_size,
        pad_for_high_nccl_busbw=bool(getattr(ddp.ddp_config, "pad_buckets_for_high_nccl_busbw",
                                             False)),
        shared_embedding=[bool(getattr(p, "shared_embedding", False)) for p in params])
    host = [offload.host_weights(where[id(p)][0])[where[id(p)][1]] for p in params]
    return ExpertShards(params, host, layout, group)


def piece_params(shards: ExpertShards, owned: List[list]) -> List[List[torch.nn.Parameter]]:
    """One Parameter per owned piece (``ExpertShards.owned``), viewing its host-tier weight
    (an update writes the host tier in place), with its model Parameter's attributes
    (``_COPIED_ATTRS``) and ``flat_piece = (model Parameter, start, stop)``."""
    out = []
    for group in owned:
        pieces = []
        for index, start, stop in group:
            model = shards.params[index]
            piece = torch.nn.Parameter(shards.host[index].view(-1)[start:stop],
                                       requires_grad=model.requires_grad)
            for name in _COPIED_ATTRS:
                if hasattr(model, name):
                    setattr(piece, name, getattr(model, name))
            piece.flat_piece = (model, start, stop)
            pieces.append(piece)
        out.append(pieces)
    return out


def _segments(layout: BufferLayout, start: int, stop: int) -> List[Tuple[int, int, int, int]]:
    """``(param, from, to, offset)``: the parameter elements ``[from, to)`` at buffer range
    ``[start, stop)``'s ``offset`` (padding has none)."""
    out = []
    for i, (p_start, p_end, _) in enumerate(layout.index):
        a, b = max(start, p_start), min(stop, p_end)
        if b > a:
            out.append((i, a - p_start, b - p_start, a - start))
    return out


def _exchange(shards: ExpertShards, dtype: torch.dtype, device: torch.device, read, write,
              dst=None) -> None:
    """Move every rank's bucket ranges to every rank (``dst`` None: an all-gather) or to
    group rank ``dst`` (a gather), in rounds of at most ``GATHER_CHUNK_NUMEL`` elements
    per rank: ``read(param, start, stop)`` gives this rank's elements of a parameter,
    ``write(rank, param, start, stop, values)`` takes another rank's (on the receiving
    ranks). Through ``device`` when the group's backend moves device memory."""
    import torch.distributed as dist

    layout, world, me = shards.layout, shards.world, shards.rank
    staged = dist.get_backend(shards.group) != "gloo" and device.type != "cpu"
    on = device if staged else torch.device("cpu")
    receives = dst is None or dst == me
    for bucket in range(len(layout.buckets)):
        lo, hi = layout.rank_range(bucket, 0)
        for offset in range(0, hi - lo, GATHER_CHUNK_NUMEL):
            count = min(GATHER_CHUNK_NUMEL, hi - lo - offset)
            starts = [layout.rank_range(bucket, r)[0] + offset for r in range(world)]
            send = torch.zeros(count, dtype=dtype)
            for i, a, b, at in _segments(layout, starts[me], starts[me] + count):
                send[at:at + b - a].copy_(read(i, a, b))
            send = send.to(on)
            recv = torch.empty(world * count, dtype=dtype, device=on) if receives else None
            if dst is None:
                dist.all_gather_into_tensor(recv, send, group=shards.group)
            else:
                dist.gather(send, list(recv.chunk(world)) if receives else None,
                            group_dst=dst, group=shards.group)
            if not receives:
                continue
            recv = recv.cpu()
            for r in range(world):
                if r == me:
                    continue
                part = recv[r * count:(r + 1) * count]
                for i, a, b, at in _segments(layout, starts[r], starts[r] + count):
                    write(r, i, a, b, part[at:at + b - a])


def gather_weights(shards: ExpertShards, device: torch.device) -> None:
    """Every rank's pieces of the host weights (updated by their owner) into every
    replica's host tier: Megatron's all-gather of the updated parameters, bucket range by
    bucket range. Collective over the shards' group."""
    if shards.world == 1:
        return
    flat = [h.view(-1) for h in shards.host]

    def write(rank, i, a, b, values):
        flat[i][a:b].copy_(values)

    _exchange(shards, flat[0].dtype, device, lambda i, a, b: flat[i][a:b], write)


def gather_state(shards: ExpertShards, pieces: Sequence[torch.nn.Parameter],
                 state: Dict[int, Dict[str, torch.Tensor]], names: Sequence[str],
                 device: torch.device, dst: int = 0):
    """The whole fp32 state ``names`` of every laid-out parameter on group rank ``dst``
    (``{param index: {name: tensor shaped like the parameter}}``; None elsewhere), from
    each rank's ``state`` of its ``pieces`` (the inner optimizer's, indexed like them).
    Collective over the shards' group."""
    mine = {}  # param index -> (piece start, its state)
    index_of = {id(p): i for i, p in enumerate(shards.params)}
    for k, piece in enumerate(pieces):
        model, start, _ = piece.flat_piece
        mine[index_of[id(model)]] = (start, state.get(k, {}))
    receives = shards.world == 1 or shards.rank == dst
    whole = {i: {name: torch.zeros(p.shape, dtype=torch.float32) for name in names}
             for i, p in enumerate(shards.params)} if receives else None
    for name in names:
        def read(i, a, b, name=name):
            start, entry = mine[i]
            return entry[name].view(-1)[a - start:b - start]

        def write(rank, i, a, b, values, name=name):
            whole[i][name].view(-1)[a:b].copy_(values)

        if receives:
            for i, (start, entry) in mine.items():
                values = entry[name].view(-1)
                whole[i][name].view(-1)[start:start + values.numel()].copy_(values)
        if shards.world > 1:
            _exchange(shards, torch.float32, device, read, write, dst=dst)
    return whole


def sharded_state(shards: ExpertShards, pieces: Sequence[torch.nn.Parameter],
                  state: Dict[int, Dict[str, torch.Tensor]], names: Sequence[str],
                  model_sharded_state_dict, device: torch.device,
                  is_loading: bool) -> Dict[int, dict]:
    """The experts' optimizer state for a checkpoint in model space, whatever the
    sharding: ``{param index: {name: ShardedTensor}}``, each keyed as its expert's tensor
    with ``optimizer.state.<name>.`` before it, whole, with its replica id (Megatron's
    ``fully_reshardable`` layout, and the one the unsharded optimizer writes), so it loads
    at any expert data-parallel size. Saving gathers each parameter's pieces on the
    replica that writes it (group rank 0; the others hold placeholders); loading gives
    every rank whole tensors to slice its pieces from (:func:`pieces_of`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensorFactory,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata = {id(sh.data): sh for sh in nested_values(tensors)}
    found = [metadata.get(id(p)) for p in shards.params]
    if any(sh is None for sh in found):
        raise ParamOffloadError("param offload: an offloaded expert is missing from the "
                                "model's sharded state dict (build it with keep_vars)")
    writer = shards.rank == 0
    if any(is_main_replica(sh.replica_id) != writer for sh in found):
        raise ParamOffloadError("param offload: the experts' main checkpoint replica is not "
                                "expert data-parallel rank 0, where their state is gathered")
    if is_loading:
        whole = {i: {n: torch.empty(p.shape, dtype=torch.float32) for n in names}
                 for i, p in enumerate(shards.params)}
    else:
        whole = gather_state(shards, pieces, state, names, device, dst=0)
        if whole is None:  # not written from this rank: shape-only placeholders
            whole = {i: {n: torch.zeros((), dtype=torch.float32).expand(p.shape)
                         for n in names} for i, p in enumerate(shards.params)}
    out = {}
    for i, sh in enumerate(found):
        out[i] = {}
        for name, value in whole[i].items():
            kwargs = dict(key=f"optimizer.state.{name}.{sh.key}", data=value,
                          dtype=value.dtype)
            if isinstance(sh, ShardedTensorFactory):
                kwargs.pop("dtype")
            out[i][name] = replace(sh, **kwargs)
    return out


def pieces_of(shards: ExpertShards, pieces: Sequence[torch.nn.Parameter],
              whole: Dict[int, Dict[str, torch.Tensor]]) -> Dict[int, Dict[str, torch.Tensor]]:
    """This rank's pieces of loaded whole state (``{param index: {name: tensor}}``, as
    :func:`sharded_state` lays it out), indexed like ``pieces``."""
    index_of = {id(p): i for i, p in enumerate(shards.params)}
    out = {}
    for k, piece in enumerate(pieces):
        model, start, stop = piece.flat_piece
        entry = whole.get(index_of[id(model)])
        if entry:
            out[k] = {name: value.reshape(-1)[start:stop].clone()
                      for name, value in entry.items()}
    return out
