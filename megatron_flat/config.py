"""FlatConfig: every knob of megatron-flat, validated once.

All four techniques are off by default, so ``FlatConfig()`` changes nothing. A config is
built from code (``FlatConfig(dispatch=True, ...)``) or from Megatron-LM's parsed
arguments (``FlatConfig.from_args(args)`` after ``add_flat_args`` was the
``extra_args_provider``). ``validate()`` runs in ``__post_init__``: a bad knob fails at
construction with a message that names the knob and the flag, before any process group
or collective is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

GIB = 1 << 30

DISPATCH_MODES = ("off", "llep", "pipelined")
DISPATCH_MEMBERSHIPS = ("strided", "contiguous")
VOCAB_MODES = ("auto", "weights", "activations")


def _flag(name: str) -> str:
    return "--flat-" + name.replace("_", "-")


@dataclass
class FlatConfig:
    """Knobs of the four techniques (architecture.md §2). Field metadata carries the flag help."""

    # PipelinedLLEP: the expert-dispatch peak.
    dispatch: str = field(
        default="off",
        metadata={"help": "MoE dispatch: off (Megatron's own), llep (least-loaded EP, "
                          "unchunked) or pipelined (PipelinedLLEP).",
                  "choices": DISPATCH_MODES},
    )
    dispatch_chunk_tokens: int = field(
        default=4096, metadata={"help": "Per-source token cap per chunk (c)."}
    )
    dispatch_max_chunks: int = field(
        default=10, metadata={"help": "Most chunks per layer per step (K_max)."}
    )
    dispatch_membership: str = field(
        default="strided",
        metadata={"help": "Chunk membership: strided (token t -> chunk t mod K) or contiguous.",
                  "choices": DISPATCH_MEMBERSHIPS},
    )
    dispatch_saved_chunks: int = field(
        default=0,
        metadata={"help": "Chunks per MoE layer kept from forward to backward instead of "
                          "recomputed (each expert's first-layer output; 0: recompute all)."},
    )
    dispatch_graph_only_recompute: bool = field(
        default=True,
        metadata={"help": "On the re-run of a checkpointed region (full or MoE-module "
                          "recompute), skip the MoE layer's dispatch when nothing later in the "
                          "region keeps its output for backward (verified on the first re-run; "
                          "the chunked backward does the work)."},
    )
    dispatch_grouped_calls: bool = field(
        default=False,
        metadata={"help": "Run each chunk's rows for a rank's own experts through one grouped "
                          "call (grouped-GEMM experts), not one call per expert: fewer "
                          "launches, a higher dispatch peak (the chunk's own experts' graph "
                          "and weight gradients held together in backward)."},
    )
    llep_alpha: float = field(
        default=1.0, metadata={"help": "LLEP capacity factor alpha (cap = alpha * mean load)."}
    )
    llep_min_tokens_per_gemm: int = field(
        default=1024, metadata={"help": "LLEP skips spill pieces smaller than this (m)."}
    )
    llep_imbalance_threshold: float = field(
        default=1.3,
        metadata={"help": "Use plain EP when max/mean rank load is below this (lambda); "
                          "0 always plans LLEP."},
    )

    # Ring-DTP: the vocabulary-projection peak.
    vocab: bool = field(
        default=False, metadata={"help": "Use Ring-DTP for the output layer and loss."}
    )
    vocab_mode: str = field(
        default="auto",
        metadata={"help": "Ring schedule: move weights, move activations, or auto.",
                  "choices": VOCAB_MODES},
    )
    vocab_block_size: int = field(
        default=8192, metadata={"help": "Vocabulary strip width: rows of the projection "
                                        "folded at a time (within each rank's V/P shard)."}
    )
    # 128 MiB: the smallest power of two whose tile keeps its extra launches and re-reads
    # each under 10 % of its GEMM time at the paper's shape (H 7168, bf16, strips of 6,250
    # rows at TP 8 or 8,192 at TP 1: 5,368 / 4,096 tokens a tile; 6 % and 5-7 % on the
    # H200 model; 64 MiB: 12 % and 10-13 %). plan.costs.tile_overhead computes it from the
    # ledger-measured per-tile counts (tests/plan/test_tile_costs.py checks both).
    vocab_tile_bytes: int = field(
        default=128 * 1024 * 1024,
        metadata={"help": "Token tiles of Ring-DTP's strips: bytes of one tile (fp32), so the "
                          "vocabulary working set does not grow with the tokens (0: whole "
                          "strips)."}
    )

    # Sequence tiles in the attention block: the layer's own working set.
    attn_tiles: int = field(
        default=0,
        metadata={"help": "Sequence tiles of the attention block's projections under "
                          "sequence parallelism: tokens of one gathered tile, so the gathered "
                          "N x H before QKV and the N x H partial output before the "
                          "reduce-scatter never exist (0: off; the planner picks 32768 when the "
                          "four peaks' techniques are not enough). Multi-latent attention: "
                          "its output, q (or q up), kv up and gathering down projections are "
                          "tiled; 0.19's `--mla-down-proj-fusion` is refused."}
    )

    # Attention replay: one core-attention forward per layer under full recompute.
    attn_replay: bool = field(
        default=False,
        metadata={"help": "Under full recompute, keep each core attention's first output (O "
                          "and its log-sum-exp) in SCO's host pool and return it in the "
                          "re-run instead of running the kernel again: one attention forward "
                          "per layer per step instead of two, bitwise equal. Its host bytes "
                          "come out of --flat-sco-host-budget-gib; where it cannot be exact "
                          "(an attention without a backward from a kept output, fp8, no host "
                          "budget) the stock recompute runs, with one warning."}
    )

    # SCO: the checkpoint-boundary peak.
    sco: bool = field(
        default=False, metadata={"help": "Offload checkpoint boundaries to pinned host memory."}
    )
    sco_host_budget_gib: float = field(
        default=0.0, metadata={"help": "Host budget for boundaries, GiB (0: nothing offloaded)."}
    )
    sco_prefetch: int = field(
        default=1, metadata={"help": "Boundaries restored ahead of the recompute."}
    )

    # OffloadStreamAdamW: the optimizer-state peak.
    optimizer_offload: bool = field(
        default=False, metadata={"help": "Keep AdamW state in pinned host memory, streamed."}
    )
    optimizer_bucket_numel: int = field(
        default=100_000_000, metadata={"help": "Parameters per optimizer bucket."}
    )
    optimizer_num_slots: int = field(
        default=2, metadata={"help": "Device staging slots for the optimizer pipeline."}
    )

    # Param offload: the model-state peak (the routed experts' weights and fp32 gradients).
    param_offload: bool = field(
        default=False,
        metadata={"help": "Keep the routed experts' weights and fp32 gradients in pinned host "
                          "memory: each MoE layer's weights are fetched into a device slot one "
                          "layer ahead (forward, recompute, backward) and its gradient is "
                          "drained to the host as its backward ends, so the device holds two "
                          "layers' expert state whatever the depth. Needs --flat-dispatch, "
                          "--flat-optimizer-offload (the experts' AdamW runs on the host state) "
                          "and --expert-model-parallel-size > 1."},
    )

    # The host tier: every technique's host memory (megatron_flat.runtime.host_tier).
    host_mem_per_node_gib: float = field(
        default=0.0,
        metadata={"help": "Host memory of one node that megatron-flat may pin, GiB, checked "
                          "against ranks per node x each rank's host budgets before anything "
                          "is allocated (0: the node's total memory)."},
    )
    host_pageable: bool = field(
        default=False,
        metadata={"help": "When pinning host memory fails, use pageable memory (every copy "
                          "from it is synchronous) instead of stopping with an error."},
    )

    # Debugging: checks that read device data on every call.
    debug_checks: bool = field(
        default=False,
        metadata={"help": "Check inputs and plans on every call (dispatch: route ranges and "
                          "order, counts against the plan, the per-chunk receive bound; "
                          "Ring-DTP: the label range, and the plan gathered anew); each check "
                          "waits for the device (a host sync)."},
    )

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid knob (and its flag)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                self._bad(f.name, value, "must be True or False")
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                self._bad(f.name, value, "must be an integer")
            if f.type in ("float", float) and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                self._bad(f.name, value, "must be a number")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                self._bad(f.name, value, f"must be one of {', '.join(choices)}")
        for name in ("dispatch_chunk_tokens", "dispatch_max_chunks", "llep_min_tokens_per_gemm",
                     "vocab_block_size", "optimizer_bucket_numel", "optimizer_num_slots"):
            if getattr(self, name) < 1:
                self._bad(name, getattr(self, name), "must be >= 1")
        if not self.llep_alpha > 0:
            self._bad("llep_alpha", self.llep_alpha, "must be > 0")
        if self.llep_imbalance_threshold < 0:
            self._bad("llep_imbalance_threshold", self.llep_imbalance_threshold, "must be >= 0")
        if self.vocab_tile_bytes < 0:
            self._bad("vocab_tile_bytes", self.vocab_tile_bytes, "must be >= 0 (0: whole strips)")
        if self.attn_tiles < 0:
            self._bad("attn_tiles", self.attn_tiles, "must be >= 0 (0: off)")
        if self.sco_host_budget_gib < 0:
            self._bad("sco_host_budget_gib", self.sco_host_budget_gib, "must be >= 0")
        if self.host_mem_per_node_gib < 0:
            self._bad("host_mem_per_node_gib", self.host_mem_per_node_gib, "must be >= 0")
        if self.sco_prefetch < 0:
            self._bad("sco_prefetch", self.sco_prefetch, "must be >= 0")
        if self.dispatch_saved_chunks < 0:
            self._bad("dispatch_saved_chunks", self.dispatch_saved_chunks, "must be >= 0")
        if self.param_offload and (self.dispatch == "off" or not self.optimizer_offload):
            self._bad("param_offload", True,
                      "needs --flat-dispatch llep or pipelined (the offloaded experts run in "
                      "the flat MoE layer) and --flat-optimizer-offload (their AdamW state "
                      f"lives in host memory); dispatch is {self.dispatch!r}, optimizer "
                      f"offload {self.optimizer_offload}")

    @staticmethod
    def _bad(name: str, value: Any, why: str) -> None:
        raise ValueError(f"FlatConfig.{name} ({_flag(name)}) {why}; got {value!r}")

    # ------------------------------------------------------------------ derived
    @property
    def sco_host_budget_bytes(self) -> int:
        return int(self.sco_host_budget_gib * GIB)

    @property
    def host_mem_per_node_bytes(self) -> int:
        return int(self.host_mem_per_node_gib * GIB)

    @property
    def any_enabled(self) -> bool:
        return (self.dispatch != "off" or self.vocab or self.sco or self.optimizer_offload
                or self.attn_tiles > 0 or self.attn_replay or self.param_offload)

    @classmethod
    def preset(cls, name: str, **overrides) -> "FlatConfig":
        """A named bundle of knobs; ``overrides`` win. ``"paper"``: all four techniques on
        with the defaults of architecture.md §2 (K_max 10, strided chunks, alpha 1.0, m 1024,
        lambda 1.3, ring mode auto, prefetch 1, 100M-parameter buckets, 2 slots)."""
        if name not in PRESETS:
            raise ValueError(f"unknown FlatConfig preset {name!r}; known: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line naming each enabled technique with its main knobs (for logs)."""
        parts = []
        if self.dispatch != "off":
            name = "PipelinedLLEP" if self.dispatch == "pipelined" else "LLEP"
            kept = (f", {self.dispatch_saved_chunks} kept"
                    if self.dispatch == "pipelined" and self.dispatch_saved_chunks else "")
            parts.append(f"{name} (chunk cap {self.dispatch_chunk_tokens} tokens, "
                         f"<= {self.dispatch_max_chunks} chunks{kept})")
        if self.vocab:
            tiles = (f", tiles of {self.vocab_tile_bytes / 2**20:g} MiB" if self.vocab_tile_bytes
                     else "")
            parts.append(f"Ring-DTP (mode {self.vocab_mode}, block {self.vocab_block_size}"
                         f"{tiles})")
        if self.attn_tiles:
            parts.append(f"attention tiles ({self.attn_tiles:,} tokens)")
        if self.attn_replay:
            parts.append("attention replay")
        if self.sco:
            parts.append(f"SCO (host budget {self.sco_host_budget_gib:g} GiB, "
                         f"prefetch {self.sco_prefetch})")
        if self.optimizer_offload:
            parts.append(f"OffloadStreamAdamW (buckets of {self.optimizer_bucket_numel:,} "
                         f"elements, {self.optimizer_num_slots} slots)")
        if self.param_offload:
            parts.append("param offload (routed experts' weights and gradients in host "
                         "memory, two device slots)")
        return ", ".join(parts) if parts else "every technique off (stock Megatron)"

    # ------------------------------------------------------------------ CLI
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FlatConfig":
        """Build from parsed ``--flat-*`` flags; attributes missing from ``args`` keep defaults.

        With ``--flat-preset NAME`` the preset is the base and every flag given on the command
        line overrides it, even when it repeats the flag's default (``--flat-preset paper
        --no-flat-sco`` turns SCO off). For a namespace not parsed by ``add_flat_args``'s
        flags, a value that differs from the default counts as given.
        """
        defaults = cls()
        values = {}
        for f in dataclasses.fields(cls):
            attr = "flat_" + f.name
            if hasattr(args, attr):
                values[f.name] = getattr(args, attr)
        preset = getattr(args, "flat_preset", None)
        if preset:
            given = getattr(args, _GIVEN, None)
            if given is None:
                changed = {k: v for k, v in values.items() if v != getattr(defaults, k)}
            else:
                changed = {k: v for k, v in values.items() if "flat_" + k in given}
            return cls.preset(preset, **changed)
        return cls(**values)


