"""The one place that knows how the installed megatron-core differs from others.

Each difference is detected by what the installed code has (a class, a module function, a
parameter), not by its version number, so a release between or after the tested ones
(0.16.1, 0.17.0, 0.18.0, 0.19.x, main) gets the mechanism it really has. Each gate says which
releases take which branch and why. ``check_supported()`` refuses only releases older than
0.16 and warns once about one newer than the newest tested. Importing this module does not
import megatron-core; ``version()`` does, lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from typing import Any, Optional, Tuple

OLDEST = (0, 16)  # older releases lack the process-group collections and MoE layouts used here
NEWEST_TESTED = (0, 20)  # Megatron-LM main as of docs/versions.md


@functools.lru_cache(maxsize=None)
def version() -> Tuple[int, int, int]:
    """The installed megatron-core version as (major, minor, patch)."""
    from megatron.core import package_info

    return (package_info.MAJOR, package_info.MINOR, int(str(package_info.PATCH).split("rc")[0]))


def minor() -> Tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    return version()[:2]


def version_text() -> str:
    return ".".join(map(str, version()))


class UntestedMegatronWarning(UserWarning):
    """The installed megatron-core is newer than any release megatron-flat was tested with."""


@functools.lru_cache(maxsize=None)
def check_supported() -> None:
    """Raise a clear error on a megatron-core older than 0.16; warn once on one newer than the
    newest tested (the features it has are detected; rehearse a launch before trusting it)."""
    mm = minor()
    if mm < OLDEST:
        raise RuntimeError(f"megatron-flat needs megatron-core {OLDEST[0]}.{OLDEST[1]} or newer; "
                           f"found {version_text()}")
    if mm > NEWEST_TESTED:
        warnings.warn(
            f"megatron-core {version_text()} is newer than the newest release megatron-flat was "
            f"tested with ({NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}); its hooks are chosen by the "
            "features found. Check a launch line first: python -m megatron_flat rehearse",
            UntestedMegatronWarning, stacklevel=2)


# ---------------------------------------------------------------------------- MoE layer specs
# How an MoE layer is described and built differs between releases:
# * 0.16: the MoE "spec" is a ``ModuleSpec(module=MoELayer, submodules=MoESubmodules(...),
#   metainfo=...)`` built with ``build_module(spec, config=..., **kwargs)``; TransformerLayer
#   passes ``pg_collection`` only when ``spec.module`` *is* MoELayer (an exact-class check), so a
#   subclass gets ``pg_collection=None`` and MoELayer falls back to the global parallel_state
#   groups (``get_default_pg_collection()``).
# * 0.19: the MoE spec is ``functools.partial(MoELayer, submodules=MoESubmodules(...))`` called
#   as ``spec(config=..., pg_collection=..., is_mtp_layer=..., name=...)``: subclasses get the
#   layer's process groups.
# Detected by the spec's type (each spec carries its release's shape), so a spec built by the
# installed release is always handled the way that release builds it.


def moe_spec_module(spec):
    """The class an MLP/MoE spec builds (``ModuleSpec.module`` or ``partial.func``), or None."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return spec.module if isinstance(spec.module, type) else None
    if isinstance(spec, functools.partial):
        return spec.func if isinstance(spec.func, type) else None
    return spec if isinstance(spec, type) else None


def replace_moe_module(spec, module: type, **params):
    """``spec`` (an MoE spec of either release) building ``module`` instead, with extra init
    keyword ``params``; submodules, metainfo and existing params are kept."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):  # 0.16
        return dataclasses.replace(spec, module=module, params={**spec.params, **params})
    if isinstance(spec, functools.partial):  # 0.19
        return functools.partial(module, *spec.args, **{**spec.keywords, **params})
    raise TypeError(f"not an MoE module spec: {spec!r}")


def build_moe_layer(spec, config, pg_collection=None):
    """Build an MoE layer from a spec of either release, as TransformerLayer would."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(spec, ModuleSpec):  # 0.16
        kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        return build_module(spec, config=config, **kwargs)
    return spec(config=config, pg_collection=pg_collection)  # 0.19


