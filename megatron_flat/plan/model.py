"""What the planner plans for: a model shape (``ModelSpec``) and a parallel layout (``Layout``).

Both are plain frozen dataclasses. Models come from presets (``preset(name)``), a Hugging Face
``config.json`` (``model_from_hf_config``) or Megatron-LM's parsed arguments
(``model_from_megatron_args``; ``layout_from_megatron_args`` for the layout). ``default_layout``
is one layout for a GPU count without a search (the CLI searches them: ``plan.layouts``). Bad
input raises ``PlanError`` with a message that says what to change.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

GLUS = ("swiglu", "quick-geglu")  # a gated FFN's activation, as Megatron-LM's flag names it
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


class PlanError(ValueError):
    """Bad planner input, or a plan that cannot fit; the message says which and why."""


# ---------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention's shape (DeepSeek-V2/V3, Kimi K2), as Megatron-LM's flags say it.

    ``q_lora_rank`` None: queries projected directly (no query latent). ``qk_head_dim`` is the
    part of a query/key head without rotary embedding (DeepSeek's ``qk_nope_head_dim``),
    ``qk_pos_emb_head_dim`` the rotary part; YaRN's ``rotary_scaling_factor``, ``mscale`` and
    ``mscale_all_dim`` are passed through to the launch line."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def params(self, hidden: int, heads: int) -> int:
        """One layer's attention parameters: q down/up (or one projection), kv down with the
        rotary key, kv up, the output projection, and the two latent norms."""
        H, h, nope, rope, dv = hidden, heads, self.qk_head_dim, self.qk_pos_emb_head_dim, \
            self.v_head_dim
        q = (H * self.q_lora_rank + self.q_lora_rank * h * (nope + rope) + self.q_lora_rank
             if self.q_lora_rank else H * h * (nope + rope))
        return (q + H * (self.kv_lora_rank + rope) + self.kv_lora_rank * h * (nope + dv)
                + self.kv_lora_rank + h * dv * H)

    def megatron_flags(self) -> List[str]:
        """The flags of this shape that both megatron-core 0.16 and main's Megatron-LM parse."""
        out = ["--multi-latent-attention"]
        if self.q_lora_rank:
            out += ["--q-lora-rank", str(self.q_lora_rank)]
        out += ["--kv-lora-rank", str(self.kv_lora_rank), "--qk-head-dim", str(self.qk_head_dim),
                "--qk-pos-emb-head-dim", str(self.qk_pos_emb_head_dim),
                "--v-head-dim", str(self.v_head_dim),
                "--rotary-scaling-factor", _number(self.rotary_scaling_factor),
                "--mscale", _number(self.mscale), "--mscale-all-dim", _number(self.mscale_all_dim)]
        return out


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a (MoE) decoder-only transformer, as the peak formulas need it.

    Symbols used in ``peaks.py``: H = ``hidden``, L = ``layers``, h = ``heads``,
    g = ``kv_heads``, d = ``head_dim`` (query/key width per head), d_v = ``v_head_dim``,
    E = ``experts``, k = ``topk``, F = ``expert_ffn``, F_s = ``shared_expert_ffn``,
    F_d = ``dense_ffn``, V = ``vocab``.

    ``dense_layers`` leading layers use a dense FFN of width F_d instead of the MoE
    (DeepSeek-V3's ``first_k_dense_replace``); ``experts == 0`` is a dense model.
    ``attention_params`` overrides the per-layer attention parameter count for attention
    shapes other than (grouped-query) multi-head attention, e.g. MLA.
    ``gated``: SwiGLU-style FFN (fc1 is 2F wide).
    ``moe_layer_step``: after the ``dense_layers``, every ``moe_layer_step``-th layer is MoE
    and the others dense (Llama-4's ``interleave_moe_layer_step``; Megatron's integer
    ``moe_layer_freq``, whose layer 0 is MoE: layers ``i`` with ``(i - dense_layers) % step
    == step - 1`` here, Llama-4's layout, where the first layer is dense).
    ``mtp_layers``: multi-token-prediction heads (Megatron's ``mtp_num_layers``; DeepSeek-V3's
    ``num_nextn_predict_layers``): each adds another N × V projection + loss on the last
    stage (the vocab term counts them); the heads' own transformer layers are not modelled.
    ``mla``: multi-latent attention's shape (:class:`MLA`); it sets ``attention_params`` when
    that is not given, and needs ``kv_heads == heads``, ``head_dim`` = its q/k width and
    ``v_head_dim`` = its v width.
    ``glu``: the gated FFN's activation, ``"swiglu"`` or ``"quick-geglu"`` (GPT-OSS's
    quick-GELU GLU; its offset and clamp are ``arch_flags``).
    ``linear_bias``: every linear layer has a bias (Megatron's default; GPT-OSS): attention
    QKV and output, each FFN's fc1 and fc2, every routed expert's, and the router's.
    ``qkv_bias``: only the QKV projection has one (Qwen2's ``--add-qkv-bias``).
    ``sinks``: a learnable softmax offset per head and layer (GPT-OSS's attention sinks,
    ``--softmax-type learnable``).
    ``window``: sliding-window attention over that many earlier tokens (0: none) in every
    layer but each ``window_skip_freq``-th (Megatron's ``--window-attn-skip-freq N``: one
    full-attention layer after N − 1 windowed ones; 0: every layer windowed); a windowed
    layer's core attention sees at most ``window`` keys a query (the step-time model's
    attention FLOPs).
    ``rotary_base``: the rotary embedding's base (config.json ``rope_theta``; Megatron-LM's
    ``--rotary-base``, default 10000), emitted when it is not the default.
    ``arch_flags``: Megatron-LM flags of the architecture that no peak formula reads (q/k
    norms, the router's score function, expert bias, group-limited routing and scaling
    factor, the shared expert's gate, GLU offset and clamp): the launch line carries them as
    written, so the line builds the family's model and not a plainer one.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    shared_expert_ffn: int = 0
    dense_ffn: int = 0
    dense_layers: int = 0
    v_head_dim: Optional[int] = None
    attention_params: Optional[int] = None
    gated: bool = True
    tied_embeddings: bool = False
    dtype: str = "bf16"
    source: str = ""
    mtp_layers: int = 0
    moe_layer_step: int = 1
    mla: Optional[MLA] = None
    arch_flags: Tuple[str, ...] = ()
    glu: str = "swiglu"
    linear_bias: bool = False
    qkv_bias: bool = False
    sinks: bool = False
    window: int = 0
    window_skip_freq: int = 0
    rotary_base: int = 10000

    def __post_init__(self) -> None:
        if self.mla is not None:
            mla = self.mla
            if (self.kv_heads, self.head_dim, self.dv) != (
                    self.heads, mla.qk_head_dim + mla.qk_pos_emb_head_dim, mla.v_head_dim):
                raise PlanError(f"model {self.name!r}: MLA needs kv_heads = heads, head_dim = "
                                f"{mla.qk_head_dim} + {mla.qk_pos_emb_head_dim} and v_head_dim "
                                f"= {mla.v_head_dim}")
            if self.attention_params is None:
                object.__setattr__(self, "attention_params", mla.params(self.hidden, self.heads))
        if isinstance(self.arch_flags, list):
            object.__setattr__(self, "arch_flags", tuple(self.arch_flags))
        if any(not (isinstance(f, str) and f) for f in self.arch_flags):
            raise PlanError(f"model {self.name!r}: arch_flags must be non-empty strings")
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise PlanError(f"model {self.name!r}: {name} must be a positive integer, "
                                f"got {getattr(self, name)!r}")
        for name in ("experts", "topk", "expert_ffn", "shared_experts", "shared_expert_ffn",
                     "dense_ffn", "dense_layers", "mtp_layers", "moe_layer_step", "window",
                     "window_skip_freq", "rotary_base"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise PlanError(f"model {self.name!r}: {name} must be an integer >= 0, "
                                f"got {getattr(self, name)!r}")
        if self.glu not in GLUS:
            raise PlanError(f"model {self.name!r}: glu {self.glu!r} is not one of "
                            f"{', '.join(GLUS)}")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"model {self.name!r}: dtype {self.dtype!r} is not one of "
                            f"{', '.join(sorted(DTYPE_BYTES))}")
        if self.heads % self.kv_heads:
            raise PlanError(f"model {self.name!r}: {self.heads} attention heads do not group "
                            f"over {self.kv_heads} key/value heads")
        if self.experts:
            if not 1 <= self.topk <= self.experts:
                raise PlanError(f"model {self.name!r}: top-k {self.topk} must be in "
                                f"1..{self.experts} (the expert count)")
            if self.expert_ffn < 1:
                raise PlanError(f"model {self.name!r}: an MoE model needs expert_ffn > 0")
            if self.shared_experts and self.shared_expert_ffn < 1:
                raise PlanError(f"model {self.name!r}: shared experts need shared_expert_ffn > 0")
        elif self.dense_ffn < 1:
            raise PlanError(f"model {self.name!r}: a model without experts needs dense_ffn > 0")
        if self.dense_layers > self.layers:
            raise PlanError(f"model {self.name!r}: dense_layers {self.dense_layers} > layers "
                            f"{self.layers}")
        if self.moe_layer_step < 1:
            raise PlanError(f"model {self.name!r}: moe_layer_step must be >= 1, got "
                            f"{self.moe_layer_step}")
        if (self.dense_layers or self.moe_layer_step > 1) and self.experts and self.dense_ffn < 1:
            raise PlanError(f"model {self.name!r}: dense layers need dense_ffn > 0")
        if self.dense_layers and self.dense_ffn < 1:
            raise PlanError(f"model {self.name!r}: dense layers need dense_ffn > 0")

    # -- derived ------------------------------------------------------------------------
    @property
    def bytes_per_value(self) -> int:
        """b: bytes of one activation or low-precision weight element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.is_moe_layer(i))

    def is_moe_layer(self, index: int) -> bool:
        if not self.experts or index < self.dense_layers:
            return False
        step = self.moe_layer_step
        return (index - self.dense_layers) % step == step - 1

    @property
    def ffn_matrices(self) -> int:
        """Weight matrices of width F in one FFN: 3 for gated (gate, up, down), else 2."""
        return 3 if self.gated else 2

    def attention_params_per_layer(self) -> int:
        """Q, K, V and output projections: H·h·d + H·g·d + H·g·d_v + h·d_v·H, their biases
        (``linear_bias``: QKV's and the output's; ``qkv_bias``: QKV's) and the sinks (h)."""
        H = self.hidden
        qkv_width = self.heads * self.head_dim + self.kv_heads * (self.head_dim + self.dv)
        if self.attention_params is not None:
            weights = self.attention_params
        else:
            weights = H * qkv_width + self.heads * self.dv * H
        biases = (qkv_width if self.linear_bias or self.qkv_bias else 0) + \
            (H if self.linear_bias else 0)
        return weights + biases + (self.heads if self.sinks else 0)

    def ffn_params(self, width: int) -> int:
        """One FFN of width F: 3·H·F gated (2·H·F plain), with ``linear_bias`` fc1's bias
        (2F gated, F plain) and fc2's (H)."""
        fc1 = (self.ffn_matrices - 1) * width
        biases = fc1 + self.hidden if self.linear_bias else 0
        return self.ffn_matrices * self.hidden * width + biases

    def expert_params(self) -> int:
        """One routed expert (:meth:`ffn_params` of the expert width)."""
        return self.ffn_params(self.expert_ffn)

    def is_window_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) attends over a sliding window."""
        if not self.window:
            return False
        return not self.window_skip_freq or (index + 1) % self.window_skip_freq != 0

    def attended_fraction(self, seq_len: int) -> float:
        """Keys a query sees on average over the layers, as a fraction of full causal
        attention's (S + 1)/2: 1 without windows; a windowed layer's query i sees
        min(i + 1, window + 1) keys."""
        windowed = sum(self.is_window_layer(i) for i in range(self.layers))
        if not windowed or seq_len < 1:
            return 1.0
        w = min(self.window + 1, seq_len)
        keys = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
        full = (seq_len + 1) / 2
        return ((self.layers - windowed) * full + windowed * keys) / (self.layers * full)

    def total_params(self) -> int:
        """All parameters (embeddings counted once when tied); norms included."""
        H, L = self.hidden, self.layers
        per_layer_common = self.attention_params_per_layer() + 2 * H
        moe = self.moe_layers
        dense = L - moe
        total = L * per_layer_common + H
        total += dense * self.ffn_params(self.dense_ffn)
        router = H * self.experts + (self.experts if self.linear_bias else 0)
        total += moe * (self.experts * self.expert_params() + router
                        + self.shared_experts * self.ffn_params(self.shared_expert_ffn))
        total += self.vocab * H * (1 if self.tied_embeddings else 2)
        return total

    def describe(self) -> str:
        parts = [f"{self.layers} layers", f"hidden {self.hidden}",
                 f"{self.heads} heads/{self.kv_heads} kv x {self.head_dim}"]
        if self.experts:
            moe = f"{self.experts} experts top-{self.topk} ffn {self.expert_ffn}"
            if self.shared_experts:
                moe += f" + {self.shared_experts} shared"
            parts.append(moe)
        if self.moe_layers < self.layers:
            parts.append(f"{self.layers - self.moe_layers} dense ffn {self.dense_ffn}")
        if self.mtp_layers:
            parts.append(f"{self.mtp_layers} MTP head{'s' if self.mtp_layers > 1 else ''}")
        parts += [f"vocab {self.vocab:,}", self.dtype,
                  f"{self.total_params() / 1e9:.1f}B params"]
        return ", ".join(parts)


def _paper(name: str, layers: int) -> ModelSpec:
    # The paper's synthetic MoE family: hidden 7168, 384 experts, top-8, expert FFN 2048,
    # vocab 200,000. Its attention shape is not given; 56 heads x 128 with 8 KV heads (GQA)
    # is our assumption, chosen because it reproduces the family's names: 122.1B, 241.3B and
    # 667.2B parameters for 7, 14 and 39 layers.
    return ModelSpec(name=name, hidden=7168, layers=layers, heads=56, kv_heads=8, head_dim=128,
                     experts=384, topk=8, expert_ffn=2048, vocab=200_000, dtype="bf16",
                     source="paper synthetic MoE family (attention shape assumed: 56 heads, "
                            "8 KV heads, head dim 128)")


# DeepSeek-V3 config.json: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128; rope_scaling: YaRN factor 40, mscale 1.0,
# mscale_all_dim 1.0 (Kimi K2: factor 32). Megatron's MLA also norms both latents
# (--qk-layernorm).
_DEEPSEEK_MLA = MLA(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                    v_head_dim=128, rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
_KIMI_MLA = replace(_DEEPSEEK_MLA, rotary_scaling_factor=32.0)


def _deepseek_flags(groups: int, group_topk: int, scaling: float) -> Tuple[str, ...]:
    """DeepSeek-V3's flags beyond its shapes, as Megatron-LM spells them: the latents' norms
    (``--qk-layernorm``) and the router: sigmoid scores, an expert bias updated
    without an auxiliary loss (plus a small sequence-wise one), group-limited top-k, and the
    routed scaling factor (config.json: scoring_func, topk_method noaux_tc, n_group,
    topk_group, routed_scaling_factor)."""
    return ("--qk-layernorm", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type",
            "seq_aux_loss", "--moe-aux-loss-coeff", "0.0001", "--moe-router-num-groups",
            str(groups), "--moe-router-group-topk", str(group_topk),
            "--moe-router-topk-scaling-factor", _number(scaling), "--moe-router-dtype", "fp32")


# Qwen3-MoE: q/k RMSNorm per head, softmax router with the global auxiliary loss
# (router_aux_loss_coef 0.001).
_QWEN3 = ("--qk-layernorm", "--moe-router-load-balancing-type", "aux_loss",
          "--moe-aux-loss-coeff", "0.001")
_QWEN3_DENSE = ("--qk-layernorm",)

# GPT-OSS beyond its shapes: biases everywhere, sinks, a 128-token window on every other
# layer, quick-GEGLU; its offset and clamp as Megatron-LM spells them. Rotary bases below
# are each config.json's rope_theta (DeepSeek-V3's is Megatron's default, 10000).
_GPT_OSS = dict(linear_bias=True, sinks=True, window=128, window_skip_freq=2, glu="quick-geglu",
                arch_flags=("--glu-linear-offset", "1", "--activation-func-clamp-value", "7"))

# Llama-4: weightless L2 norms of q and k (config.json use_qk_norm) and a sigmoid top-1
# router (its architecture; the config has no key for it).
_LLAMA4 = ("--qk-l2-norm", "--moe-router-score-function", "sigmoid")

PRESETS: Dict[str, ModelSpec] = {
    "paper-120b": _paper("paper-120b", 7),
    "paper-241b": _paper("paper-241b", 14),
    "paper-667b": _paper("paper-667b", 39),
    # openai/gpt-oss-20b config.json: hidden_size 2880, num_hidden_layers 24,
    # num_attention_heads 64, num_key_value_heads 8, head_dim 64, num_local_experts 32,
    # num_experts_per_tok 4, intermediate_size 2880 (per expert), vocab_size 201088,
    # tie_word_embeddings false; attention_bias true and biased experts and router (every
    # linear has a bias), attention sinks, sliding_window 128 on every other layer
    # (layer_types: sliding, full, ...), swiglu_limit 7.0 (Megatron: quick-GEGLU with
    # offset 1 and clamp 7). Published: 20.9B.
    "gpt-oss-20b": ModelSpec(name="gpt-oss-20b", hidden=2880, layers=24, heads=64, kv_heads=8,
                             head_dim=64, experts=32, topk=4, expert_ffn=2880, vocab=201_088,
                             **_GPT_OSS, rotary_base=150_000,
                             source="openai/gpt-oss-20b config.json"),
    # openai/gpt-oss-120b config.json: as gpt-oss-20b but num_hidden_layers 36 and
    # num_local_experts 128. Published: 116.8B.
    "gpt-oss-120b": ModelSpec(name="gpt-oss-120b", hidden=2880, layers=36, heads=64,
                              kv_heads=8, head_dim=64, experts=128, topk=4, expert_ffn=2880,
                              vocab=201_088, **_GPT_OSS,
                              rotary_base=150_000,
                              source="openai/gpt-oss-120b config.json"),
    # Qwen/Qwen2-57B-A14B config.json: hidden_size 3584, num_hidden_layers 28,
    # num_attention_heads 28, num_key_value_heads 4 (head dim 128), num_experts 64,
    # num_experts_per_tok 8, moe_intermediate_size 2560, shared_expert_intermediate_size
    # 20480 (one gated shared expert), vocab_size 151936, untied, qkv bias. Published: 57.4B.
    "qwen2-57b-a14b": ModelSpec(name="qwen2-57b-a14b", hidden=3584, layers=28, heads=28,
                                kv_heads=4, head_dim=128, experts=64, topk=8, expert_ffn=2560,
                                shared_experts=1, shared_expert_ffn=20480, vocab=151_936,
                                qkv_bias=True, arch_flags=("--moe-shared-expert-gate",),
                                rotary_base=1_000_000,
                                source="Qwen/Qwen2-57B-A14B config.json"),
    # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, num_hidden_layers 61,
    # num_attention_heads 128 (MLA; after up-projection every head has its own K and V, so
    # kv heads = 128; q/k head dim = qk_nope 128 + qk_rope 64 = 192, v_head_dim 128),
    # n_routed_experts 256, num_experts_per_tok 8, moe_intermediate_size 2048,
    # n_shared_experts 1 (width moe_intermediate_size), first_k_dense_replace 3 with
    # intermediate_size 18432, vocab_size 129280, untied, num_nextn_predict_layers 1 (one
    # MTP head: its projection + loss counted, its transformer layer not modelled).
    "deepseek-v3": ModelSpec(name="deepseek-v3", hidden=7168, layers=61, heads=128,
                             kv_heads=128, head_dim=192, v_head_dim=128, mla=_DEEPSEEK_MLA,
                             arch_flags=_deepseek_flags(8, 4, 2.5), experts=256, topk=8,
                             expert_ffn=2048, shared_experts=1, shared_expert_ffn=2048,
                             dense_ffn=18432, dense_layers=3, vocab=129_280, mtp_layers=1,
                             source="deepseek-ai/DeepSeek-V3 config.json"),
    # moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's architecture with 64 attention
    # heads, n_routed_experts 384, num_experts_per_tok 8, moe_intermediate_size 2048,
    # n_shared_experts 1, first_k_dense_replace 1 (intermediate_size 18432), 61 layers,
    # vocab_size 163840, untied, no MTP head. Published: 1.04T parameters ("1T total").
    "kimi-k2": ModelSpec(name="kimi-k2", hidden=7168, layers=61, heads=64, kv_heads=64,
                         head_dim=192, v_head_dim=128, mla=_KIMI_MLA,
                         arch_flags=_deepseek_flags(1, 1, 2.827),
                         experts=384, topk=8, expert_ffn=2048, shared_experts=1,
                         shared_expert_ffn=2048, dense_ffn=18432, dense_layers=1,
                         vocab=163_840, rotary_base=50_000,
                         source="moonshotai/Kimi-K2-Instruct config.json"),
    # Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, num_hidden_layers 94,
    # num_attention_heads 64, num_key_value_heads 4, head_dim 128, num_experts 128,
    # num_experts_per_tok 8, moe_intermediate_size 1536, vocab_size 151936, untied, every
    # layer MoE; q/k RMSNorm (2 x head_dim per layer). Published: 235B.
    "qwen3-235b-a22b": ModelSpec(name="qwen3-235b-a22b", hidden=4096, layers=94, heads=64,
                                 kv_heads=4, head_dim=128, experts=128, topk=8,
                                 expert_ffn=1536, vocab=151_936, arch_flags=_QWEN3,
                                 rotary_base=1_000_000,
                                 source="Qwen/Qwen3-235B-A22B config.json"),
    # mistralai/Mixtral-8x22B-v0.1 config.json: hidden_size 6144, num_hidden_layers 56,
    # num_attention_heads 48, num_key_value_heads 8, num_local_experts 8,
    # num_experts_per_tok 2, intermediate_size 16384 (per expert), vocab_size 32000 (v0.3:
    # 32768), untied. Published: 141B.
    "mixtral-8x22b": ModelSpec(name="mixtral-8x22b", hidden=6144, layers=56, heads=48,
                               kv_heads=8, head_dim=128, experts=8, topk=2, expert_ffn=16384,
                               vocab=32_000, rotary_base=1_000_000,
                               source="mistralai/Mixtral-8x22B-v0.1 config.json"),
    # meta-llama/Llama-4-Maverick-17B-128E config.json (text_config): hidden_size 5120,
    # num_hidden_layers 48, num_attention_heads 40, num_key_value_heads 8, head_dim 128,
    # num_local_experts 128, num_experts_per_tok 1, intermediate_size 8192 (per expert and
    # the always-on shared expert), intermediate_size_mlp 16384 (the dense layers),
    # interleave_moe_layer_step 2 (odd layers MoE), vocab_size 202048, untied. Published: 400B.
    "llama-4-maverick": ModelSpec(name="llama-4-maverick", hidden=5120, layers=48, heads=40,
                                  kv_heads=8, head_dim=128, experts=128, topk=1,
                                  expert_ffn=8192, shared_experts=1, shared_expert_ffn=8192,
                                  dense_ffn=16384, moe_layer_step=2, vocab=202_048,
                                  arch_flags=_LLAMA4,
                                  rotary_base=500_000,
                                  source="meta-llama/Llama-4-Maverick-17B-128E config.json"),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48,
    # num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
    # num_experts_per_tok 8, moe_intermediate_size 768, vocab_size 151936, every layer MoE
    # (decoder_sparse_step 1, mlp_only_layers []), tie_word_embeddings false.
    "qwen3-30b-a3b": ModelSpec(name="qwen3-30b-a3b", hidden=2048, layers=48, heads=32,
                               kv_heads=4, head_dim=128, experts=128, topk=8, expert_ffn=768,
                               vocab=151_936, arch_flags=_QWEN3,
                               rotary_base=1_000_000,
                               source="Qwen/Qwen3-30B-A3B config.json"),
    # Dense models (no experts: the flat plan has no dispatch term), for the published
    # long-context points the baselines are held to (megatron_flat/plan/published.json).
    # Qwen/Qwen3-0.6B config.json: hidden_size 1024, num_hidden_layers 28,
    # num_attention_heads 16, num_key_value_heads 8, head_dim 128, intermediate_size 3072,
    # vocab_size 151936, tie_word_embeddings true, q/k RMSNorm. Published: 0.6B.
    "qwen3-0.6b": ModelSpec(name="qwen3-0.6b", hidden=1024, layers=28, heads=16, kv_heads=8,
                            head_dim=128, dense_ffn=3072, vocab=151_936, tied_embeddings=True,
                            arch_flags=_QWEN3_DENSE, rotary_base=1_000_000,
                            source="Qwen/Qwen3-0.6B config.json"),
    # Qwen/Qwen3-4B config.json: hidden_size 2560, 36 layers, 32 heads, 8 kv heads, head_dim
    # 128, intermediate_size 9728, vocab_size 151936, tied. Published: 4.0B.
    "qwen3-4b": ModelSpec(name="qwen3-4b", hidden=2560, layers=36, heads=32, kv_heads=8,
                          head_dim=128, dense_ffn=9728, vocab=151_936, tied_embeddings=True,
                          arch_flags=_QWEN3_DENSE, rotary_base=1_000_000,
                          source="Qwen/Qwen3-4B config.json"),
    # Qwen/Qwen3-8B config.json: hidden_size 4096, 36 layers, 32 heads, 8 kv heads, head_dim
    # 128, intermediate_size 12288, vocab_size 151936, untied. Published: 8.2B.
    "qwen3-8b": ModelSpec(name="qwen3-8b", hidden=4096, layers=36, heads=32, kv_heads=8,
                          head_dim=128, dense_ffn=12288, vocab=151_936,
                          arch_flags=_QWEN3_DENSE, rotary_base=1_000_000,
                          source="Qwen/Qwen3-8B config.json"),
    # Qwen/Qwen3-32B config.json: hidden_size 5120, 64 layers, 64 heads, 8 kv heads, head_dim
    # 128, intermediate_size 25600, vocab_size 151936, untied. Published: 32.8B.
    "qwen3-32b": ModelSpec(name="qwen3-32b", hidden=5120, layers=64, heads=64, kv_heads=8,
                           head_dim=128, dense_ffn=25600, vocab=151_936,
                           arch_flags=_QWEN3_DENSE, rotary_base=1_000_000,
                           source="Qwen/Qwen3-32B config.json"),
    # meta-llama/Llama-3.1-70B config.json: hidden_size 8192, 80 layers, 64 heads, 8 kv heads
    # (head dim 128), intermediate_size 28672, vocab_size 128256, untied, rope_theta 500000.
    # Published: 70.6B.
    "llama-3.1-70b": ModelSpec(name="llama-3.1-70b", hidden=8192, layers=80, heads=64,
                               kv_heads=8, head_dim=128, dense_ffn=28672, vocab=128_256,
                               rotary_base=500_000,
                               source="meta-llama/Llama-3.1-70B config.json"),
    # meta-llama/Llama-3.1-8B config.json: hidden_size 4096, 32 layers, 32 heads, 8 kv heads
    # (head dim 128), intermediate_size 14336, vocab_size 128256, untied, rope_theta 500000
    # (its llama3 rope scaling is not a peak term). Published: 8.0B.
    "llama-3.1-8b": ModelSpec(name="llama-3.1-8b", hidden=4096, layers=32, heads=32,
                              kv_heads=8, head_dim=128, dense_ffn=14336, vocab=128_256,
                              rotary_base=500_000, source="meta-llama/Llama-3.1-8B config.json"),
}

# The GPU counts the paper runs its family on (used when --gpus is not given).
PAPER_GPUS = {"paper-120b": 16, "paper-241b": 32, "paper-667b": 64}

_ALIASES = {"deepseekv3": "deepseek-v3", "qwen3-30b": "qwen3-30b-a3b",
            "qwen2-57b": "qwen2-57b-a14b",
            "qwen3-235b": "qwen3-235b-a22b", "llama-3.1-8b-instruct": "llama-3.1-8b",
            "llama3.1-8b": "llama-3.1-8b", "kimi-k2-instruct": "kimi-k2",
            "maverick": "llama-4-maverick", "llama4-maverick": "llama-4-maverick"}


def preset(name: str) -> ModelSpec:
    """A preset by name (case-insensitive: ``DeepSeek-V3`` and ``deepseek-v3`` both work)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise PlanError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} "
                        f"(or give a path to a Hugging Face config.json)")
    return PRESETS[key]


