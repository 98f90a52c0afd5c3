"""Grouped-GEMM experts on CPU: the reference kernels Megatron's grouped experts call.

Megatron's grouped experts (``--moe-grouped-gemm``) need CUDA-only kernels: 0.16's
``GroupedMLP`` calls ``grouped_gemm.ops.gmm`` (a separate CUDA package) and asserts bf16;
``TEGroupedMLP`` (0.16 and 0.19; 0.19 has no ``GroupedMLP``) builds its two linears from
transformer-engine's ``GroupedLinear``. Here they get exact CPU stand-ins, so the stock
grouped layer runs under the CPU backend and is an exactness reference:

* :func:`gmm` — the ``grouped_gemm.ops.gmm`` contract as a per-expert matmul loop; the CPU
  backend's "grouped_gemm reference" patch installs it where ``GroupedMLP`` looks it up
  (``moe.grouped_gemm_util``) and lets ``GroupedMLP`` run in fp32 (the bf16 assert guards
  the CUDA kernel, not the maths).
* :class:`CpuColumnParallelGroupedLinear` / :class:`CpuRowParallelGroupedLinear` — a
  ``GroupedLinear`` for ``TEGroupedMLP``'s builder protocol: one weight per local expert in
  TE's layout (``weight{i}``, exactly ``SequentialMLP``'s ``linear_fc{1,2}.weight`` of
  expert i), each expert's rows through Megatron's own linear function (so ``main_grad`` and
  ``gradient_accumulation_fusion`` behave as Megatron's linears do). With ``bias`` one
  ``bias{i}`` per expert (zeros, as TE initialises them), added to expert i's rows, or with
  ``skip_bias_add`` returned as TE returns them (the list of every expert's bias: fc2 of
  ``TEGroupedMLP``, which adds ``b_i · prob`` itself). Under expert tensor parallelism each
  rank holds its shard, as ``SequentialMLP``'s expert linears do. Their sharded state dict
  is TE's grouped linear's: replica ids from the expert-data-parallel rank (the dense DP
  group's would mark every copy of EP rank 1's experts a replica, and a torch_dist save then
  finds those experts with no main replica), TP split over the expert-TP group.

Every expert's rows go through the same ``x @ W`` a ``SequentialMLP`` expert computes, so on
this machine's BLAS the grouped layer equals the sequential one bitwise (tests check it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from typing import Iterator, List, Sequence

import torch

from megatron_flat.runtime import patching

__all__ = ["TE_GROUPED_ENV", "gmm", "reference_gmm_patches", "grouped_experts_spec",
           "te_grouped_experts", "te_grouped_patches", "CpuColumnParallelGroupedLinear",
           "CpuRowParallelGroupedLinear"]


def _split_sizes(a: torch.Tensor, b: torch.Tensor, batch_sizes) -> list:
    sizes = [int(s) for s in (batch_sizes.tolist() if torch.is_tensor(batch_sizes)
                              else batch_sizes)]
    if a.dim() != 2 or b.dim() != 3 or len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: a {tuple(a.shape)} rows grouped by batch_sizes {sizes} do not "
                         f"match b {tuple(b.shape)} ([experts, K, N])")
    return sizes


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``: ``a [T, K]`` with rows grouped by expert in order
    (``batch_sizes [E]``, host integers), ``b [E, K, N]`` (``[E, N, K]`` with ``trans_b``);
    returns ``[T, N]`` with expert e's rows times ``b[e]`` (``b[e].T``). Plain autograd."""
    sizes = _split_sizes(a, b, batch_sizes)
    rows = torch.split(a, sizes)
    return torch.cat([x @ (b[e].t() if trans_b else b[e]) for e, x in enumerate(rows)])


def _bf16_for_the_call(stock):
    @functools.wraps(stock)
    def forward(self, *args, **kwargs):
        config = self.config
        if config.bf16:
            return stock(self, *args, **kwargs)
        self.config = copy.copy(config)
        self.config.bf16 = True
        try:
            return stock(self, *args, **kwargs)
        finally:
            self.config = config

    return forward


