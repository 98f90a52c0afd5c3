"""A synthetic Megatron-LM checkout that really trains, for rehearsal tests.

Megatron-LM is not installable from the package index, so CI rehearses against this: a
``pretrain_gpt.py`` in either call shape (0.16-era: ``pretrain()`` parses; 0.19-era:
``parse_and_validate_args`` then ``pretrain(full_config, ...)``) and a small
``megatron.training`` package beside it (a namespace-package sibling of the installed
``megatron.core``). It is written for these tests, not copied: it trains the tiny MoE GPT of
``megatron_flat.testing`` with Megatron-Core's own DDP, optimizer and schedule, prints
Megatron-LM's ``iteration N/ M | ... | lm loss: X |`` lines, and has the obstacles a real
launch meets on CPU, so the rehearsal's workarounds are exercised:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` and builds the model-parallel
  groups only when ``torch.cuda.device_count() > 0``; it calls ``compile_helpers()``;
* the model is moved with ``model.cuda(torch.cuda.current_device())``;
* ``inprocess_restart.maybe_wrap_for_inprocess_restart`` parses first with the stock parser
  (``ignore_unknown_args=True``), which is what answers ``--help``.

The model follows the line's ``--moe-grouped-gemm`` (Megatron's local spec then builds the
grouped experts: 0.16's ``GroupedMLP``, or for a transformer-engine line ``TEGroupedMLP``
over the CPU grouped linears, as the rehearsal sets up); its experts are always SwiGLU
(``--swiglu`` is accepted) and biased only in a family that has biases (``--family
gpt_oss``).

Test knobs (kept by the stock run, acting only when a technique is installed):
``--perturb-flat-lr F`` multiplies the learning rate by ``1 + F``; ``--fail-when-flat``
raises after the first iteration. ``--fault`` injects one after the first iteration, in both
runs: ``kill-rank`` (rank 1 is killed), ``dead-writer`` (every rank waits for a checkpoint
writer process that died), ``lost-collective`` (rank 1 never reaches the next collective).
"""

import textwrap
from pathlib import Path

GLOBAL_VARS = '''\
_ARGS = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    return _ARGS
'''

INIT = '''\
"""Synthetic megatron.training (rehearsal tests)."""
from megatron.training.global_vars import get_args, set_args


def print_rank_0(message):
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)
'''

ARGUMENTS = '''\
import argparse

import torch

from megatron.training.global_vars import set_args


def _parser():
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py",
                                     description="Synthetic Megatron-LM arguments.")
    group = parser.add_argument_group("model and run")
    for flag, kind, default in (
        ("--num-layers", int, 2), ("--hidden-size", int, 64), ("--num-attention-heads", int, 4),
        ("--seq-length", int, 16), ("--micro-batch-size", int, 2),
        ("--global-batch-size", int, 8), ("--num-experts", int, 4),
        ("--moe-router-topk", int, 2), ("--expert-model-parallel-size", int, 1),
        ("--tensor-model-parallel-size", int, 1), ("--context-parallel-size", int, 1),
        ("--attention-dropout", float, 0.0), ("--hidden-dropout", float, 0.0),
        ("--train-iters", int, 100),
        ("--log-interval", int, 10), ("--lr", float, 1e-3), ("--seed", int, 1234),
        ("--vocab-size", int, 128), ("--distributed-backend", str, "nccl"),
        ("--recompute-granularity", str, None), ("--recompute-method", str, None),
        ("--recompute-num-layers", int, None), ("--tokenizer-type", str, None),
        ("--save", str, None), ("--load", str, None), ("--perturb-flat-lr", float, 0.0),
        ("--save-interval", int, None), ("--ckpt-step", int, None),
        ("--perturb-loaded-state", float, 0.0),
    ):
        group.add_argument(flag, type=kind, default=default, help=f"{flag[2:]} (100% synthetic)")
    group.add_argument("--spec", nargs=2, default=None, help="module and layer spec name")
    group.add_argument("--qk-layernorm", action="store_true")
    group.add_argument("--moe-layer-freq", default=1,
                       type=lambda v: eval(v) if "[" in v else int(v))  # as Megatron-LM's
    group.add_argument("--drop-qk-norm-when-flat", action="store_true")
    group.add_argument("--family", default=None,
                       help="a family of megatron_flat.testing.families (its architecture)")
    # GPU-only settings with Megatron-LM's defaults (transformer-engine modules, fused
    # kernels on); the synthetic training refuses each one still on, as a CPU run fails.
    group.add_argument("--transformer-impl", default="transformer_engine",
                       choices=["local", "transformer_engine"])
    for flag, dest in (("--no-rope-fusion", "apply_rope_fusion"),
                       ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
                       ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                       ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                       ("--no-bias-dropout-fusion", "bias_dropout_fusion")):
        group.add_argument(flag, action="store_false", dest=dest)
    group.add_argument("--no-persist-layer-norm", action="store_true")
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--moe-grouped-gemm", action="store_true")
    group.add_argument("--moe-permute-fusion", action="store_true")
    group.add_argument("--tp-comm-overlap", action="store_true")
    group.add_argument("--cuda-graph-impl", default="none",
                       choices=["none", "local", "transformer_engine"])
    group.add_argument("--cuda-graph-scope", nargs="+", default=[])
    group.add_argument("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"])
    group.add_argument("--mock-data", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--fail-when-flat", action="store_true")
    group.add_argument("--fault", default=None,
                       choices=["kill-rank", "dead-writer", "lost-collective"])
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = _parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args()[0]
    return parser.parse_args()


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False,
                            args_defaults={}):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    if args.moe_grouped_gemm:  # Megatron-LM's validate_args asks the device
        assert torch.cuda.get_device_capability()[0] >= 8, "GroupedGEMM needs sm_80"
    for name, value in args_defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    set_args(args)
    return args
'''

