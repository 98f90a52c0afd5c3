"""The tiny MoE GPT every test, the demo and the CPU benchmarks build.

2 layers, hidden 64, 4 experts, top-2, SwiGLU, built from Megatron-Core's local layer
spec (no transformer-engine needed). ``TinyMoE`` holds the model shape; ``Layout`` (in
``equivalence``) holds how it is split over ranks. The data is synthetic tokens drawn
from a seed, so every rank and every layout sees the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyMoE:
    """Model shape and the step's batch geometry."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 128
    num_experts: int = 4
    topk: int = 2
    moe_ffn_hidden_size: int = 64
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    global_batch_size: int = 8
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seed: int = 1234
    # "random": uniform tokens (nothing to learn; the loss stays near log V).
    # "zipf": token k drawn with probability proportional to 1/(k+1), a skew a model
    # learns within a few steps, so the loss visibly falls.
    data: str = "random"
    # Tie the output layer to the word embedding (GPTModel's
    # share_embeddings_and_output_weights).
    share_embeddings: bool = False
    # Multi-token prediction heads (GPTModel's mtp_num_layers; 0 = none). Each head is one
    # more transformer layer plus a projection + loss on the next-but-k token, its loss
    # scaled by 0.1 / heads (Megatron's default mtp_loss_scaling_factor).
    mtp_num_layers: int = 0
    # Grouped-GEMM experts (--moe-grouped-gemm): 0.16's GroupedMLP (the CPU backend's
    # reference grouped GEMM), or on 0.19, which has no GroupedMLP, TEGroupedMLP with the CPU
    # grouped linears of megatron_flat.cpu.grouped.
    grouped_gemm: bool = False
    # Core attention: "local" (Megatron's DotProductAttention: N×N scores, softmax and their
    # grad materialised) or "flash" (cpu.flash_attention: torch's fused kernel, O(N)
    # per head, as transformer-engine's fused attention on a GPU). Under context parallelism
    # both are built as the CPU backend's ContextParallelCoreAttention (the flash kernel over
    # the CP group; cpu.context_attention).
    attention: str = "local"
    # Each label position's loss mask is 0 with this probability (drawn from the seed apart
    # from the tokens, so the tokens do not change): microbatches then count different
    # numbers of tokens, as SFT's padding and prompt masking make them. Only a per-token
    # loss (``calculate_per_token_loss``) takes masks; the mean-loss harness refuses them.
    masked_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of "
                             f"micro_batch_size {self.micro_batch_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not split over "
                             f"{self.num_attention_heads} heads")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"topk {self.topk} must be in 1..num_experts ({self.num_experts})")
        if self.mtp_num_layers < 0 or self.mtp_num_layers >= self.seq_length:
            raise ValueError(f"mtp_num_layers {self.mtp_num_layers} must be in "
                             f"0..seq_length-1 ({self.seq_length - 1})")
        if self.data not in ("random", "zipf"):
            raise ValueError(f"unknown synthetic data {self.data!r}: use 'random' or 'zipf'")
        if self.attention not in ("local", "flash"):
            raise ValueError(f"unknown attention {self.attention!r}: use 'local' or 'flash'")
        if not 0.0 <= self.masked_fraction < 1.0:
            raise ValueError(f"masked_fraction {self.masked_fraction} must be in [0, 1)")

    def with_(self, **changes) -> "TinyMoE":
        return replace(self, **changes)

    def planner_spec(self, dtype: str = "fp32"):
        """This model as the peak planner sees it (``megatron_flat.plan.ModelSpec``:
        multi-head attention, SwiGLU experts), for validating the planner against it."""
        from megatron_flat.plan import ModelSpec

        return ModelSpec(name="tiny", hidden=self.hidden_size, layers=self.num_layers,
                         heads=self.num_attention_heads, kv_heads=self.num_attention_heads,
                         head_dim=self.hidden_size // self.num_attention_heads,
                         vocab=self.vocab_size, experts=self.num_experts, topk=self.topk,
                         expert_ffn=self.moe_ffn_hidden_size, dtype=dtype)