_REFERENCE_OPS = types.SimpleNamespace(gmm=gmm)
_REFERENCE_PACKAGE = types.SimpleNamespace(ops=_REFERENCE_OPS, __name__="cpu_reference")


def reference_gmm_patches() -> List[patching.Patch]:
    """CPU patches (0.16): ``GroupedMLP`` finds a ``grouped_gemm`` whose ``ops.gmm`` is
    :func:`gmm`, and runs without ``config.bf16`` (it is given a private copy of its config
    with the flag set for the call: nothing else in its forward reads it)."""
    why = "GroupedMLP calls the CUDA-only grouped_gemm package and asserts bf16"
    util = "megatron.core.transformer.moe.grouped_gemm_util"
    return [
        patching.Patch(util, "grouped_gemm", lambda _: _REFERENCE_PACKAGE,
                       expects="the grouped_gemm package or None", why=why,
                       check=lambda v: True, missing_ok=True),
        patching.Patch(util, "ops", lambda _: _REFERENCE_OPS, expects="grouped_gemm's ops",
                       why=why, check=lambda v: True, missing_ok=True),
        patching.Patch("megatron.core.transformer.moe.experts.GroupedMLP", "forward",
                       _bf16_for_the_call, expects="a method", why=why),
    ]


class _CpuGroupedLinear(torch.nn.Module):
    """``num_gemms`` linears applied to consecutive row groups (``forward(x, m_splits) ->
    (out, None)``, or ``(out, [bias_i])`` with ``skip_bias_add``), each this expert-TP rank's
    shard of a ``[output_size, input_size]`` linear, initialised as Megatron's expert linears
    are (the CPU master weight, split as ``SequentialMLP``'s: a gated fc1 with stride 2, so
    each rank holds ``[W_r; V_r]``), biases zero as TE's.

    As TE's grouped linear under expert parallelism, it communicates nothing: the token
    dispatcher gathers and reduce-scatters over the expert-TP group.

    ``sharded_state_dict`` is TE's grouped linear's: each ``weight{i}`` (``bias{i}``) as its
    global expert's shard (the expert axis offset by this EP rank's first expert), split
    over the expert-TP group on ``tp_axis`` (a row linear's bias whole, replicated over
    expert TP), its replica id's data-parallel part this rank's expert-data-parallel rank —
    the experts' copies live across expert DP, not the dense DP group — and one
    ``_extra_state`` object per expert (``_extra_state``, ``_extra_state1``, ...).
    ``TEGroupedMLP`` adds the SwiGLU split and SequentialMLP's keys on top."""

    tp_axis = 0  # the weight axis expert tensor parallelism splits (column: rows)

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name=None, pg_collection=None, name=None) -> None:
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

        if pg_collection is None:  # as TE's grouped linear: Megatron's global groups
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg = pg_collection
        tp = getattr(pg_collection, "expt_tp", None)
        tp_size, tp_rank = (tp.size(), tp.rank()) if tp is not None else (1, 0)
        full = (output_size, input_size)
        if full[self.tp_axis] % tp_size:
            raise ValueError(f"the CPU grouped linear's {('output', 'input')[self.tp_axis]} "
                             f"size {full[self.tp_axis]} does not split over expert "
                             f"tensor parallelism {tp_size}")
        local = list(full)
        local[self.tp_axis] //= tp_size
        # SequentialMLP's fc1 under a gated linear unit: [W; V] split with stride 2.
        stride = 2 if self.tp_axis == 0 and config.gated_linear_unit else 1
        self.config = config
        self.num_gemms = num_gemms
        self.use_bias = bool(bias)
        self.skip_bias_add = bool(skip_bias_add)
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(*local, dtype=config.params_dtype))
            _initialize_affine_weight_cpu(weight, output_size, input_size,
                                          local[self.tp_axis], self.tp_axis, init_method,
                                          stride=stride, params_dtype=config.params_dtype,
                                          rank=tp_rank, world_size=tp_size)
            # Expert weights are reduced over the expert-data-parallel group only.
            weight.allreduce = not (is_expert and config.expert_model_parallel_size > 1)
            self.register_parameter(f"weight{i}", weight)
            if self.use_bias:
                b = torch.nn.Parameter(torch.zeros(local[0], dtype=config.params_dtype))
                b.allreduce = weight.allreduce
                self.register_parameter(f"bias{i}", b)
        # A checkpoint's per-expert extra states (TE's fp8 metadata; none here) come back as
        # _extra_state1.. beside _extra_state: TE merges them into one, here they are dropped.
        # A plain state dict without one loads too (as Megatron's local linears allow).
        self._register_load_state_dict_pre_hook(self._drop_expert_extra_states)

    def _drop_expert_extra_states(self, state_dict, prefix, *args, **kwargs) -> None:
        for i in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{i}", None)
        state_dict.setdefault(f"{prefix}_extra_state")

    def get_extra_state(self) -> None:
        """TE's grouped linear keeps fp8 metadata here; the CPU one has none (``None``, as
        Megatron's local linears), but keeps the key, so state dicts have TE's keys."""
        return None

    def set_extra_state(self, state) -> None:
        """Extra state is ignored (there is no fp8 metadata on CPU)."""

    def biases(self) -> list:
        """Every expert's bias, in expert order (empty without bias)."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias \
            else []

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]):
        from megatron.core.tensor_parallel.layers import (
            linear_with_grad_accumulation_and_async_allreduce,
        )

        added = self.use_bias and not self.skip_bias_add
        outs = [linear_with_grad_accumulation_and_async_allreduce(
                    rows, getattr(self, f"weight{i}"),
                    getattr(self, f"bias{i}") if added else None,
                    gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
                    allreduce_dgrad=False, sequence_parallel=False)
                for i, rows in enumerate(torch.split(x, list(m_splits)))]
        return torch.cat(outs), (self.biases() if self.use_bias and self.skip_bias_add
                                 else None)

    def backward_dw(self) -> None:  # weight gradients are never deferred here
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        ep, tp, edp = self._pg.ep, self._pg.expt_tp, self._pg.expt_dp
        # 0.19's TE numbers extra-state objects over expert DP x GTP remat (expert DP without
        # GTP, the only case here; 0.16 has no such group).
        edp_objects = getattr(self._pg, "expt_dp_gtp_remat", None)
        if edp_objects is None:
            edp_objects = edp
        ep_size = ep.size() if ep is not None else 1
        first = (ep.rank() if ep is not None else 0) * self.num_gemms
        total = ep_size * self.num_gemms
        dp_cp = (metadata or {}).get("dp_cp_group")
        # A column linear's bias is split as its rows; a row linear's is whole.
        axes = {"weight": self.tp_axis, **({"bias": 0} if self.tp_axis == 0 else {})}
        out = {}
        for i in range(self.num_gemms):
            offsets = (*sharded_offsets, (len(sharded_offsets), first + i, total))
            entries = {"weight": getattr(self, f"weight{i}"), "_extra_state": None}
            if self.use_bias:
                entries["bias"] = getattr(self, f"bias{i}")
            sub = make_sharded_tensors_for_checkpoint(entries, prefix, axes, offsets,
                                                      tp_group=tp, dp_cp_group=dp_cp)
            for name, sh in sub.items():
                # The expert's copies are its expert-DP peers (EP rank r's experts have no
                # other owner): only expert-DP rank 0 holds the main replica.
                group = edp_objects if isinstance(sh, ShardedObject) else edp
                fully_sharded = getattr(sh, "is_data_parallel_fully_shard", False)
                edp_rank = 0 if fully_sharded or group is None else group.rank()
                sh.replica_id = (*sh.replica_id[:2], edp_rank)
                # TE's keys: weight{i}, bias{i}, and _extra_state, _extra_state1, ...
                suffix = "" if name.endswith("_extra_state") and i == 0 else str(i)
                out[f"{name}{suffix}"] = sh
        return out


class CpuColumnParallelGroupedLinear(_CpuGroupedLinear):
    """fc1 of ``TEGroupedMLP`` on CPU (column-parallel over expert TP)."""

    tp_axis = 0


class CpuRowParallelGroupedLinear(_CpuGroupedLinear):
    """fc2 of ``TEGroupedMLP`` on CPU (row-parallel over expert TP)."""

    tp_axis = 1


TE_GROUPED_ENV = "MEGATRON_FLAT_CPU_TE_GROUPED"
"""Set to 1 (the rehearsal does, for a transformer-engine line with ``--moe-grouped-gemm``):
the local spec's grouped experts are ``TEGroupedMLP`` over the CPU grouped linears."""


