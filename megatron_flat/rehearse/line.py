"""A GPU launch line made to run on CPU: what is substituted, dropped or refused, and why.

Pure planning for ``python -m megatron_flat rehearse``: given what the checkout's own parser
made of the line (``rehearse.probe``: every setting's value and every option's arity),
:func:`plan` decides, setting by setting,

* **substituted** — a GPU-only implementation with a CPU form that computes the same math:
  transformer-engine modules -> Megatron's local ones (and a named transformer-engine layer
  spec -> its local twin), each fused kernel -> its unfused form, the grouped-GEMM
  compute-capability check -> answered on CPU (the CPU backend's reference grouped GEMM runs
  the same per-expert GEMMs);
* **dropped** — a GPU feature with no CPU form that does not change the math (CUDA graphs
  replay the same kernels, userbuffer overlap moves the same bytes earlier, ...);
* **refused** — a setting that changes the math and has no CPU form (fp8/fp4 recipes): the
  rehearsal could not show the losses the GPU run will have.

Both runs get the same changes, so the comparison stays stock against flat. The result says
what runs instead of what was asked, one line per change, printed before the runs start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

SUBSTITUTED, DROPPED = "substituted", "dropped"


@dataclass(frozen=True)
class Change:
    """One setting of the line that runs otherwise on CPU."""

    kind: str  # SUBSTITUTED or DROPPED
    asked: str  # what the line asks (or Megatron-LM's default it leaves in force)
    instead: str  # what the rehearsal runs
    why: str

    def line(self) -> str:
        return f"{self.asked} -> {self.instead}: {self.why}"


@dataclass
class CpuLine:
    """The line to run on CPU and the changes that made it."""

    args: List[str]
    changes: List[Change] = field(default_factory=list)
    refused: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)  # for the runs' processes (CPU backend)

    @property
    def substitutions(self) -> int:
        return len(self.changes)

    def block(self) -> List[str]:
        """The announcement: one line per change (empty when the line runs as written)."""
        if not self.changes:
            return []
        rows = [f"{len(self.changes)} setting(s) of the line run otherwise on CPU, in both "
                "runs alike (asked -> runs instead: why):"]
        rows += [f"  [{c.kind}] {c.line()}" for c in self.changes]
        return rows


# ---------------------------------------------------------------------------- the line
def _name(token: str) -> str:
    return token.split("=", 1)[0] if token.startswith("--") else token


def _takes(args: Sequence[str], i: int, arity: int) -> int:
    """How many tokens after ``args[i]`` are its values."""
    if "=" in args[i] or arity == 0:
        return 0
    if arity > 0:
        return arity
    n = 0  # a variable number: up to the next option
    while i + 1 + n < len(args) and not args[i + 1 + n].startswith("--"):
        n += 1
    return n


def strip_options(args: Sequence[str],
                  arities: Mapping[str, int]) -> Tuple[List[str], List[str]]:
    """``args`` without the options in ``arities`` (option -> values it takes, -1 for a
    variable number) and their values; returns (kept, removed)."""
    kept: List[str] = []
    removed: List[str] = []
    i = 0
    while i < len(args):
        name = _name(args[i])
        if name in arities:
            end = i + 1 + _takes(args, i, arities[name])
            removed.extend(args[i:end])
            i = end
            continue
        kept.append(args[i])
        i += 1
    return kept, removed


def remove_option(args: Sequence[str], option: str, arity: int) -> List[str]:
    """``args`` without any ``option`` (and its values)."""
    return strip_options(args, {option: arity})[0]


def option_values(args: Sequence[str], option: str, arity: int) -> Optional[List[str]]:
    """The values the last ``option`` in ``args`` gives, or None if absent."""
    found = None
    for i, token in enumerate(args):
        if _name(token) == option:
            if "=" in token:
                found = [token.split("=", 1)[1]]
            else:
                found = list(args[i + 1:i + 1 + _takes(args, i, arity)])
    return found


# ---------------------------------------------------------------------------- the rules
# Layer specs whose modules come from transformer-engine -> their local twins (same layer).
SPEC_TWINS: Dict[Tuple[str, str], str] = {
    ("megatron_flat.megatron.spec", "flat_gpt_layer_te_spec"): "flat_gpt_layer_spec",
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec"):
        "get_gpt_layer_local_spec",
}

# (setting, its value when on, the flag that turns it off, what the kernel is). Megatron-LM
# turns these on by default; each fused kernel is a CUDA (apex / transformer-engine /
# Megatron) extension, and its unfused form is the reference it is tested against.
OFF_FLAGS = (
    ("apply_rope_fusion", True, "--no-rope-fusion", "the fused RoPE kernel"),
    ("no_persist_layer_norm", False, "--no-persist-layer-norm",
     "apex's persistent layer-norm kernel"),
    ("gradient_accumulation_fusion", True, "--no-gradient-accumulation-fusion",
     "apex's fused weight-gradient accumulation into main_grad"),
    ("masked_softmax_fusion", True, "--no-masked-softmax-fusion",
     "Megatron's fused scale-mask-softmax kernel"),
    ("bias_swiglu_fusion", True, "--no-bias-swiglu-fusion", "the fused bias-SwiGLU kernel"),
    ("bias_dropout_fusion", True, "--no-bias-dropout-fusion",
     "the fused bias-dropout-add kernel"),
)
# (setting, the flag that turns it on, what the kernel is): removed when on.
ON_FLAGS = (
    ("moe_permute_fusion", "--moe-permute-fusion", "transformer-engine's fused token permute"),
    ("moe_router_fusion", "--moe-router-fusion", "transformer-engine's fused router top-k"),
    ("use_te_activation_func", "--use-te-activation-func",
     "transformer-engine's activation kernels"),
)
UNFUSED = "computes the same values unfused (the form the fused one is tested against)"

# GPU features with no CPU form that leave the math as it is: (setting, is-on, flags, why).
DROPS = (
    ("cuda_graph_impl", lambda v: v not in (None, "none"),
     ("--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-warmup-steps",
      "--cuda-graph-modules"),
     "CUDA graphs replay the kernels they captured: the same math, fewer launches"),
    ("enable_cuda_graph", bool, ("--enable-cuda-graph", "--cuda-graph-scope",
                                 "--cuda-graph-warmup-steps"),
     "CUDA graphs replay the kernels they captured: the same math, fewer launches"),
    ("external_cuda_graph", bool, ("--external-cuda-graph", "--cuda-graph-scope",
                                   "--cuda-graph-warmup-steps"),
     "CUDA graphs replay the kernels they captured: the same math, fewer launches"),
    ("tp_comm_overlap", bool, ("--tp-comm-overlap", "--tp-comm-overlap-cfg"),
     "userbuffer overlap moves the same tensor-parallel bytes while GEMMs run"),
    ("te_rng_tracker", bool, ("--te-rng-tracker",),
     "transformer-engine's RNG tracker; Megatron's own one draws the same distributions "
     "(other dropout masks than the GPU run's, the same in both runs)"),
    ("use_flash_attn", bool, ("--use-flash-attn",),
     "flash attention is exact attention; the local core attention computes it on CPU"),
    ("nccl_ub", bool, ("--use-nccl-ub",), "NCCL user buffers: the same collectives"),
    ("use_sharp", bool, ("--use-sharp", "--sharp-enabled-group"),
     "SHARP in-network reductions: the same sums"),
)
ATTENTION_BACKENDS_ON_GPU = ("flash", "fused", "unfused")  # transformer-engine's


def _text(value: Any) -> str:
    if isinstance(value, str) and value.startswith("AttnBackend."):
        return value.split(".", 1)[1]
    return str(value)


def _asked(args: Sequence[str], option: str, arity: int, shown: str) -> str:
    if option_values(args, option, arity) is None:
        return f"{shown} (Megatron-LM's default)"
    return shown


def plan(args: Sequence[str], values: Mapping[str, Any],
         options: Mapping[str, int]) -> CpuLine:
    """What of ``args`` runs otherwise on CPU. ``values``/``options``: the checkout parser's
    view of ``args`` (``rehearse.probe``); a rule whose flag the parser does not know is
    skipped (that release has no such setting)."""
    out = list(args)
    changes: List[Change] = []
    refused: List[str] = []

    def arity(option: str) -> int:
        return options.get(option, 1)

    # transformer-engine -> the local modules
    if values.get("transformer_impl") == "transformer_engine" and "--transformer-impl" in options:
        asked = _asked(out, "--transformer-impl", 1, "--transformer-impl transformer_engine")
        out = remove_option(out, "--transformer-impl", 1) + ["--transformer-impl", "local"]
        changes.append(Change(SUBSTITUTED, asked, "--transformer-impl local",
                              "transformer-engine's modules run only on a GPU; Megatron's "
                              "local modules compute the same layers"))
    spec = option_values(out, "--spec", arity("--spec"))
    if spec and len(spec) == 2 and tuple(spec) in SPEC_TWINS:
        twin = SPEC_TWINS[tuple(spec)]
        out = remove_option(out, "--spec", arity("--spec")) + ["--spec", spec[0], twin]
        changes.append(Change(SUBSTITUTED, f"--spec {spec[0]} {spec[1]}",
                              f"--spec {spec[0]} {twin}",
                              "its local twin builds the same layer from Megatron's local "
                              "modules (the norm transformer-engine fuses into the next "
                              "linear is its own module)"))
    backend = _text(values.get("attention_backend"))
    if backend in ATTENTION_BACKENDS_ON_GPU and "--attention-backend" in options:
        out = remove_option(out, "--attention-backend", 1)
        changes.append(Change(DROPPED, f"--attention-backend {backend}",
                              "(dropped: auto picks the local core attention)",
                              "transformer-engine's attention kernels run only on a GPU; "
                              "every backend computes exact softmax attention"))
    # the fused kernels -> their unfused forms
    swiglu = bool(values.get("swiglu"))
    for setting, on, flag, kernel in OFF_FLAGS:
        if setting not in values or values[setting] != on or flag not in options:
            continue
        if setting == "bias_swiglu_fusion" and not swiglu:
            continue  # not used without SwiGLU
        out.append(flag)
        changes.append(Change(SUBSTITUTED, f"{kernel} (Megatron-LM's default)", flag,
                              f"{kernel} is a CUDA extension; {UNFUSED}"))
    for setting, flag, kernel in ON_FLAGS:
        if values.get(setting) is True and flag in options:
            out = remove_option(out, flag, 0)
            changes.append(Change(SUBSTITUTED, flag, "(unfused)",
                                  f"{kernel} runs only on a GPU; Megatron's {UNFUSED}"))
    if (values.get("cross_entropy_loss_fusion") is True
            and values.get("cross_entropy_fusion_impl") == "te"
            and "--cross-entropy-loss-fusion" in options):
        out = remove_option(out, "--cross-entropy-loss-fusion", 0)
        out = remove_option(out, "--cross-entropy-fusion-impl", 1)
        changes.append(Change(SUBSTITUTED, "--cross-entropy-loss-fusion "
                              "--cross-entropy-fusion-impl te", "(unfused)",
                              "transformer-engine's fused cross-entropy runs only on a GPU; "
                              f"Megatron's vocab-parallel cross-entropy {UNFUSED}"))
    env: Dict[str, str] = {}
    if values.get("moe_grouped_gemm") is True:
        te_grouped = (values.get("transformer_impl") == "transformer_engine"
                      and not values.get("moe_use_legacy_grouped_gemm"))
        if te_grouped:  # the line's experts are TEGroupedMLP: keep them (cpu.grouped)
            from megatron_flat.cpu.grouped import TE_GROUPED_ENV

            env[TE_GROUPED_ENV] = "1"
        changes.append(Change(SUBSTITUTED, "--moe-grouped-gemm",
                              "--moe-grouped-gemm, Megatron-LM's compute-capability check "
                              "answered on CPU" + (
                                  "; TEGroupedMLP with CPU grouped linears for TE's"
                                  if te_grouped else ""),
                              "the CPU backend's reference grouped GEMM runs the same "
                              "per-expert GEMMs" + (
                                  ", one weight and bias per expert as TE's GroupedLinear"
                                  if te_grouped else "")))
    # GPU features with no CPU form and no effect on the math
    for setting, is_on, flags, why in DROPS:
        if setting not in values or not is_on(values[setting]):
            continue
        present = [f for f in flags if f in options and option_values(out, f, arity(f))
                   is not None]
        if not present:
            continue  # on by another setting (e.g. implied); nothing to drop from the line
        asked = " ".join(f"{f} {' '.join(option_values(out, f, arity(f)) or [])}".strip()
                         for f in present)
        for f in present:
            out = remove_option(out, f, arity(f))
        changes.append(Change(DROPPED, asked, "(dropped)", why))
    # settings that change the math and have no CPU form
    for setting, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")):
        if values.get(setting):
            refused.append(f"{flag} {values[setting]}: {setting} GEMMs round differently from "
                           "bf16 and a CPU has no such kernels, so a rehearsal could not show "
                           f"the losses this line will have; rehearse it without {flag} and "
                           f"its {setting}-only flags, and check {setting} on a GPU")
    if values.get("fp8_param_gather") and not values.get("fp8"):
        refused.append("--fp8-param-gather: keeps parameters in fp8 (changes the math); "
                       "rehearse without it")
    if values.get("use_precision_aware_optimizer"):
        refused.append("--use-precision-aware-optimizer: transformer-engine's FusedAdam keeps "
                       "optimizer state in the dtypes --main-params-dtype / --exp-avg-dtype "
                       "name, which a CPU cannot run; rehearse without it")
    return CpuLine(out, changes, refused, env)


def strict_refusal(line: CpuLine) -> Optional[str]:
    """Under ``--strict``: why the line is refused (None when it runs as written)."""
    if not line.changes:
        return None
    listed = "; ".join(f"{c.asked} ({c.kind})" for c in line.changes)
    return (f"--strict: {len(line.changes)} setting(s) of the line have no CPU form and "
            f"would run otherwise: {listed}")