# Grouped experts (--moe-grouped-gemm): 0.16 has ``GroupedMLP`` (weights ``weight1 [H, E_l·2F]``
# and ``weight2 [E_l·F, H]``, read as ``[E_l, H, 2F]`` / ``[E_l, F, H]`` blocks, the transposes of
# SequentialMLP's) and ``TEGroupedMLP`` (submodules ``MLPSubmodules``); 0.19 dropped
# ``GroupedMLP`` and gives ``TEGroupedMLP`` ``GroupedMLPSubmodules`` (per-expert ``weight{i}``,
# SequentialMLP's layout). An MoE spec's experts are replaced the way its release builds.


def grouped_mlp_class():
    """0.16's ``GroupedMLP`` (the ``grouped_gemm`` experts), or None (0.19 has none)."""
    from megatron.core.transformer.moe import experts

    return getattr(experts, "GroupedMLP", None)


def te_grouped_mlp_spec(linear_fc1: type, linear_fc2: type):
    """A spec building ``TEGroupedMLP`` with the given grouped linears, in the installed
    release's form: ``partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(...))`` where
    ``GroupedMLPSubmodules`` exists (0.17 on), else a ``ModuleSpec`` with ``MLPSubmodules``."""
    from megatron.core.transformer.moe import experts

    if hasattr(experts, "GroupedMLPSubmodules"):
        return functools.partial(experts.TEGroupedMLP, submodules=experts.GroupedMLPSubmodules(
            linear_fc1=linear_fc1, linear_fc2=linear_fc2))
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=experts.TEGroupedMLP,
                      submodules=MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2))


