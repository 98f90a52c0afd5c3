"""Run Megatron-Core on a CPU-only torch with the gloo backend.

``enable_cpu_backend()`` applies a small set of narrow patches so that the parts of
Megatron-Core that megatron-flat builds on (GPTModel with MoE layers, the alltoall and
allgather dispatchers, TP with sequence parallelism, PP with the 1F1B schedule, the
DistributedOptimizer, full recompute) run on CPU tensors. It exists for tests, the
demo and benchmarks on machines without a GPU; production runs never call it.

Contract:
- Every patch is a no-op when CUDA is available (``enable_cpu_backend`` returns without
  touching anything), so calling it on a GPU machine is harmless.
- Each :class:`Workaround` says why it is needed, applies only where the installed
  megatron-core has what it patches (feature detection: ``Workaround.needed``), never by
  version number, and declares its monkey-patches as ``runtime.patching`` patches (owner,
  attribute, what must be there, why): a seam that moved stops with one ``PatchError``.
- Workarounds are applied once (idempotent) and listed by ``applied_workarounds()``.

The main mechanism is a *CPU view of torch.cuda* confined to named Megatron modules:
their module-global ``torch`` is replaced by a proxy that is the real ``torch`` except
for ``torch.cuda``, which maps devices to ``cpu``, streams and events to inline
objects, and the CUDA RNG to the CPU generator. User code and torch itself are never
changed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import os
import threading
import types
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import torch

from megatron_flat.megatron import compat
from megatron_flat.runtime import ledger, patching

log = logging.getLogger(__name__)

CPU = torch.device("cpu")


class _InlineStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: work is complete when it returns."""

    def __init__(self, *args, **kwargs):
        self.device = CPU

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _InlineEvent()

    def synchronize(self) -> None:
        ledger.record_sync("stream_synchronize")  # a host wait on a GPU

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        # One inline stream is as good as another: there is no concurrency on CPU.
        return isinstance(other, _InlineStream)

    def __hash__(self) -> int:
        return 0


class _InlineEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        ledger.record_sync("event_synchronize")  # a host wait on a GPU

    def query(self) -> bool:
        return True


class CudaOnCpu(types.SimpleNamespace):
    """The subset of ``torch.cuda`` Megatron-Core touches, answered for the CPU.

    Attributes not defined here fall through to the real ``torch.cuda`` (so a missed
    CUDA-only call still fails loudly, as it would have without the patch).
    """

    Stream = _InlineStream
    Event = _InlineEvent

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device():
        return CPU

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def current_stream(device=None):
        return _InlineStream()

    @staticmethod
    def default_stream(device=None):
        return _InlineStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None) -> None:
        ledger.record_sync("device_synchronize")  # a host wait on a GPU

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def nvtx_range_push(msg) -> None:
        pass

    # The "device" RNG is the CPU default generator: the RNG tracker then forks the
    # generator CPU ops (dropout) really use, so TP-region dropout differs per rank as
    # Megatron intends and recompute restores it.
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    max_memory_allocated = memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = memory_allocated


# Tensor factories whose ``device="cuda"`` literal (e.g. the causal mask, DDP buffers)
# must become the CPU inside proxied modules.
_FACTORIES = frozenset(
    "empty zeros ones full arange tensor as_tensor rand randn randint randperm linspace "
    "empty_like zeros_like ones_like full_like".split()
)


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return CPU
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return call