def load_model(spec: str) -> ModelSpec:
    """``spec`` is a preset name or a path to a Hugging Face ``config.json``."""
    if os.path.isfile(spec):
        return model_from_hf_config(spec)
    if spec.endswith(".json") or os.sep in spec:
        raise PlanError(f"model config {spec!r} does not exist")
    return preset(spec)


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def model_from_hf_config(config, name: Optional[str] = None) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` (path or already-loaded dict).

    Keys read: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: heads), ``head_dim`` (default: hidden/heads),
    ``num_experts`` / ``n_routed_experts`` / ``num_local_experts``, ``num_experts_per_tok``
    (or ``experts_per_token``), ``moe_intermediate_size`` (else ``intermediate_size`` is the
    expert width, as in gpt-oss / Mixtral), ``n_shared_experts`` (width
    ``moe_intermediate_size``) or ``shared_expert_intermediate_size`` (one shared expert of
    that width), ``first_k_dense_replace`` (leading dense layers of width
    ``intermediate_size``), ``vocab_size``, ``tie_word_embeddings``, ``torch_dtype``; MLA
    (``kv_lora_rank``) sets the attention shape from ``qk_nope_head_dim`` +
    ``qk_rope_head_dim`` and ``v_head_dim``.
    """
    source = "config dict"
    if not isinstance(config, Mapping):
        path = str(config)
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"model config {path!r} does not exist") from None
        except json.JSONDecodeError as err:
            raise PlanError(f"model config {path!r} is not valid JSON: {err}") from None
        source = path
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), Mapping):  # multimodal wrappers
        cfg = {**cfg, **cfg["text_config"]}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if cfg.get(k) is None]
    if missing:
        raise PlanError(f"{source}: missing {', '.join(missing)} (not a decoder config.json?)")
    H = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=H // heads))
    v_head_dim = None
    mla = None
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
        nope = int(_first(cfg, "qk_nope_head_dim", default=128))
        rope = int(_first(cfg, "qk_rope_head_dim", default=64))
        v_head_dim = int(_first(cfg, "v_head_dim", default=nope))
        head_dim, kv_heads = nope + rope, heads
        scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), Mapping) else {}
        q_lora = cfg.get("q_lora_rank")
        mla = MLA(q_lora_rank=int(q_lora) if q_lora else None,
                  kv_lora_rank=int(cfg["kv_lora_rank"]), qk_head_dim=nope,
                  qk_pos_emb_head_dim=rope, v_head_dim=v_head_dim,
                  rotary_scaling_factor=float(scaling.get("factor") or 1.0),
                  mscale=float(scaling.get("mscale") or 1.0),
                  mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))
    experts = int(_first(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=0)
                  or 0)
    topk = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", default=0)
               or 0)
    intermediate = _first(cfg, "intermediate_size", default=0) or 0
    expert_ffn = int(_first(cfg, "moe_intermediate_size", default=intermediate) or 0)
    shared, shared_ffn = 0, 0
    if cfg.get("n_shared_experts"):
        shared, shared_ffn = int(cfg["n_shared_experts"]), expert_ffn
    elif cfg.get("shared_expert_intermediate_size"):
        shared, shared_ffn = 1, int(cfg["shared_expert_intermediate_size"])
    dense_layers = int(cfg.get("first_k_dense_replace") or 0) if experts else 0
    step = int(cfg.get("interleave_moe_layer_step") or 1) if experts else 1
    if step > 1 or cfg.get("intermediate_size_mlp"):
        # Llama-4: every step-th layer MoE, the others dense of width intermediate_size_mlp;
        # intermediate_size is the routed experts' and the one always-on shared expert's width.
        intermediate = int(_first(cfg, "intermediate_size_mlp", default=intermediate) or 0)
        if experts and not shared and cfg.get("model_type", "").startswith("llama4"):
            shared, shared_ffn = 1, expert_ffn
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        dtype = "bf16"
    kind = str(cfg.get("model_type") or "")
    gpt_oss = kind.startswith("gpt_oss")
    qkv_bias = bool(cfg.get("qkv_bias") or cfg.get("attention_bias") or kind.startswith("qwen2"))
    return ModelSpec(
        name=name or str(cfg.get("model_type") or "config"),
        hidden=H, layers=int(cfg["num_hidden_layers"]), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, v_head_dim=v_head_dim, mla=mla,
        arch_flags=_hf_arch_flags(cfg, mla is not None, bool(experts), bool(shared)),
        experts=experts, topk=topk if experts else 0, expert_ffn=expert_ffn if experts else 0,
        shared_experts=shared, shared_expert_ffn=shared_ffn,
        dense_ffn=int(intermediate) if (dense_layers or step > 1 or not experts) else 0,
        dense_layers=dense_layers, moe_layer_step=step, vocab=int(cfg["vocab_size"]),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype, source=source,
        mtp_layers=int(_first(cfg, "num_nextn_predict_layers", "mtp_num_layers", default=0)
                       or 0),
        linear_bias=gpt_oss, qkv_bias=qkv_bias and not gpt_oss, sinks=gpt_oss,
        rotary_base=int(cfg.get("rope_theta") or 10000),
        glu="quick-geglu" if gpt_oss else "swiglu", **_hf_window(cfg),
    )


def _hf_window(cfg: Mapping[str, Any]) -> Dict[str, int]:
    """``window`` and ``window_skip_freq`` from ``sliding_window`` and ``layer_types``
    (GPT-OSS: sliding, full, ...): a window on layers whose type is sliding; the pattern must
    be Megatron's (every N-th layer full). Without ``layer_types`` (Mistral, Qwen: the key
    is set but ``use_sliding_window`` false or absent) no window is modelled."""
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    if not window or not isinstance(types, list) or "sliding_attention" not in types:
        return {}
    freq = _skip_freq([t == "sliding_attention" for t in types], f"layer_types {types}")
    return dict(window=int(window), window_skip_freq=freq)


def _skip_freq(windowed: Sequence[bool], what: str) -> int:
    """Megatron's ``--window-attn-skip-freq`` N of a per-layer pattern (True: windowed) whose
    every N-th layer is full and the others windowed (0: every layer windowed);
    ``PlanError`` naming ``what`` for any other pattern."""
    full = [i for i, w in enumerate(windowed) if not w]
    freq = full[0] + 1 if full else 0
    if freq and full != list(range(freq - 1, len(windowed), freq)):
        raise PlanError(f"{what}: not every N-th layer full with the others windowed (Megatron's "
                        "--window-attn-skip-freq N); the planner models only that pattern")
    return freq


def _hf_arch_flags(cfg: Mapping[str, Any], mla: bool, moe: bool, shared: bool
                  ) -> Tuple[str, ...]:
    """The Megatron-LM flags of what a ``config.json`` says beyond the shapes and what
    ``ModelSpec`` models: q/k norms (Qwen3, and MLA's latent norms), the shared expert's gate
    (Qwen2-MoE), GPT-OSS's GLU offset and clamp, and the router (DeepSeek's sigmoid
    scores, expert bias, group-limited routing, scaling)."""
    kind = str(cfg.get("model_type") or "")
    out: List[str] = []
    if mla or kind.startswith("qwen3"):
        out.append("--qk-layernorm")
    if kind.startswith("llama4"):
        out += (["--qk-l2-norm"] if cfg.get("use_qk_norm") else []) + \
            ["--moe-router-score-function", "sigmoid"]
    if kind.startswith("gpt_oss"):  # Megatron's GPT-OSS GLU: quick-GELU, offset 1, clamp
        limit = cfg.get("swiglu_limit") or 7.0
        out += ["--glu-linear-offset", "1", "--activation-func-clamp-value",
                _number(float(limit))]
    if moe and shared and kind.startswith("qwen2"):
        out.append("--moe-shared-expert-gate")
    if moe and cfg.get("scoring_func") == "sigmoid":
        out += ["--moe-router-score-function", "sigmoid"]
    if moe and cfg.get("topk_method") == "noaux_tc":
        out.append("--moe-router-enable-expert-bias")
    if moe and cfg.get("n_group") and cfg.get("topk_group"):
        out += ["--moe-router-num-groups", str(int(cfg["n_group"])),
                "--moe-router-group-topk", str(int(cfg["topk_group"]))]
    if moe and cfg.get("routed_scaling_factor") not in (None, 1, 1.0):
        out += ["--moe-router-topk-scaling-factor", _number(float(cfg["routed_scaling_factor"]))]
    return tuple(out)


def model_from_megatron_args(args, name: str = "megatron-args") -> ModelSpec:
    """A ``ModelSpec`` from Megatron-LM's parsed arguments (``argparse.Namespace``).

    Reads ``hidden_size``, ``num_layers``, ``num_attention_heads``, ``num_query_groups``
    (when ``group_query_attention``), ``kv_channels``, ``num_experts``, ``moe_router_topk``,
    ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``), ``ffn_hidden_size``,
    ``moe_shared_expert_intermediate_size`` (one shared expert of that width),
    ``moe_layer_freq`` (an int N: every N-th layer is MoE; or a list of 0/1), ``padded_vocab_size``
    or ``vocab_size``, ``swiglu`` / ``quick_geglu``, ``untie_embeddings_and_output_weights``,
    ``bf16``/``fp16``, ``mtp_num_layers``, ``add_bias_linear``, ``add_qkv_bias``,
    ``softmax_type``, ``window_size``, ``window_attn_skip_freq`` and ``rotary_base``; with
    ``multi_latent_attention``, MLA's ``q_lora_rank``,
    ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim`` and YaRN's
    ``rotary_scaling_factor``, ``mscale``, ``mscale_all_dim``. A ``moe_layer_freq`` pattern is
    modelled as its count of dense layers placed first.
    """
    def get(attr, default=None):
        value = getattr(args, attr, None)
        return default if value is None else value

    for attr in ("hidden_size", "num_layers", "num_attention_heads"):
        if get(attr) is None:
            raise PlanError(f"Megatron args: {attr} is missing")
    vocab = get("padded_vocab_size") or get("vocab_size")
    if vocab is None:
        raise PlanError("Megatron args: neither padded_vocab_size nor vocab_size is set")
    H, L, heads = int(args.hidden_size), int(args.num_layers), int(args.num_attention_heads)
    kv = int(get("num_query_groups", heads)) if get("group_query_attention", False) else heads
    experts = int(get("num_experts", 0) or 0)
    ffn = int(get("ffn_hidden_size", 4 * H))
    dense_layers = 0
    freq = get("moe_layer_freq", 1)
    if experts:
        if isinstance(freq, int):
            dense_layers = L - len([i for i in range(L) if i % freq == 0])
        else:
            pattern = list(freq)
            if len(pattern) != L:
                raise PlanError(f"Megatron args: moe_layer_freq has {len(pattern)} entries for "
                                f"{L} layers")
            dense_layers = pattern.count(0)
    shared_ffn = int(get("moe_shared_expert_intermediate_size", 0) or 0)
    dtype = "bf16" if get("bf16", False) else "fp16" if get("fp16", False) else "fp32"
    mla, head_dim, v_head_dim = None, int(get("kv_channels", H // heads)), None
    if get("multi_latent_attention", False):
        mla = MLA(q_lora_rank=get("q_lora_rank"), kv_lora_rank=int(get("kv_lora_rank", 32)),
                  qk_head_dim=int(get("qk_head_dim", 128)),
                  qk_pos_emb_head_dim=int(get("qk_pos_emb_head_dim", 64)),
                  v_head_dim=int(get("v_head_dim", 128)),
                  rotary_scaling_factor=float(get("rotary_scaling_factor", 1.0)),
                  mscale=float(get("mscale", 1.0)),
                  mscale_all_dim=float(get("mscale_all_dim", 0.0)))
        kv, head_dim, v_head_dim = heads, mla.qk_head_dim + mla.qk_pos_emb_head_dim, mla.v_head_dim
    return ModelSpec(
        name=name, hidden=H, layers=L, heads=heads, kv_heads=kv, mla=mla, v_head_dim=v_head_dim,
        head_dim=head_dim, vocab=int(vocab), experts=experts,
        topk=int(get("moe_router_topk", 2)) if experts else 0,
        expert_ffn=int(get("moe_ffn_hidden_size", ffn)) if experts else 0,
        shared_experts=1 if shared_ffn else 0, shared_expert_ffn=shared_ffn,
        dense_ffn=ffn if (dense_layers or not experts) else 0, dense_layers=dense_layers,
        gated=bool(get("swiglu", False) or get("quick_geglu", False)),
        glu="quick-geglu" if get("quick_geglu", False) else "swiglu",
        tied_embeddings=not get("untie_embeddings_and_output_weights", False),
        dtype=dtype, source="Megatron-LM args",
        mtp_layers=int(get("mtp_num_layers", 0) or 0),
        linear_bias=bool(get("add_bias_linear", False)),
        qkv_bias=bool(get("add_qkv_bias", False)),
        sinks=get("softmax_type", "vanilla") == "learnable", **_megatron_window(get),
        rotary_base=int(get("rotary_base", 10000)),
    )


def _megatron_window(get) -> Dict[str, int]:
    """``window`` / ``window_skip_freq`` from ``window_size`` (left, right) and
    ``window_attn_skip_freq`` (an int; a list pattern must be every N-th layer full)."""
    size = get("window_size")
    if not size:
        return {}
    freq = get("window_attn_skip_freq", 0) or 0
    if not isinstance(freq, int):  # a list: 1 windowed, 0 full
        freq = _skip_freq([bool(w) for w in freq],
                          f"Megatron args: window_attn_skip_freq {list(freq)}")
    return dict(window=int(size[0]), window_skip_freq=int(freq))


# --------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """How one training job is split over devices (Megatron-Core's parallel dimensions).

    World = TP·CP·PP·DP. Experts are split EP ways inside the TP·CP·DP ranks of a pipeline
    stage (expert tensor parallelism ETP = 1, the usual choice for fine-grained MoE), so EP
    must divide TP·CP·DP. ``sp`` (sequence parallelism) defaults to on when TP > 1.
    ``microbatches_in_flight``: microbatches whose checkpoint boundaries the first pipeline
    stage holds at once; 1F1B holds PP of them on the first stage (PP − s on stage s), which
    is the default. ``fused_kernels``: production GPU kernels (fused SwiGLU, gradient-
    accumulation fusion straight into the fp32 grad buffer, fused AdamW and gradient
    clipping, fp32-output matmuls); False models Megatron's
    unfused reference path (what the CPU validation runs). ``overlap``: communication runs
    beside compute, as on CUDA (PipelinedLLEP dispatches chunk i+1 while chunk i computes, so
    two chunks' rows are in flight); False: nothing overlaps, one chunk at a time (what
    PipelinedLLEP does on CPU). ``grad_fp32``: gradient buffer in
    fp32 (Megatron's ``--accumulate-allreduce-grads-in-fp32``), else in the model dtype.
    ``gpus_per_node``: devices sharing one host's memory (pinned-host accounting).
    Full activation recompute (per-layer checkpoints) is assumed throughout: every term is
    written for it. ``full_recompute`` False says the run does not use it (Megatron's
    ``recompute_granularity`` is not ``"full"``); the terms stay those of full recompute, and
    only attention replay, which exists only under it, stops applying.
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sp: Optional[bool] = None
    micro_batch_size: int = 1
    microbatches_in_flight: Optional[int] = None
    distributed_optimizer: bool = True
    grad_fp32: bool = True
    fused_kernels: bool = True
    overlap: bool = True
    gpus_per_node: int = 8
    full_recompute: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "pp", "cp", "dp", "micro_batch_size", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"layout: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.full_recompute, bool):
            raise PlanError(f"layout: full_recompute must be True or False, got "
                            f"{self.full_recompute!r}")
        if self.microbatches_in_flight is not None and self.microbatches_in_flight < 1:
            raise PlanError("layout: microbatches_in_flight must be >= 1")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise PlanError(f"layout: EP {self.ep} must divide TP·CP·DP = "
                            f"{self.tp}·{self.cp}·{self.dp} = {self.tp * self.cp * self.dp} "
                            f"(experts are split inside one pipeline stage's ranks)")
        if self.sp is None:
            object.__setattr__(self, "sp", self.tp > 1)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def in_flight(self) -> int:
        return self.microbatches_in_flight or self.pp

    @property
    def expert_dp(self) -> int:
        """Ranks sharing one expert's weights (expert data parallel): TP·CP·DP / EP."""
        return self.tp * self.cp * self.dp // self.ep

    @property
    def dense_dp(self) -> int:
        """Ranks over which the distributed optimizer shards dense parameters: DP·CP."""
        return self.dp * self.cp

    def describe(self) -> str:
        return (f"{self.gpus} GPUs = TP {self.tp} x CP {self.cp} x PP {self.pp} x DP {self.dp}, "
                f"EP {self.ep}, SP {'on' if self.sp else 'off'}, micro-batch "
                f"{self.micro_batch_size}, {self.in_flight} in flight")

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    @classmethod
    def for_gpus(cls, gpus: int, *, tp: int = 1, ep: int = 1, pp: int = 1, cp: int = 1,
                 **kw) -> "Layout":
        """The layout with DP = gpus / (TP·CP·PP); ``PlanError`` if that does not divide."""
        if not isinstance(gpus, int) or gpus < 1:
            raise PlanError(f"GPU count must be a positive integer, got {gpus!r}")
        for name, value in (("tp", tp), ("ep", ep), ("pp", pp), ("cp", cp)):
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"--{name} must be a positive integer, got {value!r}")
        if gpus % (tp * cp * pp):
            raise PlanError(f"layout TP {tp} x CP {cp} x PP {pp} = {tp * cp * pp} does not divide "
                            f"{gpus} GPUs")
        return cls(tp=tp, ep=ep, pp=pp, cp=cp, dp=gpus // (tp * cp * pp), **kw)


def check_layout(model: ModelSpec, layout: Layout) -> None:
    """``PlanError`` when ``layout`` cannot split ``model``."""
    if model.heads % layout.tp:
        raise PlanError(f"TP {layout.tp} does not divide {model.name}'s {model.heads} "
                        f"attention heads")
    if model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        raise PlanError(f"TP {layout.tp} and {model.name}'s {model.kv_heads} key/value heads: "
                        f"one must divide the other")
    if model.experts and model.experts % layout.ep:
        raise PlanError(f"EP {layout.ep} does not divide {model.name}'s {model.experts} experts")
    if not model.experts and layout.ep > 1:
        raise PlanError(f"{model.name} has no experts; EP must be 1")
    if layout.pp > model.layers:
        raise PlanError(f"PP {layout.pp} exceeds {model.name}'s {model.layers} layers")


def stage_layers(model: ModelSpec, layout: Layout) -> List[Tuple[int, int]]:
    """(first layer, layer count) of each pipeline stage: ceil(L/PP) layers, the last fewer."""
    per = math.ceil(model.layers / layout.pp)
    out, start = [], 0
    for _ in range(layout.pp):
        count = max(0, min(per, model.layers - start))
        out.append((start, count))
        start += count
    return out


def _divisors_desc(n: int, limit: int) -> List[int]:
    return [d for d in range(min(n, limit), 0, -1) if n % d == 0]


def default_layout(model: ModelSpec, gpus: int, *, tp: Optional[int] = None,
                   ep: Optional[int] = None, pp: Optional[int] = None,
                   cp: Optional[int] = None, gpus_per_node: int = 8, **kw) -> Layout:
    """A sensible long-context layout for ``gpus`` devices; given sizes are kept.

    Choices, in order: PP = 1 (pipeline bubbles and in-flight boundaries hurt long context);
    TP = the largest power of two ≤ ``gpus_per_node`` that divides the GPU count, the heads
    and (or is divided by) the KV heads (TP stays inside a node); CP = the rest of the GPUs
    (context parallelism is what shards a long sequence), DP = 1; EP = the largest divisor of
    the expert count that divides TP·CP·DP (spreading experts as far as possible).
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"GPU count must be a positive integer, got {gpus!r}")
    pp = pp or 1
    if gpus % pp:
        raise PlanError(f"PP {pp} does not divide {gpus} GPUs")
    if tp is None:
        tp, cand = 1, 1
        while cand * 2 <= gpus_per_node:
            cand *= 2
        while cand > 1:
            if (gpus // pp) % (cand * (cp or 1)) == 0 and model.heads % cand == 0 and \
                    (model.kv_heads % cand == 0 or cand % model.kv_heads == 0):
                tp = cand
                break
            cand //= 2
    if cp is None:
        if (gpus // pp) % tp:
            raise PlanError(f"TP {tp} x PP {pp} does not divide {gpus} GPUs")
        cp = gpus // (pp * tp)
    layout = Layout.for_gpus(gpus, tp=tp, pp=pp, cp=cp, ep=1, gpus_per_node=gpus_per_node, **kw)
    if ep is None:
        ep = 1
        if model.experts:
            room = layout.tp * layout.cp * layout.dp
            ep = next(d for d in _divisors_desc(model.experts, room) if room % d == 0)
    layout = layout.with_(ep=ep)
    check_layout(model, layout)
    return layout


def layout_from_megatron_args(args, world_size: Optional[int] = None) -> Layout:
    """A ``Layout`` from Megatron-LM's parsed arguments; ``world_size`` defaults to
    ``args.world_size`` (Megatron sets it), else TP·CP·PP (DP = 1). ``full_recompute``:
    ``recompute_granularity == "full"`` (an ``args`` without it: full, as planned)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp not in (None, 1):
        raise PlanError(f"expert_tensor_parallel_size {etp}: the planner models ETP = 1 only")
    world = world_size or getattr(args, "world_size", None) or tp * cp * pp
    layout = Layout.for_gpus(int(world), tp=tp, ep=ep, pp=pp, cp=cp,
                             sp=bool(getattr(args, "sequence_parallel", tp > 1)),
                             micro_batch_size=int(getattr(args, "micro_batch_size", 1) or 1),
                             distributed_optimizer=bool(getattr(args, "use_distributed_optimizer",
                                                                False)),
                             grad_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32",
                                                    True)),
                             full_recompute=getattr(args, "recompute_granularity",
                                                    "full") == "full")
    return layout
