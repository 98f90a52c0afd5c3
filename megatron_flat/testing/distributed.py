"""Process groups for tests, the demo and benchmarks (gloo on CPU, NCCL on CUDA).

``init_distributed()`` joins the job torchrun started (or a world of one when run
without torchrun); ``megatron_layout(...)`` sets up Megatron's parallel state for one
TP/EP/PP layout and tears it down afterwards, so one process can visit several layouts;
inside ``layout_group_pool()`` (each test file, tests/conftest.py) the layouts share their
process groups instead of making and destroying them each time.
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
    pool = _POOL
    with (pool.keeping() if pool else contextlib.nullcontext()):
        parallel_state.destroy_model_parallel()
    before = live_groups()
    with (pool.serving() if pool else contextlib.nullcontext()):
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
        with (pool.keeping() if pool else contextlib.nullcontext()):
            parallel_state.destroy_model_parallel()
        destroy_gloo_groups_since(before, keep=pool.groups() if pool else ())


def live_groups() -> set:
    """The process groups c10d knows now (empty where its registry is not reachable)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return set(getattr(world, "pg_map", {}) or {})


def destroy_gloo_groups_since(before: set, keep=()) -> None:
    """Destroy the gloo groups made since ``before`` but those in ``keep`` (Megatron's
    ``destroy_model_parallel`` destroys only its data-parallel gloo groups).

    Why: a live gloo group keeps transport threads that take CPU even while idle; a
    process that visits 40 layouts (17 groups each) burned 0.83 of a core doing nothing,
    which slowed every later test and the rehearsals it launched. Destroying a gloo group
    is local (no collective), and every rank leaves a layout after the same collectives.
    NCCL groups are left alone: their destruction may wait on peers.
    """
    for group in live_groups() - before - set(keep):
        if group is dist.GroupMember.WORLD or dist.get_backend(group) != "gloo":
            continue
        dist.destroy_process_group(group)


class LayoutGroupPool:
    """Process groups that successive :func:`megatron_layout` calls share (tests only).

    Making a layout's groups and destroying them again costs ~0.2 s at world size 2 and
    ~0.35 s at 4 (gloo's destroy joins transport threads, ~0.1 s of that), and a test
    session visits hundreds of layouts. While the pool is open, the groups Megatron asks
    for in ``initialize_model_parallel`` are served from it: the n-th group over a rank set
    (with one backend) is the same object in every layout, so a layout still gets distinct
    groups, never more than the largest layout needs per rank set, and no layout sees a
    group another layout is still using (layouts do not nest). ``destroy_model_parallel``'s
    destroys of pooled groups are skipped; :meth:`close` destroys them.

    Why every rank stays in step: torch names a group by a counter that every rank bumps
    at each ``new_group``; a pooled request skips ``new_group`` on every rank alike,
    because the key (ranks, backend, occurrence) is the same on every rank, members or not.
    A pooled group destroyed behind the pool's back would break that, so it is refused.
    Groups made with ``pg_options`` or local synchronisation are not pooled.
    """

    def __init__(self) -> None:
        self._groups: dict = {}
        self._seen: dict = {}

    def groups(self) -> list:
        """The live process groups the pool holds (this rank's memberships)."""
        return [g for g in self._groups.values() if g is not dist.GroupMember.NON_GROUP_MEMBER]

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """``torch.distributed.new_group`` served from the pool for this scope."""
        from megatron_flat.runtime import patching

        dead = [g for g in self.groups() if g not in live_groups()]
        if dead:
            raise RuntimeError(f"{len(dead)} pooled process group(s) were destroyed outside "
                               "megatron_layout; close the LayoutGroupPool instead")
        self._seen = {}
        patch = patching.Patch(
            "torch.distributed", "new_group", wrap=self._serve, expects="a function",
            why="tests: a layout's process groups are reused by the next layout")
        patching.apply(patch)
        try:
            yield
        finally:
            patching.revert(patch)

    def _serve(self, new_group):
        def new_group_pooled(ranks=None, timeout=None, backend=None, pg_options=None,
                             use_local_synchronization=False, group_desc=None, **kwargs):
            call = dict(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                        use_local_synchronization=use_local_synchronization, **kwargs)
            if group_desc is not None:
                call["group_desc"] = group_desc
            if pg_options is not None or use_local_synchronization or kwargs:
                return new_group(**call)
            members = tuple(sorted(ranks)) if ranks is not None else None
            base = (members, str(backend))
            occurrence = self._seen.get(base, 0)
            self._seen[base] = occurrence + 1
            key = base + (occurrence,)
            if key not in self._groups:
                self._groups[key] = new_group(**call)
            return self._groups[key]
        return new_group_pooled

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        """``torch.distributed.destroy_process_group`` leaves pooled groups alive here."""
        from megatron_flat.runtime import patching

        def wrap(destroy):
            def destroy_unless_pooled(group=None):
                if group is not None and any(group is g for g in self.groups()):
                    return None
                return destroy(group)
            return destroy_unless_pooled

        patch = patching.Patch(
            "torch.distributed", "destroy_process_group", wrap=wrap, expects="a function",
            why="tests: Megatron's teardown leaves the pooled groups for the next layout")
        patching.apply(patch)
        try:
            yield
        finally:
            patching.revert(patch)

    def close(self) -> None:
        """Destroy the pooled gloo groups (local; NCCL groups are left, as
        :func:`destroy_gloo_groups_since` does) and forget them all."""
        live = live_groups()
        for group in self.groups():
            if group in live and dist.get_backend(group) == "gloo":
                dist.destroy_process_group(group)
        self._groups.clear()


_POOL: Optional[LayoutGroupPool] = None


@contextlib.contextmanager
def layout_group_pool() -> Iterator[LayoutGroupPool]:
    """Share process groups between the :func:`megatron_layout` calls made in this scope
    (:class:`LayoutGroupPool`); the groups are destroyed when it ends. A pool opened inside
    another serves the layouts of its own scope, then the outer one serves again."""
    global _POOL
    outer, _POOL = _POOL, LayoutGroupPool()
    try:
        yield _POOL
    finally:
        pool, _POOL = _POOL, outer
        pool.close()