class TorchWithCpuCuda(types.ModuleType):
    """The real ``torch`` module, except that ``.cuda`` is ``CudaOnCpu`` and tensor
    factories place ``device="cuda"`` tensors on the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_PROXY: Optional[TorchWithCpuCuda] = None


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Workaround:
    """One CPU workaround: the patches it declares (``runtime.patching``; built when applied,
    so Megatron is imported only then), why, and whether the installed megatron-core needs it
    (``needed``: a feature check, e.g. "has GroupedMLP"). ``then`` runs once after its
    patches are in place (e.g. re-creating the RNG tracker from the patched class)."""

    name: str
    reason: str
    patches: Callable[[], Sequence[patching.Patch]]
    needed: Callable[[], bool] = _always
    then: Optional[Callable[[], None]] = None

    def apply(self) -> None:
        """Put its patches in place (each once: ``runtime.patching``), then run ``then``."""
        for patch in self.patches():
            patching.apply(patch)
        if self.then is not None:
            self.then()


_APPLIED: List[str] = []


def torch_proxy() -> TorchWithCpuCuda:
    global _TORCH_PROXY
    if _TORCH_PROXY is None:
        _TORCH_PROXY = TorchWithCpuCuda()
    return _TORCH_PROXY


def _is_torch(value) -> bool:
    return value is torch or isinstance(value, TorchWithCpuCuda)


def module_torch_patch(module: str, why: str, view: Callable[[], types.ModuleType] = None
                       ) -> patching.Patch:
    """``module``'s global ``torch`` becomes a CPU view of it (``torch_proxy()`` unless
    ``view`` makes another)."""
    make = view or torch_proxy
    return patching.Patch(module, "torch", lambda _: make(), expects="the torch module (or a "
                          "CPU view of it)", why=why, check=_is_torch)


def _modules_using_torch(names: Iterable[str]) -> List[str]:
    """The modules of ``names`` that the installed release has and that import torch (their
    twin elsewhere is listed separately for the release that has it)."""
    found = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is torch:
            found.append(name)
    return found


def _cpu_view_of_torch(*module_names: str) -> Callable[[], List[patching.Patch]]:
    """Give the named Megatron modules the CPU view of ``torch.cuda``."""

    def patches() -> List[patching.Patch]:
        return [module_torch_patch(name, "it calls torch.cuda on a CPU-only torch")
                for name in _modules_using_torch(module_names)]

    return patches


_RANDOM = "megatron.core.tensor_parallel.random"


def _cpu_rng_state_get(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_rng_state_set(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_tracker(stock):
    """Megatron's RNG tracker class over the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(stock):
        """Megatron's tracker over the CPU generator.

        Same bookkeeping as the CUDA tracker; ``fork`` omits the "CPU RNG state changed"
        check, which on CPU always fires because the forked generator *is* the CPU one.
        """

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer = self.states_[outer_name]
                torch.set_rng_state(outer)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _rng_patches() -> List[patching.Patch]:
    why = "model_parallel_cuda_manual_seed and the checkpoint RNG fork use the CUDA generator"
    return [
        patching.Patch(_RANDOM, "_get_cuda_rng_state", lambda _: _cpu_rng_state_get,
                       expects="a function", why=why),
        patching.Patch(_RANDOM, "_set_cuda_rng_state", lambda _: _cpu_rng_state_set,
                       expects="a function", why=why),
        patching.Patch(_RANDOM, "CudaRNGStatesTracker", _cpu_tracker, expects="a class",
                       why=why, check=lambda v: isinstance(v, type)),
        # torch.cuda.manual_seed / get_rng_state in the tracker's add()
        module_torch_patch(_RANDOM, why),
    ]


def _reset_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)