CHECKPOINTING = '''\
"""Megatron-LM's checkpoint calls, torch_dist format (Megatron-Core's dist_checkpointing):
the model's and the optimizer's sharded state dicts, iter_NNNNNNN directories and a tracker
file; ``--ckpt-step`` picks the iteration to load."""
import os

import torch

from megatron.training.global_vars import get_args

TRACKER = "latest_checkpointed_iteration.txt"


def _dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def _state(model, optimizer, is_loading):
    model_sd = model.module.sharded_state_dict()  # model: Megatron's DDP wrapper
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=metadata)}


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler=None, *args, **kwargs):
    from megatron.core import dist_checkpointing

    root = get_args().save
    path = _dir(root, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_state(model, optimizer, False), path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
        print(f"successfully saved checkpoint from iteration {iteration:7d} to {root}", flush=True)


def load_checkpoint(model, optimizer, opt_param_scheduler=None, *args, **kwargs):
    from megatron.core import dist_checkpointing

    config = get_args()
    iteration = config.ckpt_step
    if iteration is None:
        with open(os.path.join(config.load, TRACKER)) as f:
            iteration = int(f.read())
    loaded = dist_checkpointing.load(_state(model, optimizer, True), _dir(config.load, iteration))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    if config.perturb_loaded_state and _flat_on():  # test knob: a lossy crossing
        for inner in [w.optimizer for w in getattr(optimizer, "chained_optimizers", [optimizer])]:
            for st in inner.state.values():
                if st:
                    st["exp_avg"].mul_(1.0 + config.perturb_loaded_state)
    return iteration, 0


def _flat_on():
    from megatron_flat.megatron.state import installed

    flat = installed()
    return flat is not None and flat != type(flat)()
'''

INPROCESS_RESTART = '''\
from megatron.training import arguments


def maybe_wrap_for_inprocess_restart(pretrain):
    arguments.parse_args(ignore_unknown_args=True)  # the stock parser sees the line first
    return pretrain, None
'''

INITIALIZE = '''\
import torch

from megatron.training.global_vars import get_args


def initialize_megatron():
    assert torch.cuda.is_available(), "Megatron requires CUDA."
    args = get_args()
    torch.distributed.init_process_group(backend=args.distributed_backend)
    if torch.cuda.device_count() > 0:
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            context_parallel_size=args.context_parallel_size)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    _compile_dependencies()


def _compile_dependencies():
    if torch.distributed.get_rank() == 0:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
    torch.distributed.barrier()
'''

