"""One rank's view of a large process group, in one process: peers that behave like it.

:func:`init_standin_group` makes torch's fake process group the default group, of any size,
with this process as one rank of it. Its collectives go through the same ``c10d`` ops as a
real group's (so the cost ledger counts their calls and bytes as it would on NCCL or gloo)
but no peer exists: each returns at once, with what this rank's peers would have sent if
they behaved exactly like it —

* ``all_gather_into_tensor`` fills every rank's slot with this rank's input (each peer
  contributes what this rank contributes: for PipelinedLLEP's counts exchange, every rank
  routes with this rank's routing, so the plan is the one a real group whose ranks route
  alike would make);
* ``all_to_all_single`` fills the output with finite values (the sizes follow the split
  sizes given, as on a real group; the values are not any peer's). torch's fake group
  refuses a call that sends nothing but receives rows (a real group does not), so such a
  call is issued with empty buffers (the ledger sees the call and the 0 bytes this rank
  sends) and its output is zero-filled unseen by the ledger (on a GPU the received rows
  are written by the collective, not by a kernel);
* ``all_reduce`` leaves the tensor as it is.

What this view is faithful for: everything this rank computes from its own inputs and the
gathered rows (the plan, its schedules, the host work and memory of planning, the sizes of
every buffer, the syncs and ops it issues, the bytes it puts on its links) — the things that
grow with the group's size. Not for: values that come from peers' data (outputs and
gradients are not the real group's) or time spent waiting for peers.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_flat.runtime import ledger

__all__ = ["init_standin_group"]


def _receives_while_sending_nothing(all_to_all_single):
    @functools.wraps(all_to_all_single)
    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
             async_op=False):
        if input.numel() == 0 and output.numel() > 0:
            size = dist.get_world_size(group)
            work = all_to_all_single(output[:0], input, [0] * size, [0] * size, group=group,
                                     async_op=async_op)
            with ledger.quietly(), torch.no_grad():
                output.zero_()
            return work
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                 group=group, async_op=async_op)

    call.__flat_standin__ = True
    return call


def init_standin_group(world_size: int, rank: int = 0) -> None:
    """Make the default process group a stand-in group of ``world_size`` ranks in which this
    process is ``rank`` (see the module docstring). Raises if torch.distributed is already
    initialized."""
    if dist.is_initialized():
        raise RuntimeError("init_standin_group: torch.distributed is already initialized")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    # Importing the module registers torch's "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    if not getattr(dist.all_to_all_single, "__flat_standin__", False):
        dist.all_to_all_single = _receives_while_sending_nothing(dist.all_to_all_single)
