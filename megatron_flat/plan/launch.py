"""The Megatron-LM launch line a plan stands for (``plan --emit-launch``).

Pure: from the model, the chosen layout, the sequence length, the global batch and the
FlatConfig ``fit`` chose, the ``pretrain_gpt.py`` arguments that run exactly what was planned —
the model's shape and architecture (multi-latent attention, biases, attention sinks, sliding
windows, the GLU; q/k norms and the router's settings: ``ModelSpec.mla`` and ``arch_flags``),
Megatron's parallel layout, the precision and kernels the step-time model assumes (bf16,
grouped-GEMM experts, full recompute of every layer, the distributed optimizer with fp32
gradient reduction), the flat layer spec and the ``--flat-*`` flags — grouped with a
comment each. What a plan does not know (data, tokenizer, learning-rate schedule, save paths)
is emitted as mock data and a placeholder schedule, marked to be replaced.
"""

from __future__ import annotations

import shlex
from typing import List, Optional, Tuple

from megatron_flat.config import FlatConfig
from megatron_flat.plan.model import Layout, ModelSpec, PlanError

Group = Tuple[str, List[str]]  # (what the flags are, the flags)

FLAT_SPEC = ["--spec", "megatron_flat.megatron.spec", "flat_gpt_layer_te_spec"]


def _model_args(model: ModelSpec, seq_len: int) -> List[str]:
    if model.attention_params is not None and model.mla is None:
        raise PlanError(f"--emit-launch: {model.name} has an attention shape given only as a "
                        "parameter count, whose Megatron-LM flags the planner cannot know; "
                        "take the layout and --flat-* flags from the plan")
    out = ["--num-layers", str(model.layers), "--hidden-size", str(model.hidden),
           "--num-attention-heads", str(model.heads)]
    if model.mla is not None:
        out += model.mla.megatron_flags()
    else:
        if model.kv_heads != model.heads:
            out += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
        if model.head_dim * model.heads != model.hidden:
            out += ["--kv-channels", str(model.head_dim)]
    out += ["--seq-length", str(seq_len), "--max-position-embeddings", str(seq_len),
            "--position-embedding-type", "rope", "--normalization", "RMSNorm"]
    if model.rotary_base != 10000:  # Megatron-LM's default
        out += ["--rotary-base", str(model.rotary_base)]
    if not model.linear_bias:  # Megatron-LM's linears have biases unless told otherwise
        out.append("--disable-bias-linear")
        if model.qkv_bias:
            out.append("--add-qkv-bias")
    if model.sinks:
        out += ["--softmax-type", "learnable"]
    if model.window:
        out += ["--window-size", f"{model.window},0"]
        if model.window_skip_freq:
            out += ["--window-attn-skip-freq", str(model.window_skip_freq)]
    if model.gated:
        out.append(f"--{model.glu}")
    if not model.tied_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if model.experts:
        out += ["--num-experts", str(model.experts), "--moe-router-topk", str(model.topk),
                "--moe-ffn-hidden-size", str(model.expert_ffn)]
        if model.shared_experts:
            out += ["--moe-shared-expert-intermediate-size",
                    str(model.shared_experts * model.shared_expert_ffn)]
        if model.moe_layers < model.layers:
            if model.moe_layer_step == 1:
                pattern = f"([0]*{model.dense_layers}+[1]*{model.layers - model.dense_layers})"
            else:  # interleaved: the list itself, as Megatron-LM evaluates it
                pattern = "[" + ",".join(str(int(model.is_moe_layer(i)))
                                         for i in range(model.layers)) + "]"
            out += ["--moe-layer-freq", pattern, "--ffn-hidden-size", str(model.dense_ffn)]
    elif model.dense_ffn:
        out += ["--ffn-hidden-size", str(model.dense_ffn)]
    if model.mtp_layers:
        out += ["--mtp-num-layers", str(model.mtp_layers)]
    return out + list(model.arch_flags)


def launch_groups(model: ModelSpec, layout: Layout, *, seq_len: int, global_batch: int,
                  flat: FlatConfig, flat_flags: str, train_iters: int = 100) -> List[Group]:
    """The ``pretrain_gpt.py`` arguments of the plan, in commented groups."""
    if model.dtype not in ("bf16", "fp16"):
        raise PlanError(f"--emit-launch: model dtype {model.dtype!r}: the planner's step "
                        "model assumes a bf16 or fp16 run")
    parallel = ["--tensor-model-parallel-size", str(layout.tp)]
    if layout.tp > 1 and layout.sp is not False:
        parallel.append("--sequence-parallel")
    parallel += ["--context-parallel-size", str(layout.cp),
                 "--pipeline-model-parallel-size", str(layout.pp)]
    if model.experts:
        parallel += ["--expert-model-parallel-size", str(layout.ep),
                     "--expert-tensor-parallel-size", "1"]
    batch = ["--micro-batch-size", str(layout.micro_batch_size),
             "--global-batch-size", str(global_batch)]
    precision = [f"--{model.dtype}"]
    if layout.grad_fp32:
        precision.append("--accumulate-allreduce-grads-in-fp32")
    if layout.distributed_optimizer:
        precision.append("--use-distributed-optimizer")
    if model.experts:
        precision += ["--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"]
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    placeholders = ["--mock-data", "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", str(model.vocab), "--train-iters", str(train_iters),
                    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
                    "--eval-iters", "0", "--eval-interval", "1000"]
    groups: List[Group] = [
        (f"model: {model.name}", _model_args(model, seq_len)),
        (f"parallel layout: TP {layout.tp} x CP {layout.cp} x PP {layout.pp} x DP "
         f"{layout.dp}" + (f", EP {layout.ep}" if model.experts else ""), parallel),
        ("batch", batch),
        ("precision and kernels the step-time model assumes", precision),
        ("full recompute of every layer (the planner's assumption)", recompute),
        ("data, tokenizer and schedule: placeholders, replace with yours", placeholders),
    ]
    flags = flat_flags.split()
    if flags:
        groups.append(("megatron-flat: the flat layer spec and the knobs fit chose",
                       FLAT_SPEC + flags))
    return groups


def torchrun_prefix(gpus: int, gpus_per_node: int) -> List[str]:
    nodes = max(1, -(-gpus // gpus_per_node))
    return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(min(gpus, gpus_per_node)),
            "--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR",
            "--master-port", "6000"]


def render(groups: List[Group], *, gpus: int, gpus_per_node: int,
           comment: Optional[str] = None) -> str:
    """A shell command: torchrun, ``pretrain_gpt.py``, one group per continued line."""
    prefix = " ".join(torchrun_prefix(gpus, gpus_per_node))
    lines = [] if comment is None else [f"# {comment}"]
    lines += [f"#   line {i + 1}: {what}" for i, (what, _) in enumerate(groups)]
    lines.append(prefix + " \\")
    lines.append("    pretrain_gpt.py \\")
    for i, (what, args) in enumerate(groups):
        tail = "" if i == len(groups) - 1 else " \\"
        lines.append(f"    {' '.join(shlex.quote(a) for a in args)}{tail}")
    return "\n".join(lines)


def launch_args(groups: List[Group]) -> List[str]:
    """The arguments of ``groups`` as one list (for tests and scripts)."""
    return [a for _, args in groups for a in args]