def replace_experts(spec, experts_spec):
    """An MoE spec of either release with its experts built from ``experts_spec``."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):  # 0.16
        return dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, experts=experts_spec))
    if isinstance(spec, functools.partial):  # 0.19
        submodules = dataclasses.replace(spec.keywords["submodules"], experts=experts_spec)
        return functools.partial(spec.func, *spec.args,
                                 **{**spec.keywords, "submodules": submodules})
    raise TypeError(f"not an MoE module spec: {spec!r}")


def local_expert_weights(experts, *, grads: bool = False) -> list:
    """``[(fc1 [2F or F, H], fc2 [H, F])]`` per local expert, in SequentialMLP's layout, as
    views of ``experts``' parameters (``SequentialMLP``, ``GroupedMLP`` or ``TEGroupedMLP``);
    ``grads``: of their ``.grad`` instead."""
    def get(p):
        return p.grad if grads else p

    n = experts.num_local_experts
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return [(get(e.linear_fc1.weight), get(e.linear_fc2.weight))
                for e in experts.local_experts]
    if hasattr(experts, "weight1"):  # GroupedMLP
        hidden = experts.config.hidden_size
        fc1 = get(experts.weight1).view(n, hidden, -1)
        fc2 = get(experts.weight2).view(n, -1, hidden)
        return [(fc1[i].t(), fc2[i].t()) for i in range(n)]
    return [(get(getattr(experts.linear_fc1, f"weight{i}")),
             get(getattr(experts.linear_fc2, f"weight{i}"))) for i in range(n)]  # TEGroupedMLP


def moe_layer_recompute(layer) -> bool:
    """Whether ``MoELayer.forward`` wraps its body in ``tensor_parallel.checkpoint``.

    0.16 checks ``moe_layer_recompute`` alone; 0.17 on add ``and self.training`` (no
    recompute in eval), read from the installed ``MoELayer.forward``. Mirrored so a subclass's
    forward recomputes exactly when the stock one would.
    """
    if _moe_recompute_only_in_training():
        return bool(layer.moe_layer_recompute and layer.training)
    return bool(layer.moe_layer_recompute)


@functools.lru_cache(maxsize=None)
def _moe_recompute_only_in_training() -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    try:
        source = inspect.getsource(MoELayer.forward)
    except (OSError, TypeError):  # no source: assume the newer behaviour
        return True
    return re.search(r"moe_layer_recompute\s+and\s+self\.training", source) is not None


# ---------------------------------------------------------------------------- optimizer build
# Both releases build each sub-optimizer (dense, expert) — the inner torch optimizer and the
# Megatron wrapper around it (DistributedOptimizer, Float16OptimizerWithFloat16Params,
# FP32Optimizer) — in ``megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups``,
# which ``get_megatron_optimizer`` looks up by its module-global name, with keyword arguments.
# * 0.19 adds ``skip_megatron_wrapping=True`` (used by the layer-wise optimizer for emerging
#   optimizers): the result is then a raw ``(optimizer, init_state_fn)`` tuple, not a wrapper;
# * 0.19 adds ``OptimizerConfig.optimizer_cuda_graph``, which makes the inner optimizer
#   capturable (its step captured in a CUDA graph).


def inner_optimizer_builder():
    """``(module, attribute name)`` of the function that builds one Megatron sub-optimizer."""
    import megatron.core.optimizer as optimizer_module

    name = "_get_megatron_optimizer_based_on_param_groups"
    if not callable(getattr(optimizer_module, name, None)):
        raise RuntimeError(f"megatron.core.optimizer.{name} not found in megatron-core "
                           f"{version_text()}")
    return optimizer_module, name


def builder_returns_unwrapped(kwargs) -> bool:
    """Whether a call of the sub-optimizer builder returns a raw ``(optimizer, init_state_fn)``
    tuple instead of a Megatron optimizer (0.19's ``skip_megatron_wrapping``)."""
    return bool(kwargs.get("skip_megatron_wrapping", False))


def optimizer_capturable(config) -> bool:
    """Whether an OptimizerConfig (or Megatron-LM args) asks for a CUDA-graph-captured
    optimizer step (0.19's ``optimizer_cuda_graph``; absent in 0.16)."""
    return bool(getattr(config, "optimizer_cuda_graph", False))


# ---------------------------------------------------------------------------- output layer + loss
# Ring-DTP (megatron.vocab) replaces the projection + loss tail of ``GPTModel._postprocess``,
# which both releases call with keyword arguments from ``forward`` and from the combined-1F1B
# schedule plan's post-process node.
# * 0.19 adds ``output_processor=`` to ``forward``/``_postprocess``: a callable run in place of
#   the projection + loss (after MTP), given hidden states, ``output_layer``, ``output_weight``,
#   labels and loss mask. 0.16 has no such hook: the tail is taken over in the wrapper.
# * 0.19 adds MuP: ``_scale_logits`` multiplies the logits by ``config.mup_output_mult`` when
#   ``config.use_mup`` (absent in 0.16).
# * Inference: 0.16 treats a call as inference when an ``inference_context`` is given (and the
#   model is not training); 0.19 asks ``InferenceMode.is_active()``.
# * ``tensor_parallel.vocab_parallel_cross_entropy`` takes ``tp_group=`` from 0.19; 0.16 uses
#   the global tensor-parallel group.


def postprocess_has_output_processor() -> bool:
    """Whether ``GPTModel._postprocess`` takes 0.19's ``output_processor=`` hook."""
    import inspect

    from megatron.core.models.gpt import GPTModel

    return "output_processor" in inspect.signature(GPTModel._postprocess).parameters


# Multi-token prediction (``config.mtp_num_layers``): both releases run the MTP block inside
# ``_postprocess``, split its output into 1 + D chunks of the main hidden states' shape and,
# per head, call ``output_layer(chunk, weight=..., runtime_gather_output=...)``, roll labels
# and loss mask left by one (``roll_tensor``), ``compute_language_model_loss(labels,
# logits)``, mask, log and attach the scaled loss to the main hidden states through
# ``MTPLossAutoScaler``.
# * 0.16: the per-head loop is inline in ``_postprocess``, reading ``self.output_layer`` and
#   ``self.compute_language_model_loss``; the main head then goes through the same pair.
# * 0.19: the loop is the module function ``gpt_model.process_mtp_loss`` (looked up at call
#   time, called with keywords, ``output_layer``/``compute_language_model_loss`` passed in);
#   the main head goes through ``output_processor``. Each head also counts its top-1
#   acceptance (``multi_token_prediction._compute_mtp_acceptance_counts``, an argmax over
#   the logits).


def mtp_loss_function():
    """(module, name) of 0.19's per-head MTP loop ``process_mtp_loss`` as ``_postprocess``
    looks it up, or None (0.16: inline)."""
    from megatron.core.models.gpt import gpt_model

    return (gpt_model, "process_mtp_loss") if hasattr(gpt_model, "process_mtp_loss") else None


def mtp_layer_field(submodules) -> Optional[str]:
    """The field of an MTP layer's submodules that holds its inner layer spec: 0.16's
    ``transformer_layer``, 0.19's ``mtp_model_layer`` (a transformer layer or a Mamba
    block); None for another shape."""
    for name in ("transformer_layer", "mtp_model_layer"):
        if hasattr(submodules, name):
            return name
    return None


def mtp_acceptance_function():
    """(module, name) of 0.19's MTP acceptance counter, or None (0.16 counts none)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    name = "_compute_mtp_acceptance_counts"
    return (mtp, name) if hasattr(mtp, name) else None


def roll_left(tensor, cp_group, packed_seq_params=None):
    """``tensor`` ``[b, s]`` rolled left by one token as MTP rolls labels and loss mask
    (the last position zeroed; context-parallel and packed sequences as Megatron does)."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    rolled, _ = roll_tensor(tensor, shifts=-1, dims=-1, cp_group=cp_group,
                            packed_seq_params=packed_seq_params)
    return rolled