def transformer_config(
    tiny: TinyMoE,
    *,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    dispatcher: str = "alltoall",
    recompute: Optional[str] = None,
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    recompute_modules: tuple = (),
    **overrides,
):
    """A Megatron ``TransformerConfig`` for ``tiny`` under one layout.

    Fusions that need CUDA kernels are off; the MoE is dropless with no auxiliary loss
    (an aux loss over local tokens depends on how tokens are split across ranks, so it
    would make layouts differ by design, not by error).
    """
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=tiny.num_layers,
        hidden_size=tiny.hidden_size,
        num_attention_heads=tiny.num_attention_heads,
        ffn_hidden_size=tiny.ffn_hidden_size,
        num_moe_experts=tiny.num_experts,
        moe_router_topk=tiny.topk,
        moe_ffn_hidden_size=tiny.moe_ffn_hidden_size,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=tiny.hidden_dropout,
        attention_dropout=tiny.attention_dropout,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        sequence_parallel=tp > 1,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method=recompute_method,
                      recompute_num_layers=recompute_num_layers)
    elif recompute == "selective":
        kwargs.update(recompute_granularity="selective",
                      recompute_modules=list(recompute_modules or ("core_attn",)))
    elif recompute is not None:
        raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
    if tiny.mtp_num_layers:
        kwargs.update(mtp_num_layers=tiny.mtp_num_layers)
    if tiny.grouped_gemm:
        kwargs.update(moe_grouped_gemm=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(tiny: TinyMoE, config, layer_spec=None, flat=None) -> torch.nn.Module:
    """Build this rank's pipeline stage of the tiny MoE GPT (call inside a layout). ``flat``
    (a FlatConfig): its attention tiles go into the default layer spec."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    if layer_spec is None:
        layer_spec = get_gpt_layer_local_spec(num_experts=tiny.num_experts,
                                              normalization="RMSNorm",
                                              moe_grouped_gemm=tiny.grouped_gemm)
        if tiny.grouped_gemm:
            layer_spec = _with_cpu_grouped_experts(layer_spec)
        if tiny.attention == "flash":
            from megatron_flat.cpu.flash_attention import with_flash_attention

            layer_spec = with_flash_attention(layer_spec)
        if flat is not None and flat.attn_tiles:
            from megatron_flat.megatron.attention_tiles import with_attn_tiles

            layer_spec = with_attn_tiles(layer_spec, flat)
    mtp = {}
    if getattr(config, "mtp_num_layers", None):
        # The MTP heads' layers are the decoder's layer spec (None off the last stage).
        mtp["mtp_block_spec"] = get_gpt_mtp_block_spec(config, layer_spec,
                                                       use_transformer_engine=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=tiny.vocab_size,
        max_sequence_length=tiny.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tiny.share_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **mtp,
    )


def _with_cpu_grouped_experts(layer_spec):
    """The layer spec with the installed release's grouped experts runnable on CPU (0.19's
    local spec ignores moe_grouped_gemm: it has no GroupedMLP)."""
    import dataclasses

    from megatron_flat.megatron import compat
    from megatron_flat.cpu.grouped import grouped_experts_spec

    mlp = compat.replace_experts(layer_spec.submodules.mlp, grouped_experts_spec())
    return dataclasses.replace(layer_spec,
                               submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))


def reset_mtp_tracker() -> None:
    """Empty Megatron's process-wide MTP loss tracker (sized by the first model's head
    count; Megatron-LM empties it after logging each step)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def reset_moe_loss_tracker() -> None:
    """Empty Megatron's process-wide MoE loss tracker: its per-layer tensors are sized by the
    first model that records a loss, so a later model with more layers (an MTP layer) would
    index past them. 0.19 keeps it in ``moe_logging``, 0.16 in ``moe_utils``."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    position_ids: torch.Tensor = field(default=None)
    loss_mask: Optional[torch.Tensor] = None  # [b, s] float 0/1; None: every token counts

    def __post_init__(self):
        if self.position_ids is None:
            b, s = self.tokens.shape
            self.position_ids = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()


def global_batch(tiny: TinyMoE, step: int = 0) -> List[MicroBatch]:
    """The step's global batch as ``global_batch_size / micro_batch_size`` microbatches.

    Deterministic in (seed, step) and independent of the layout: a layout takes its data-
    parallel share with ``dp_share``. With ``tiny.masked_fraction`` each microbatch also
    carries a loss mask (its own generator: the tokens are those of the unmasked batch).
    """
    gen = torch.Generator().manual_seed(tiny.seed * 1000 + step)
    n_micro = tiny.global_batch_size // tiny.micro_batch_size
    shape = (n_micro, tiny.micro_batch_size, tiny.seq_length + 1)
    if tiny.data == "random":
        data = torch.randint(0, tiny.vocab_size, shape, generator=gen)
    else:  # "zipf" (TinyMoE validated the name)
        weights = 1.0 / torch.arange(1, tiny.vocab_size + 1, dtype=torch.float64)
        flat = torch.multinomial(weights, shape[0] * shape[1] * shape[2], replacement=True,
                                 generator=gen)
        data = flat.view(shape)
    masks = [None] * n_micro
    if tiny.masked_fraction:
        mask_gen = torch.Generator().manual_seed(tiny.seed * 1000 + step + 7_000_003)
        drawn = torch.rand((n_micro, tiny.micro_batch_size, tiny.seq_length), generator=mask_gen)
        masks = list((drawn >= tiny.masked_fraction).float())
    return [MicroBatch(tokens=d[:, :-1].contiguous(), labels=d[:, 1:].contiguous(), loss_mask=m)
            for d, m in zip(data, masks)]


def cp_share(mb: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """CP rank ``cp_rank``'s part of a microbatch: Megatron's load-balanced split (the sequence
    cut into ``2·cp_size`` chunks; this rank keeps chunks ``cp_rank`` and ``2·cp_size−1−
    cp_rank``), position ids global, as ``get_batch_on_this_cp_rank`` hands it out."""
    if cp_size == 1:
        return mb
    from megatron_flat.cpu.context_attention import load_balanced_chunks

    seq = mb.tokens.shape[1]
    if seq % (2 * cp_size):
        raise ValueError(f"sequence length {seq} does not split into 2·CP = {2 * cp_size} "
                         f"chunks")
    keep = load_balanced_chunks(cp_rank, cp_size)

    def part(t: torch.Tensor) -> torch.Tensor:
        chunks = t.chunk(2 * cp_size, dim=1)
        return torch.cat([chunks[j] for j in keep], dim=1).contiguous()

    return MicroBatch(tokens=part(mb.tokens), labels=part(mb.labels),
                      position_ids=part(mb.position_ids),
                      loss_mask=None if mb.loss_mask is None else part(mb.loss_mask))


def dp_share(batch: List[MicroBatch], dp_rank: int, dp_size: int) -> List[MicroBatch]:
    """Rank ``dp_rank``'s microbatches: a contiguous 1/dp_size of the global batch."""
    if len(batch) % dp_size:
        raise ValueError(f"{len(batch)} microbatches do not split over data-parallel size {dp_size}")
    per = len(batch) // dp_size
    return batch[dp_rank * per : (dp_rank + 1) * per]