def _te_grouped_modules(stock):
    """``LocalSpecProvider.grouped_mlp_modules`` giving, for grouped GEMM (not the legacy
    kind), ``TEGroupedMLP`` over the CPU grouped linears in the release's return form."""

    @functools.wraps(stock)
    def grouped_mlp_modules(self, moe_use_grouped_gemm, *args, **kwargs):
        legacy = bool(args[0]) if args else bool(kwargs.get("moe_use_legacy_grouped_gemm"))
        if not moe_use_grouped_gemm or legacy:
            return stock(self, moe_use_grouped_gemm, *args, **kwargs)
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_flat.megatron import compat

        spec = compat.te_grouped_mlp_spec(CpuColumnParallelGroupedLinear,
                                          CpuRowParallelGroupedLinear)
        # 0.16 returns (module, submodules); 0.17 on an experts builder (a partial).
        return (spec.module, spec.submodules) if isinstance(spec, ModuleSpec) else spec

    return grouped_mlp_modules


def te_grouped_patches() -> List[patching.Patch]:
    """The local spec builds a transformer-engine line's grouped experts as that line does
    on a GPU: ``TEGroupedMLP`` (biases included: GPT-OSS), its two grouped linears the CPU
    ones above, instead of 0.16's legacy ``GroupedMLP`` (no biases) or 0.19's
    ``SequentialMLP``."""
    return [patching.Patch(
        "megatron.core.models.backends.LocalSpecProvider", "grouped_mlp_modules",
        _te_grouped_modules, expects="a method",
        why="a transformer-engine line's grouped experts are TEGroupedMLP; on CPU the local "
            "spec stands in for TE's, so it builds TEGroupedMLP over CPU grouped linears")]