MODELS = '''\
import importlib

from megatron_flat.testing.tiny_gpt import TinyMoE, build_tiny_gpt, transformer_config


def tiny_of(args):
    return TinyMoE(num_layers=args.num_layers, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads,
                   ffn_hidden_size=2 * args.hidden_size, num_experts=args.num_experts,
                   topk=args.moe_router_topk, moe_ffn_hidden_size=args.hidden_size,
                   vocab_size=args.vocab_size, seq_length=args.seq_length,
                   micro_batch_size=args.micro_batch_size,
                   global_batch_size=args.global_batch_size, seed=args.seed, data="zipf",
                   attention_dropout=args.attention_dropout, grouped_gemm=args.moe_grouped_gemm)


GPU_ONLY = (
    ("transformer_impl", "transformer_engine", "transformer_engine is not installed"),
    ("apply_rope_fusion", True, "fused RoPE needs CUDA"),
    ("no_persist_layer_norm", False, "apex persistent layer norm needs CUDA"),
    ("gradient_accumulation_fusion", True, "fused_weight_gradient_mlp_cuda needs CUDA"),
    ("masked_softmax_fusion", True, "scaled_masked_softmax_cuda needs CUDA"),
    ("bias_dropout_fusion", True, "fused bias-dropout-add needs CUDA"),
    ("moe_permute_fusion", True, "transformer_engine permute needs CUDA"),
    ("tp_comm_overlap", True, "userbuffers need CUDA"),
    ("cuda_graph_impl", "local", "CUDA graphs need CUDA"),
)


def build_gpt(args, pre_process=True, post_process=True):
    for name, on, error in GPU_ONLY:
        if getattr(args, name) == on:
            raise RuntimeError(f"synthetic GPU-only setting {name}: {error}")
    if args.spec and args.spec[1].endswith("_te_spec"):
        raise RuntimeError("synthetic GPU-only layer spec: transformer_engine is not installed")
    if args.swiglu and args.bias_swiglu_fusion:
        raise RuntimeError("synthetic GPU-only setting bias_swiglu_fusion: needs CUDA")
    if args.fp8:
        raise RuntimeError("synthetic GPU-only setting fp8: needs transformer_engine")
    recompute = {}
    if args.recompute_granularity:
        recompute = dict(recompute=args.recompute_granularity,
                         recompute_method=args.recompute_method or "uniform",
                         recompute_num_layers=args.recompute_num_layers or 1)
    if args.family:
        return _build_family(args, recompute, pre_process, post_process)
    config = transformer_config(tiny_of(args), tp=args.tensor_model_parallel_size,
                                ep=args.expert_model_parallel_size,
                                context_parallel_size=args.context_parallel_size,
                                qk_layernorm=args.qk_layernorm,
                                moe_layer_freq=args.moe_layer_freq, **recompute)
    # As Megatron-LM's GPT builder: --spec is imported and used as it is; without it, its own
    # decoder block spec for the config (dense/MoE pattern, q/k norms).
    if args.spec:
        spec = getattr(importlib.import_module(args.spec[0]), args.spec[1])
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization="RMSNorm")
        if args.drop_qk_norm_when_flat and _flat_on():  # test knob: a flat spec gone wrong
            spec = _without_qk_norm(spec)
    return build_tiny_gpt(tiny_of(args), config, layer_spec=spec)


def _build_family(args, recompute, pre_process, post_process):
    """--family NAME: that family's shrunk architecture (dense/MoE pattern, attention kind,
    router, shared experts, MTP), built as Megatron-LM's GPT builder builds it."""
    from megatron_flat.testing.families import build_like_megatron_lm, family_args, family_config

    fields = {"moe_grouped_gemm": True} if args.moe_grouped_gemm else {}
    if recompute:
        fields.update(recompute_granularity=recompute["recompute"],
                      recompute_method=recompute["recompute_method"],
                      recompute_num_layers=recompute["recompute_num_layers"])
    config = family_config(args.family, num_layers=args.num_layers,
                           tp=args.tensor_model_parallel_size,
                           ep=args.expert_model_parallel_size,
                           context_parallel_size=args.context_parallel_size, **fields)
    return build_like_megatron_lm(family_args(config, spec=args.spec), config,
                                  vocab_size=args.vocab_size,
                                  max_sequence_length=args.seq_length,
                                  pre_process=pre_process, post_process=post_process)


def _without_qk_norm(block):
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp

    def layer(spec):
        attention = spec.submodules.self_attention
        inner = dataclasses.replace(attention.submodules, q_layernorm=IdentityOp,
                                    k_layernorm=IdentityOp)
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)))

    return dataclasses.replace(block, layer_specs=[layer(s) for s in block.layer_specs])


def _flat_on():
    from megatron_flat.megatron.state import installed

    flat = installed()
    return flat is not None and flat != type(flat)()
'''

