"""Process groups for tests, the demo and benchmarks (gloo on CPU, NCCL on CUDA).

``init_distributed()`` joins the job torchrun started (or a world of one when run
without torchrun); ``megatron_layout(...)`` sets up Megatron's parallel state for one
TP/EP/PP layout and tears it down afterwards, so one process can visit several layouts.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

# A rank that fails before a collective must not leave its peers waiting forever.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("FLAT_DIST_TIMEOUT_S", "300")))


def init_distributed(backend: str | None = None) -> int:
    """Initialise the default process group once; returns the world size.

    Without torchrun's environment a single-rank group on a free local port is made, so
    the same code runs under plain ``python`` and ``pytest``.
    """
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=DEFAULT_TIMEOUT)
    return dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_layout(tp: int = 1, ep: int = 1, pp: int = 1, seed: int = 1234,
                    etp: Optional[int] = None, cp: int = 1) -> Iterator[None]:
    """Megatron parallel state for one layout over the whole world; DP is what remains.

    ``etp``: the experts' tensor-parallel size (Megatron's default, None, is ``tp``).
    ``cp``: the context-parallel size (the sequence split over CP ranks; Megatron folds CP
    into the experts' data-parallel dimension, so EP groups may span CP peers).

    Seeds Megatron's RNG tracker (data-, model- and expert-parallel states) from ``seed``.
    Raises ``ValueError`` (before any group is created) if the sizes don't divide the world.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    experts = ep * (tp if etp is None else etp) * pp
    if world % (tp * cp * pp) != 0 or world % experts != 0:
        raise ValueError(f"layout tp={tp} cp={cp} ep={ep} pp={pp} etp={etp} does not divide "
                         f"world size {world}")
    parallel_state.destroy_model_parallel()
    before = live_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        **({} if etp is None else {"expert_tensor_parallel_size": etp}),
    )
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        destroy_gloo_groups_since(before)


def live_groups() -> set:
    """The process groups c10d knows now (empty where its registry is not reachable)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return set(getattr(world, "pg_map", {}) or {})


def destroy_gloo_groups_since(before: set) -> None:
    """Destroy the gloo groups made since ``before`` (Megatron's ``destroy_model_parallel``
    only drops its references).

    Why: a live gloo group keeps transport threads that take CPU even while idle; a
    process that visits 40 layouts (17 groups each) burned 0.83 of a core doing nothing,
    which slowed every later test and the rehearsals it launched. Destroying a gloo group
    is local (no collective), and every rank leaves a layout after the same collectives.
    NCCL groups are left alone: their destruction may wait on peers.
    """
    for group in live_groups() - before:
        if group is dist.GroupMember.WORLD or dist.get_backend(group) != "gloo":
            continue
        dist.destroy_process_group(group)