def _split_sizes_on_host(stock):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # Megatron converts split sizes to host numbers only for CUDA tensors; on CPU they
        # stayed tensors, which all_to_all_single rejects as split sizes. As on a GPU, the
        # result is a host copy made without waiting (Megatron waits once, on the copy
        # stream's event): the cost ledger sees a device->host copy and no sync per read.
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            host = tensor.clone()
            ledger.mark_host_memory(host)
            ledger.record_transfer(d2h_bytes=host.numel() * host.element_size())
            return host.numpy() if as_numpy else host
        return stock(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _split_size_patches() -> List[patching.Patch]:
    why = "it converts only CUDA split sizes to host numbers"
    return [patching.Patch(f"megatron.core.transformer.moe.{module}", "maybe_move_tensor_to_cpu",
                           _split_sizes_on_host, expects="a function", why=why)
            for module in ("moe_utils", "token_dispatcher")]


def _marks_host_indices(stock):
    @functools.wraps(stock)
    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        # Without permute fusion these chunk-sort indices are built with device="cpu", on a
        # GPU too: their .tolist() reads host memory, not a sync.
        if str(getattr(self, "permute_idx_device", "")) == "cpu":
            for name in ("sort_input_by_local_experts", "restore_output_by_local_experts"):
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    ledger.mark_host(value)

    return __init__


def _host_index_patches() -> List[patching.Patch]:
    return [patching.Patch(
        "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher", "__init__",
        _marks_host_indices, expects="a constructor",
        why="its chunk-sort indices are host data the ledger must not count as syncs")]


def _lacks_te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _te_general_gemm_patches() -> List[patching.Patch]:
    return [patching.Patch("megatron.core.transformer.moe.moe_utils", "te_general_gemm",
                           lambda _: None, expects="absent", missing_ok=True,
                           why="the router's gating linear reads it whether or not TE imported")]


def _sequence_parallel_torch_norm(stock):
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return stock(cls, config, hidden_size, *args, **kwargs)
        # The torch norm itself is sequence-parallel-agnostic (it normalises each token);
        # what SP needs is that its weight grads, partial over each rank's sequence shard,
        # are all-reduced over TP. Marking the params ``sequence_parallel`` makes
        # finalize_model_grads do exactly that, as it does for TE norms.
        plain = copy.copy(config)
        object.__setattr__(plain, "sequence_parallel", False)
        norm = stock(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def _torch_norm_patches() -> List[patching.Patch]:
    return [patching.Patch("megatron.core.transformer.torch_norm.WrappedTorchNorm", "__new__",
                           _sequence_parallel_torch_norm, expects="a constructor",
                           why="it asserts sequence parallelism off, which MoE with TP > 1 needs")]


_CUDA_NAMES = threading.local()  # depth of calls running with CUDA type names


def _with_cuda_type_names(fn: Callable) -> Callable:
    """Run ``fn`` while ``Tensor.type()`` names CPU tensors like CUDA ones.

    Megatron's optimizers classify params by ``param.type() == 'torch.cuda.FloatTensor'``
    (and Half/BFloat16) and reject anything else; on CPU the same classification is right
    once the name is read as the CUDA name. Scoped to the outermost wrapped call.
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        depth = getattr(_CUDA_NAMES, "depth", 0)
        if depth:  # inside another wrapped call: the names are CUDA's already
            return fn(*args, **kwargs)
        original = torch.Tensor.type

        def type_(self, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw and self.device.type == "cpu":
                return original(self).replace("torch.", "torch.cuda.", 1)
            return original(self, dtype, non_blocking, **kw)

        torch.Tensor.type = type_
        _CUDA_NAMES.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _CUDA_NAMES.depth = 0
            torch.Tensor.type = original

    return call


def _optimizer_type_patches() -> List[patching.Patch]:
    why = "it accepts only 'torch.cuda.*Tensor' type names"
    optim = "megatron.core.optimizer"
    wrap = _with_cuda_type_names
    return [
        patching.Patch(f"{optim}.distrib_optimizer.DistributedOptimizer",
                       "_build_model_and_main_param_groups", wrap, expects="a classmethod",
                       why=why, classmethod_=True),
        patching.Patch(f"{optim}.distrib_optimizer.DistributedOptimizer", "__init__", wrap,
                       expects="a constructor", why=why),
        patching.Patch(f"{optim}.optimizer.Float16OptimizerWithFloat16Params", "__init__", wrap,
                       expects="a constructor", why=why),
        patching.Patch(f"{optim}.clip_grads", "clip_grad_by_total_norm_fp32", wrap,
                       expects="a function", why=why),
        patching.Patch(f"{optim}.optimizer", "clip_grad_by_total_norm_fp32", wrap,
                       expects="a function", why=why),
    ]


def _padded_gather(stock):
    import torch.distributed as dist

    # gloo rejects the list forms of all_gather / reduce_scatter when sizes differ, which
    # Megatron uses for uneven splits (expert-tensor-parallel dispatch). Padding every
    # split to the largest and using the tensor forms moves the same bytes to the same
    # places; the padded rows are zeros and are dropped.
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or input_.device.type != "cpu" or group.size() == 1:
            return stock(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((width * group.size(),) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[r * width : r * width + n] for r, n in enumerate(output_split_sizes)])

    return _gather_along_first_dim


def _padded_reduce_scatter(stock):
    import torch.distributed as dist

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None,
                                        use_global_buffer=False):
        if input_split_sizes is None or input_.device.type != "cpu" or group.size() == 1:
            return stock(input_, group, input_split_sizes, use_global_buffer)
        width = max(input_split_sizes)
        padded = input_.new_zeros((width * group.size(),) + tuple(input_.shape[1:]))
        for r, piece in enumerate(torch.split(input_, list(input_split_sizes), dim=0)):
            padded[r * width : r * width + piece.shape[0]] = piece
        out = input_.new_empty((width,) + tuple(input_.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: input_split_sizes[group.rank()]].contiguous()

    return _reduce_scatter_along_first_dim


def _uneven_collective_patches() -> List[patching.Patch]:
    why = "gloo refuses the list collectives it uses for uneven splits"
    mappings = "megatron.core.tensor_parallel.mappings"
    return [patching.Patch(mappings, "_gather_along_first_dim", _padded_gather,
                           expects="a function", why=why),
            patching.Patch(mappings, "_reduce_scatter_along_first_dim", _padded_reduce_scatter,
                           expects="a function", why=why)]


def _fp8_off(stock):
    @functools.wraps(stock)
    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        # ``fp8 is not None`` turns the default ``fp8=False`` into fp8 mode, which then
        # reads transformer-engine's FP8GlobalStateManager; without TE fp8 cannot be on.
        self.fp8 = False

    return __init__


def _no_fp8_state_manager() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return not hasattr(mrandom, "FP8GlobalStateManager")


def _checkpoint_fp8_patches() -> List[patching.Patch]:
    return [patching.Patch(f"{_RANDOM}.CheckpointWithoutOutput", "__init__", _fp8_off,
                           expects="a constructor",
                           why="its default turns fp8 on, which needs transformer-engine")]


def _cuda_is_identity_during(stock):
    @functools.wraps(stock)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        # With PP > 1 and tied embeddings the last stage's output weight is moved with
        # ``weight.data.cuda()`` before the embedding group's all-reduce; on a CPU-only torch
        # the weight stays where it is (Tensor.cuda is the identity during this call).
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **kw: tensor
        try:
            return stock(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return setup_embeddings_and_output_layer


def _tied_embedding_patches() -> List[patching.Patch]:
    return [patching.Patch(
        "megatron.core.models.common.language_module.language_module.LanguageModule",
        "setup_embeddings_and_output_layer", _cuda_is_identity_during, expects="a method",
        why="it moves the last stage's shared output weight with .cuda()")]


_ROPE_MODULES = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def _cp_rotary_slice(stock):
    from megatron_flat.cpu.context_attention import load_balanced_chunks

    @functools.wraps(stock)
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        # Megatron uploads the two chunk indices from pinned host memory (.cuda), which a
        # CPU-only torch has neither of; the same selection is made from host indices, and
        # the ledger counts the 16-byte upload a GPU makes.
        if pos_emb.device.type != "cpu" or cp_group is None:
            return stock(pos_emb, seq_dim, cp_group)
        size = cp_group.size()
        index = torch.tensor(load_balanced_chunks(cp_group.rank(), size))
        ledger.record_transfer(h2d_bytes=index.numel() * index.element_size())
        shape = pos_emb.shape
        chunks = pos_emb.view(*shape[:seq_dim], 2 * size, -1, *shape[seq_dim + 1:])
        picked = chunks.index_select(seq_dim, index)
        return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])

    return get_pos_emb_on_this_cp_rank


def _cp_rotary_patches() -> List[patching.Patch]:
    """Every module that binds rope_utils' function (by import) gets the CPU slice."""
    from megatron.core.models.common.embeddings import rope_utils

    stock = rope_utils.get_pos_emb_on_this_cp_rank
    names = []
    for name in _ROPE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "get_pos_emb_on_this_cp_rank", None) is stock:
            names.append(name)
    return [_cp_rotary_patch(name) for name in names]


def _cp_rotary_patch(module: str) -> patching.Patch:
    return patching.Patch(module, "get_pos_emb_on_this_cp_rank", _cp_rotary_slice,
                          expects="a function",
                          why="it uploads chunk indices with pin_memory and .cuda()")


def _cpu_core_attention(stock):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_flat.cpu.context_attention import ContextParallelCoreAttention
    from megatron_flat.cpu.flash_attention import FlashCoreAttention

    substituted = (DotProductAttention, FlashCoreAttention)

    def __new__(cls, config=None, *args, **kwargs):
        # Python then runs the returned object's own __init__ with the same arguments.
        if cls is DotProductAttention and ("k_channels" in kwargs or "v_channels" in kwargs):
            from megatron_flat.cpu.mla_attention import (
                MLAContextParallelCoreAttention,
                MLADotProductAttention,
                announce_once,
            )

            announce_once()  # multi-latent attention: separate q/k and v head dims
            if getattr(config, "context_parallel_size", 1) > 1:
                return stock(MLAContextParallelCoreAttention)
            return stock(MLADotProductAttention)
        if cls in substituted and getattr(config, "context_parallel_size", 1) > 1:
            if not _ANNOUNCED:
                _ANNOUNCED.append(True)
                log.warning("megatron-flat CPU backend: core attention with context "
                            "parallelism %d is ContextParallelCoreAttention (K/V all-gather; "
                            "Megatron's local attention has no CP)",
                            config.context_parallel_size)
            cls = ContextParallelCoreAttention
        return stock(cls)

    return __new__


def _core_attention_patches() -> List[patching.Patch]:
    return [patching.Patch(
        "megatron.core.transformer.dot_product_attention.DotProductAttention", "__new__",
        _cpu_core_attention, expects="a constructor",
        why="it refuses context parallelism and MLA's separate head dims")]


_ANNOUNCED: List[bool] = []


def _mla_te_half_imported() -> bool:
    try:
        from megatron.core.transformer import multi_latent_attention as mla
    except ImportError:
        return False
    return bool(getattr(mla, "HAVE_TE", False)) and not isinstance(getattr(mla, "TELinear", None),
                                                                  type)


def _mla_patches() -> List[patching.Patch]:
    return [patching.Patch("megatron.core.transformer.multi_latent_attention", "HAVE_TE",
                           lambda _: False, expects="a bool", check=lambda v: isinstance(v, bool),
                           why="it is set when TE's extension module imports, without TE")]


def _inference_linears_placeholders() -> bool:
    """Megatron-LM main's ``inference_layers`` subclasses TE's linears, which without
    transformer-engine are placeholders: its ``is_inference_column_parallel_linear`` (called
    when an MTP layer is built) then passes ``isinstance`` a non-class."""
    try:
        from megatron.core.tensor_parallel import inference_layers
    except ImportError:
        return False
    probe = getattr(inference_layers, "is_inference_column_parallel_linear", None)
    classes = [getattr(inference_layers, name, None) for name in
               ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")]
    return probe is not None and not all(isinstance(c, type) for c in classes)


def _not_inference_linear(_stock):
    def is_inference_column_parallel_linear(module) -> bool:
        return False  # inference-optimized linears need transformer-engine, which is absent

    return is_inference_column_parallel_linear


def _inference_linear_patches() -> List[patching.Patch]:
    from megatron.core.tensor_parallel import inference_layers

    name = "is_inference_column_parallel_linear"
    owners = ["megatron.core.tensor_parallel.inference_layers"]
    # modules that bound the function by name when imported
    for module in ("megatron.core.transformer.multi_token_prediction",
                   "megatron.core.transformer.attention"):
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue
        if getattr(imported, name, None) is getattr(inference_layers, name):
            owners.append(module)
    return [patching.Patch(owner, name, _not_inference_linear, expects="a function",
                           why="its isinstance() gets TE placeholders without transformer-engine")
            for owner in owners]


def _te_grouped_wanted() -> bool:
    from megatron_flat.cpu.grouped import TE_GROUPED_ENV

    return os.environ.get(TE_GROUPED_ENV) == "1"


def _te_grouped_patches() -> List[patching.Patch]:
    from megatron_flat.cpu.grouped import te_grouped_patches

    return te_grouped_patches()


def _grouped_patches() -> List[patching.Patch]:
    from megatron_flat.cpu.grouped import reference_gmm_patches

    return reference_gmm_patches()


WORKAROUNDS: List[Workaround] = [
    Workaround(
        "torch.cuda view",
        "MoE dispatchers, p2p communication, schedules, DDP buffers, the optimizer, MTP's "
        "loss tracker, attention sinks and MLA's YaRN rotary call "
        "torch.cuda.current_device()/Stream()/current_stream() unconditionally.",
        _cpu_view_of_torch(
            "megatron.core.transformer.moe.token_dispatcher",
            "megatron.core.transformer.moe.moe_utils",
            "megatron.core.transformer.moe.router",
            "megatron.core.transformer.moe.experts",
            "megatron.core.transformer.moe.moe_layer",
            "megatron.core.transformer.moe.shared_experts",
            "megatron.core.tensor_parallel.layers",
            "megatron.core.tensor_parallel.mappings",
            "megatron.core.utils",
            "megatron.core.pipeline_parallel.p2p_communication",
            "megatron.core.pipeline_parallel.schedules",
            "megatron.core.models.common.embeddings.rotary_pos_embedding",
            "megatron.core.transformer.utils",
            "megatron.core.distributed.param_and_grad_buffer",
            "megatron.core.distributed.distributed_data_parallel",
            "megatron.core.distributed.finalize_model_grads",
            "megatron.core.optimizer",
            "megatron.core.optimizer.optimizer",
            "megatron.core.optimizer.distrib_optimizer",
            "megatron.core.optimizer.clip_grads",
            "megatron.core.optimizer.grad_scaler",
            "megatron.core.transformer.multi_token_prediction",
            # Attention sinks' learnable softmax offset and MLA's YaRN rotary are created on
            # torch.cuda.current_device() (GPT-OSS, DeepSeek-V3 / Kimi K2 lines).
            "megatron.core.transformer.dot_product_attention",
            "megatron.core.transformer.multi_latent_attention",
            "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        ),
    ),
    Workaround(
        "CPU RNG tracker",
        "model_parallel_cuda_manual_seed and the checkpoint RNG fork read and set the CUDA "
        "generator; on CPU the tracker forks the CPU generator instead.",
        _rng_patches,
        then=_reset_rng_tracker,
    ),
    Workaround(
        "a2a split sizes on host",
        "maybe_move_tensor_to_cpu only converts CUDA tensors, leaving CPU split-size "
        "tensors that all_to_all_single cannot take.",
        _split_size_patches,
    ),
    Workaround(
        "dispatcher host indices",
        "The alltoall dispatcher builds its chunk-sort indices on the host (on a GPU too); on "
        "CPU they are marked host data so the cost ledger does not count reading them as "
        "host syncs.",
        _host_index_patches,
    ),
    Workaround(
        "te_general_gemm global",
        "Where moe_utils binds te_general_gemm only when transformer-engine imports (0.16), the "
        "router's gating linear still reads it unconditionally (NameError without TE).",
        _te_general_gemm_patches,
        needed=_lacks_te_general_gemm,
    ),
    Workaround(
        "torch norm under sequence parallelism",
        "WrappedTorchNorm asserts sequence_parallel is off (TE norms are the GPU path), yet MoE "
        "with TP>1 requires SP; the norm is built as usual and its params marked for the "
        "TP all-reduce of SP grads.",
        _torch_norm_patches,
    ),
    Workaround(
        "optimizer param type names",
        "DistributedOptimizer, Float16OptimizerWithFloat16Params and grad clipping accept "
        "only 'torch.cuda.*Tensor' type names; CPU params are classified by the same rule.",
        _optimizer_type_patches,
    ),
    Workaround(
        "uneven first-dim gather/reduce-scatter",
        "Expert-tensor-parallel dispatch gathers and reduce-scatters uneven splits with the "
        "list collectives, which gloo refuses when sizes differ.",
        _uneven_collective_patches,
    ),
    Workaround(
        "CheckpointWithoutOutput without fp8",
        "Selective recompute (layernorm, mla_up_proj, ...) builds CheckpointWithoutOutput, whose "
        "default turns fp8 mode on and then needs transformer-engine's FP8GlobalStateManager.",
        _checkpoint_fp8_patches,
        needed=_no_fp8_state_manager,
    ),
    Workaround(
        "tied embeddings across pipeline stages",
        "setup_embeddings_and_output_layer moves the last stage's shared output weight with "
        "weight.data.cuda() before the embedding-group all-reduce (PP > 1, tied embeddings).",
        _tied_embedding_patches,
    ),
    Workaround(
        "rotary chunks under context parallelism",
        "get_pos_emb_on_this_cp_rank uploads its chunk indices with pin_memory=True and .cuda(), "
        "neither of which a CPU-only torch has.",
        _cp_rotary_patches,
    ),
    Workaround(
        "core attention under context parallelism",
        "DotProductAttention (the local spec's core attention) refuses context_parallel_size > 1 "
        "(Megatron's CP lives in transformer-engine's attention); under CP it is built as "
        "cpu.context_attention.ContextParallelCoreAttention, exact and O(N). "
        "Multi-latent attention builds it with k_channels/v_channels, which it does not take: "
        "there it is cpu.mla_attention.MLADotProductAttention (the stock forward).",
        _core_attention_patches,
    ),
    Workaround(
        "MLA without transformer-engine",
        "multi_latent_attention sets HAVE_TE when megatron.core.extensions.transformer_engine "
        "imports, which it does without transformer-engine, leaving TELinear a placeholder "
        "that is not a class; its isinstance(linear_proj, TELinear) then raises. HAVE_TE is "
        "set to what is true.",
        _mla_patches,
        needed=_mla_te_half_imported,
    ),
    Workaround(
        "inference linears without transformer-engine",
        "Megatron-LM main asks is_inference_column_parallel_linear of every MTP layer's "
        "projection; its inference linears subclass TE's, placeholders without "
        "transformer-engine, so isinstance raises. No linear is an inference-optimized one "
        "without transformer-engine: the question is answered False.",
        _inference_linear_patches,
        needed=_inference_linears_placeholders,
    ),
    Workaround(
        "grouped_gemm reference",
        "GroupedMLP (--moe-grouped-gemm) calls the CUDA-only grouped_gemm package and asserts "
        "bf16; a per-expert matmul loop (cpu.grouped.gmm) stands in, in any dtype.",
        _grouped_patches,
        needed=lambda: compat.grouped_mlp_class() is not None,
    ),
    Workaround(
        "TEGroupedMLP on CPU",
        "a transformer-engine line with --moe-grouped-gemm builds TEGroupedMLP (with biases: "
        "GPT-OSS); run with the local spec, it would build 0.16's legacy GroupedMLP (which "
        "refuses biases) or 0.19's SequentialMLP. With MEGATRON_FLAT_CPU_TE_GROUPED=1 (the "
        "rehearsal of such a line) the local spec builds TEGroupedMLP over CPU grouped linears "
        "(cpu.grouped), one weight and bias per expert as TE's.",
        _te_grouped_patches,
        needed=_te_grouped_wanted,
    ),
]


def cuda_present() -> bool:
    return torch.cuda.is_available()


def enable_cpu_backend() -> List[str]:
    """Make the installed megatron-core run on CPU with gloo; returns the workarounds applied.

    A no-op (returns ``[]``) when CUDA is available. Idempotent.
    """
    if cuda_present():
        return []
    compat.check_supported()
    apply_workarounds(WORKAROUNDS)
    return list(_APPLIED)


def apply_workarounds(workarounds: Sequence[Workaround]) -> List[str]:
    """Apply each of ``workarounds`` the installed code needs, once per process: its patches
    through ``runtime.patching`` (the one record of what is patched), then its ``then``;
    returns the names of ``workarounds`` applied now or before (``applied_workarounds()``)."""
    for workaround in workarounds:
        if workaround.name in _APPLIED or not workaround.needed():
            continue
        workaround.apply()
        _APPLIED.append(workaround.name)
        log.debug("megatron-flat CPU workaround applied: %s (%s)", workaround.name,
                  workaround.reason)
    return [w.name for w in workarounds if w.name in _APPLIED]


def applied_workarounds() -> List[str]:
    return list(_APPLIED)