TRAINING = '''\
import datetime
import multiprocessing
import os
import signal
import threading

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron


def _flat_on():
    from megatron_flat.megatron.state import installed

    flat = installed()
    return flat is not None and flat != type(flat)()


def _writer(results):
    # A stand-in for Megatron's async checkpoint writer dying at its first import.
    raise RuntimeError("synthetic checkpoint writer: psutil is not installed")


def _inject(fault):
    """Test faults, after iteration 1's log line, in both runs."""
    rank = torch.distributed.get_rank()
    if fault == "kill-rank" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "dead-writer":  # every rank waits for a writer process that died
        results = multiprocessing.get_context("fork").SimpleQueue()
        multiprocessing.get_context("fork").Process(target=_writer, args=(results,)).start()
        results.get()
    if fault == "lost-collective" and rank == 1:  # rank 0 waits in the next collective
        threading.Event().wait()


def pretrain(*positional, **kwargs):
    if "extra_args_provider" in kwargs:  # 0.16 shape: pretrain parses the arguments
        _datasets, model_provider, _model_type, forward_step_func = positional[:4]
        from megatron.training.arguments import parse_and_validate_args

        parse_and_validate_args(kwargs["extra_args_provider"],
                                args_defaults=kwargs.get("args_defaults") or {})
    else:  # 0.19 shape: pretrain(full_config, datasets, model_type, forward_step, ...)
        _config, _datasets, _model_type, forward_step_func = positional[:4]
        model_provider = kwargs.get("model_provider") or _model_provider
    initialize_megatron()
    _train(model_provider, forward_step_func)


def _model_provider(pre_process=True, post_process=True, vp_stage=None):
    from megatron.training.models import build_gpt

    return build_gpt(get_args(), pre_process, post_process)


def _train(model_provider, forward_step_func):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron.training.models import tiny_of
    from megatron_flat.testing.tiny_gpt import cp_share, dp_share, global_batch
    from megatron_flat.testing.training import step_loss

    args = get_args()
    model = model_provider(pre_process=True, post_process=True)
    model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer),
        module=model)
    lr = args.lr * (1.0 + args.perturb_flat_lr if _flat_on() else 1.0)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                        params_dtype=torch.float32,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        [ddp])
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    tiny = tiny_of(args)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    first = 1
    if args.load:
        first = load_checkpoint(ddp, optimizer, None)[0] + 1
    for iteration in range(first, args.train_iters + 1):
        mine = [cp_share(mb, cp_rank, cp_size)
                for mb in dp_share(global_batch(tiny, iteration), dp_rank, dp_size)]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward = get_forward_backward_func()
        losses = forward_backward(
            forward_step_func=forward_step_func, data_iterator=iter(mine), model=[ddp],
            num_microbatches=len(mine), seq_length=tiny.seq_length,
            micro_batch_size=tiny.micro_batch_size, forward_only=False)
        ok, _, _ = optimizer.step()
        loss = step_loss(losses)
        if iteration % args.log_interval == 0 and torch.distributed.get_rank() == 0:
            print(f" [{datetime.datetime.now()}] iteration {iteration:8d}/{args.train_iters:8d} |"
                  f" consumed samples: {iteration * args.global_batch_size:12d} |"
                  f" lm loss: {loss:.6E} | loss scale: 1.0 |", flush=True)
        if args.save and (iteration == args.train_iters or (
                args.save_interval and iteration % args.save_interval == 0)):
            save_checkpoint(iteration, ddp, optimizer, None)
        if args.fail_when_flat and _flat_on():
            raise RuntimeError("synthetic failure in the flat run")
        if args.fault:
            _inject(args.fault)
'''