def cp_group(model):
    """The model's context-parallel group (``pg_collection.cp``; 0.16 also ``cp_group``)."""
    pgs = getattr(model, "pg_collection", None)
    group = getattr(pgs, "cp", None) if pgs is not None else None
    return group if group is not None else getattr(model, "cp_group", None)


def logit_multiplier(config) -> float:
    """The factor ``GPTModel._scale_logits`` applies to the logits (0.19 MuP; 1.0 in 0.16)."""
    if getattr(config, "use_mup", False):
        return float(getattr(config, "mup_output_mult", 1.0))
    return 1.0


def inference_active(inference_context=None) -> bool:
    """Whether a ``GPTModel._postprocess`` call is an inference one (keep Megatron's logits)."""
    if inference_context is not None:
        return True
    try:  # 0.19 on: a process-wide inference mode; 0.16: only the context says so
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return False
    is_active = getattr(InferenceMode, "is_active", None)
    return bool(is_active()) if callable(is_active) else False


def vocab_parallel_cross_entropy(logits, target, tp_group=None):
    """Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` over ``tp_group`` (0.16 only
    knows the global tensor-parallel group: ``tp_group`` must be it or None there). Overwrites
    ``logits`` in place, as Megatron's does."""
    from megatron.core import tensor_parallel

    if _cross_entropy_takes_group():
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target, tp_group=tp_group)
    if tp_group is not None:
        from megatron.core import parallel_state

        if tp_group is not parallel_state.get_tensor_model_parallel_group():
            raise ValueError("megatron-core 0.16 computes vocab-parallel cross-entropy over the "
                             "global tensor-parallel group only")
    return tensor_parallel.vocab_parallel_cross_entropy(logits, target)


@functools.lru_cache(maxsize=None)
def _cross_entropy_takes_group() -> bool:
    from megatron.core import tensor_parallel

    params = inspect.signature(tensor_parallel.vocab_parallel_cross_entropy).parameters
    return "tp_group" in params