# Namespace attribute listing the --flat-* destinations given on the command line.
_GIVEN = "_flat_given"


def _recording(action_class: type) -> type:
    """``action_class`` that also records its destination in ``namespace._flat_given``."""

    class Recording(action_class):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            given = set(getattr(namespace, _GIVEN, None) or ())
            setattr(namespace, _GIVEN, given | {self.dest})

    Recording.__name__ = "Recording" + action_class.__name__
    return Recording


_STORE = _recording(argparse._StoreAction)
_BOOL = _recording(argparse.BooleanOptionalAction)


def add_flat_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--flat-*`` flag to ``parser`` and return it.

    Has the shape of Megatron-LM's ``extra_args_provider`` (takes and returns the parser),
    so ``pretrain(..., extra_args_provider=add_flat_args)`` works; calling it on a parser
    that already has the flags is a no-op, so it composes with other providers.
    """
    if any(a.dest == "flat_dispatch" for a in parser._actions):
        return parser
    group = parser.add_argument_group("megatron-flat", "Flatten the four memory peaks.")
    defaults = FlatConfig()
    for f in dataclasses.fields(FlatConfig):
        default = getattr(defaults, f.name)
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        dest = "flat_" + f.name
        if f.type in ("bool", bool):
            group.add_argument(_flag(f.name), dest=dest, action=_BOOL, default=default,
                               help=help_text)
            continue
        kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str)
                                                           else f.type.__name__, str)
        group.add_argument(_flag(f.name), dest=dest, action=_STORE, type=kind, default=default,
                           choices=f.metadata.get("choices"), help=help_text)
    group.add_argument("--flat-preset", dest="flat_preset", choices=sorted(PRESETS), default=None,
                       help="Start from a named bundle of knobs (paper: all four techniques on "
                            "with the paper's defaults); other --flat-* flags override it.")
    return parser


PRESETS: Dict[str, Dict[str, Any]] = {
    "paper": dict(
        dispatch="pipelined", dispatch_max_chunks=10, dispatch_membership="strided",
        llep_alpha=1.0, llep_min_tokens_per_gemm=1024, llep_imbalance_threshold=1.3,
        vocab=True, vocab_mode="auto",
        sco=True, sco_host_budget_gib=64.0, sco_prefetch=1,
        optimizer_offload=True, optimizer_bucket_numel=100_000_000, optimizer_num_slots=2,
    ),
}