_COMMON = '''\
"""Synthetic pretrain_gpt.py ({era} call shape) for rehearsal tests."""

from functools import partial

from megatron.training import get_args, print_rank_0
from megatron.training.inprocess_restart import maybe_wrap_for_inprocess_restart
from megatron.training.training import pretrain
from megatron_flat.testing.training import forward_step

try:
    from megatron.post_training.arguments import add_modelopt_args

    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False


def gpt_builder(args, pre_process, post_process, vp_stage=None):
    from megatron.training.models import build_gpt

    return build_gpt(args, pre_process, post_process)


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None):
    return model_builder(get_args(), pre_process, post_process, vp_stage)


def datasets_provider(num_samples):
    return None, None, None
'''

# The ``__main__`` blocks of both call shapes, shared with the patcher tests' scripts
# (conftest.py): the lines the patcher anchors on.
MAIN_016 = '''

if __name__ == "__main__":
    # Wrapping keeps the name; this line passes pretrain, it does not call it.
    pretrain, store = maybe_wrap_for_inprocess_restart(pretrain)

    pretrain(
        datasets_provider,
        partial(model_provider, gpt_builder),
        "encoder_or_decoder",
        forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        store=store,
    )
'''

MAIN_019 = '''

if __name__ == "__main__":
    pretrain, store = maybe_wrap_for_inprocess_restart(pretrain)

    args = parse_and_validate_args(
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    full_config = {"num_layers": args.num_layers}
    pretrain(
        full_config,
        datasets_provider,
        "encoder_or_decoder",
        forward_step,
        store=store,
    )
'''

SCRIPT_016 = _COMMON.format(era="0.16-era") + MAIN_016

SCRIPT_019 = (_COMMON.format(era="0.19-era")
              + "\nfrom megatron.training.arguments import parse_and_validate_args\n" + MAIN_019)

SCRIPTS = {"0.16": SCRIPT_016, "0.19": SCRIPT_019}


def write_checkout(root: Path, era: str) -> Path:
    """A synthetic checkout of ``era`` ("0.16" or "0.19") under ``root``; returns its
    ``pretrain_gpt.py`` (unpatched)."""
    training = root / "megatron" / "training"
    training.mkdir(parents=True)
    files = {"global_vars.py": GLOBAL_VARS, "__init__.py": INIT, "arguments.py": ARGUMENTS,
             "inprocess_restart.py": INPROCESS_RESTART, "initialize.py": INITIALIZE,
             "models.py": MODELS, "training.py": TRAINING, "checkpointing.py": CHECKPOINTING}
    for name, text in files.items():
        (training / name).write_text(textwrap.dedent(text))
    script = root / "pretrain_gpt.py"
    script.write_text(SCRIPTS[era])
    return script


# A tiny launch line: EP 2 over 2 ranks, full recompute, the flat layer spec.
LINE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--num-experts", "4", "--moe-router-topk", "2", "--vocab-size", "128",
        "--expert-model-parallel-size", "2", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--use-distributed-optimizer", "--mock-data", "--lr", "1e-2",
        "--distributed-backend", "nccl", "--log-interval", "10", "--save", "/nonexistent/ckpt",
        "--spec", "megatron_flat.megatron.spec", "flat_gpt_layer_spec",
        # the CPU flags a line written for the CPU carries (the production line below not)
        "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion"]
# LINE as a GPU job script writes it: transformer-engine and fused kernels by default, the
# transformer-engine layer spec, grouped GEMM, bf16, CUDA graphs and userbuffer overlap.
PRODUCTION = (LINE[:LINE.index("--transformer-impl")]
              + ["--swiglu", "--bf16", "--moe-grouped-gemm", "--cuda-graph-impl", "local",
                 "--cuda-graph-scope", "attn", "moe", "--tp-comm-overlap"])
PRODUCTION[PRODUCTION.index("flat_gpt_layer_spec")] = "flat_gpt_layer_te_spec"
FLAT = ["--flat-preset", "paper", "--flat-dispatch-chunk-tokens", "4",
        "--flat-optimizer-bucket-numel", "4096"]