# ---------------------------------------------------------------------------- full-recompute site
# SCO (megatron.sco) routes the checkpoints of ``recompute_granularity='full'`` through its
# offloading checkpoint. Both releases call ``tensor_parallel.checkpoint(fn,
# distribute_saved_activations, hidden_states, attention_mask, context, context_mask,
# rotary_pos_emb..., padding_mask)``, looking ``tensor_parallel`` up in the *calling module's*
# globals at call time, but from different places:
# * 0.16: the method ``TransformerBlock._checkpointed_forward`` (module transformer_block);
# * 0.18 on: the free function ``megatron.core.recompute.checkpointed_forward`` (module
#   recompute, also used by the hybrid/Mamba block), imported *by name* into transformer_block,
#   where ``TransformerBlock.forward`` looks ``checkpointed_forward`` up at call time.
# Detected by which of the two transformer_block has.
# ``full_recompute_site()`` names (a) the module whose global ``tensor_parallel`` the
# checkpoint call reads and (b) the (owner, attribute) to wrap so that only the transformer
# block's checkpointed forward is affected.


def full_recompute_site():
    """``(caller_module, owner, name)``: ``caller_module.tensor_parallel.checkpoint`` is what
    the transformer block's full recompute calls; ``getattr(owner, name)`` is the callable
    (method or module function) whose duration delimits it."""
    from megatron.core.transformer import transformer_block

    if callable(getattr(transformer_block, "checkpointed_forward", None)):
        from megatron.core import recompute

        return recompute, transformer_block, "checkpointed_forward"
    owner = transformer_block.TransformerBlock
    if callable(getattr(owner, "_checkpointed_forward", None)):
        return transformer_block, owner, "_checkpointed_forward"
    raise RuntimeError("neither megatron.core.transformer.transformer_block.checkpointed_forward "
                       "nor TransformerBlock._checkpointed_forward exists in megatron-core "
                       f"{version_text()}: SCO cannot find the full-recompute site")


# ---------------------------------------------------------------------------- module-recompute sites
# Under ``recompute_granularity='selective'`` the module recomputes that checkpoint a whole
# submodule call ``tensor_parallel.checkpoint(fn, False, *inputs)`` from three Megatron modules
# (both releases), each reading ``tensor_parallel`` from its own globals at call time:
# * ``core_attn``: ``Attention._checkpointed_attention_forward`` (module attention), inputs
#   ``(query, key, value, attention_mask, rotary_pos_emb, attn_mask_type, ...)``;
# * ``moe``: ``MoELayer.forward`` (module moe.moe_layer), inputs ``(hidden_states,
#   intermediate_tensors, padding_mask)`` — and, in the same module,
#   ``MoELayer.shared_experts_compute`` for ``shared_experts``;
# * ``mlp``: ``TransformerLayer._forward_mlp`` (module transformer_layer), input the pre-MLP
#   norm's output; 0.19's partial-CUDA-graph MoE recompute calls from the same module.
# The per-layer boundary is the leading inputs (q, k, v; the MLP/MoE input); masks and rotary
# tables are shared by every layer. Detected by the methods each module has.


@dataclasses.dataclass(frozen=True)
class ModuleRecomputeSite:
    """One module whose ``tensor_parallel.checkpoint`` calls are module recomputes."""

    modules: Tuple[str, ...]  # the recompute_modules names whose checkpoints come from here
    caller: Any  # the Python module whose global ``tensor_parallel`` the call reads
    offload_args: Tuple[int, ...]  # positions of the per-layer boundary among the inputs


def module_recompute_sites() -> Tuple[ModuleRecomputeSite, ...]:
    """The Megatron modules whose checkpoint calls are ``core_attn``, ``moe`` and ``mlp``
    recomputes (megatron-flat's own FlatMoELayer, which recomputes like ``moe``, is added by
    ``sco``: this module imports nothing of the glue)."""
    from megatron.core.transformer import attention, transformer_layer
    from megatron.core.transformer.moe import moe_layer

    needed = (
        (attention, attention.Attention, "_checkpointed_attention_forward"),
        (moe_layer, moe_layer.MoELayer, "forward"),
        (transformer_layer, transformer_layer.TransformerLayer, "_forward_mlp"),
    )
    for module, owner, name in needed:
        if "tensor_parallel" not in vars(module) or not callable(getattr(owner, name, None)):
            raise RuntimeError(f"{module.__name__} has no {owner.__name__}.{name} reading "
                               f"tensor_parallel in megatron-core {version_text()}: SCO cannot "
                               "find the module-recompute sites")
    return (
        ModuleRecomputeSite(("core_attn",), attention, (0, 1, 2)),
        ModuleRecomputeSite(("moe",), moe_layer, (0,)),
        ModuleRecomputeSite(("mlp",), transformer_layer, (0,)),
    )