@contextlib.contextmanager
def te_grouped_experts() -> Iterator[None]:
    """Within the block the local spec builds grouped experts as :func:`te_grouped_patches`
    says (in-process builds of a transformer-engine line; the rehearsal sets
    ``TE_GROUPED_ENV`` instead, for the whole run)."""
    patches = te_grouped_patches()
    fresh = [p for p in patches if not patching.is_applied(p)]
    for patch in fresh:
        patching.apply(patch)
    try:
        yield
    finally:
        for patch in fresh:
            patching.revert(patch)


def grouped_experts_spec(prefer_te: bool = False):
    """The installed release's grouped-GEMM experts spec, runnable here: 0.16's
    ``GroupedMLP`` (through :func:`gmm` on CPU), else ``TEGroupedMLP`` with
    transformer-engine's grouped linears when ``prefer_te`` and it is importable, else with
    the CPU grouped linears above."""
    from megatron_flat.megatron import compat

    cls = compat.grouped_mlp_class()
    if cls is not None:
        from megatron.core.transformer.spec_utils import ModuleSpec

        return ModuleSpec(module=cls)
    from megatron_flat.runtime import extras

    if prefer_te and extras.available("transformer_engine"):
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        return compat.te_grouped_mlp_spec(TEColumnParallelGroupedLinear,
                                          TERowParallelGroupedLinear)
    return compat.te_grouped_mlp_spec(CpuColumnParallelGroupedLinear,
                                      CpuRowParallelGroupedLinear)