def shared_experts_site():
    """``(owner, name)``: the method that makes the ``shared_experts`` recompute's checkpoint
    call (same module as the ``moe`` one; its input is the MoE layer's input, which the router
    keeps on the device anyway, so SCO leaves it to Megatron)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer, "shared_experts_compute"


# The modules whose checkpoints SCO offloads under selective recompute.
SCO_MODULES = ("core_attn", "moe", "mlp")


# ---------------------------------------------------------------------------- CUDA-graph settings
# Which parts of a model Megatron captures in CUDA graphs is spelled differently by release:
# * 0.16: ``cuda_graph_impl`` in {none, local, transformer_engine} (the deprecated booleans
#   ``enable_cuda_graph`` / ``external_cuda_graph`` mean local / transformer_engine) and
#   ``cuda_graph_scope``: a list of ``CudaGraphScope`` (``attn``, ``mlp``, ``moe``, ``moe_router``,
#   ``moe_preprocess``, ``mamba``, ``full_iteration``); Megatron-LM's ``--cuda-graph-scope`` may
#   also hold the string ``"full"``; empty means whole layers.
# * 0.19 on: the list is ``cuda_graph_modules`` (``CudaGraphModule``, the same names less
#   ``full_iteration``, which became ``cuda_graph_impl="full_iteration"``); ``cuda_graph_scope``
#   is a deprecated alias (None once TransformerConfig has migrated it; in Megatron-LM's args
#   ``cuda_graph_scope_deprecated`` until validation); ``inference_cuda_graph_scope``
#   (none / layer / block, default "layer" under the local implementation) sets what inference
#   captures.
# Read from plain attributes (Megatron-LM args or a TransformerConfig of either release).


@dataclasses.dataclass(frozen=True)
class CudaGraphSettings:
    """What a Megatron configuration asks CUDA graphs to capture, release-independent."""

    impl: str  # "none", "local", "transformer_engine" or "full_iteration"
    scope_flag: str  # the Megatron-LM flag that holds ``scopes``
    scopes: Tuple[str, ...]  # scope/module names; empty: whole layers
    inference: str  # "none", "layer" or "block" (0.16: "layer" under local graphs, else "none")


def cuda_graph_settings(config) -> CudaGraphSettings:
    """The CUDA-graph capture ``config`` (Megatron-LM args or TransformerConfig) asks for."""
    impl = getattr(config, "cuda_graph_impl", None) or "none"
    if impl == "none" and getattr(config, "enable_cuda_graph", False):
        impl = "local"
    elif impl == "none" and getattr(config, "external_cuda_graph", False):
        impl = "transformer_engine"
    scope_flag, raw = "--cuda-graph-scope", []
    for name, flag in (("cuda_graph_modules", "--cuda-graph-modules"),
                       ("cuda_graph_scope_deprecated", "--cuda-graph-scope"),
                       ("cuda_graph_scope", "--cuda-graph-scope")):
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        if value:
            scope_flag, raw = flag, value
            break
        if name == "cuda_graph_modules":  # 0.19 on: an empty list is the answer (whole layers)
            scope_flag = flag
    scopes = tuple(getattr(v, "name", v) for v in raw)
    scopes = tuple(s for s in scopes if s != "full")  # "full": the whole layer, i.e. empty
    inference = getattr(config, "inference_cuda_graph_scope", None)
    inference = getattr(inference, "name", inference)
    if inference is None:
        inference = "layer" if impl == "local" else "none"
    return CudaGraphSettings(impl, scope_flag, scopes, inference)
