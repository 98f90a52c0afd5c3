#!/usr/bin/env bash
# A small MoE (8 layers, hidden 1024, 8 experts, top-2, vocabulary 200,000) at 32K tokens per
# sequence on one GPU, with Megatron-LM's pretrain_gpt.py and all four megatron-flat techniques.
# At this size the vocabulary projection is the largest peak: 3 x 32,768 x 200,000 fp32 values
# of logits, log-softmax and gradient (~73 GiB) without Ring-DTP, a few strips with it.
#
# Once (megatron-flat importable from the Python that runs pretrain_gpt.py):
#   pip install -e /path/to/megatron-flat
#   python patches/apply.py "$MEGATRON_LM"    # pretrain_gpt.py: --flat-* flags + install()
# Then:
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/pretrain_gpt_flat_single_gpu.sh
# Without transformer-engine: TRANSFORMER_IMPL=local SEQ_LENGTH=8192 (Megatron-Core's local
# attention materialises the s x s scores; --no-rope-fusion is added, the fused RoPE kernel
# being transformer-engine's). Without NVIDIA apex: NO_APEX=1 adds --no-persist-layer-norm and
# --no-gradient-accumulation-fusion (both kernels are apex's). DRY_RUN=1 prints the command
# instead of running it.
#
# Check this flag set on a laptop first (no GPU, checkout patched or not): REHEARSE=1 runs
#   python -m megatron_flat rehearse --nproc-per-node 1 -- "$MEGATRON_LM/pretrain_gpt.py" ...
# with every flag below plus tiny-shape overrides (see TINY), stock and flat, and compares the
# losses; it ends with "rehearsal: flat losses equal stock over N iterations".
#   MEGATRON_LM=/path/to/Megatron-LM REHEARSE=1 bash examples/pretrain_gpt_flat_single_gpu.sh
set -euo pipefail

FLAT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (patched: python patches/apply.py \$MEGATRON_LM)}
SEQ_LENGTH=${SEQ_LENGTH:-32768}         # 32K tokens per sequence
TRAIN_ITERS=${TRAIN_ITERS:-20}
TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-transformer_engine}  # or local
if [[ "${REHEARSE:-0}" == 1 ]]; then
    TRANSFORMER_IMPL=local NO_APEX=1      # the rehearsal runs on CPU: neither is there
fi

# The --spec object for the chosen modules: both build Megatron's MoE layer spec with
# megatron-flat's FlatMoELayer once install() ran with --flat-dispatch on.
case "$TRANSFORMER_IMPL" in
    transformer_engine) SPEC=flat_gpt_layer_te_spec ;;
    local) SPEC=flat_gpt_layer_spec ;;
    *) echo "error: TRANSFORMER_IMPL must be transformer_engine or local" >&2; exit 1 ;;
esac

export CUDA_DEVICE_MAX_CONNECTIONS=1    # Megatron's expected launch ordering (one connection)

if [[ "${REHEARSE:-0}" != 1 ]] && ! "$PYTHON" "$FLAT_ROOT/patches/apply.py" "$MEGATRON_LM" --check >/dev/null; then
    echo "error: $MEGATRON_LM/pretrain_gpt.py does not take the --flat-* flags yet;" \
         "run: $PYTHON $FLAT_ROOT/patches/apply.py $MEGATRON_LM" >&2
    exit 1
fi

ARGS=(
    # Model: every layer MoE (the --spec layer spec repeats over all layers).
    --num-layers 8                        # transformer layers
    --hidden-size 1024                    # model width H
    --num-attention-heads 16              # 16 heads x 64
    --group-query-attention               # GQA
    --num-query-groups 4                  # 4 key/value heads
    --seq-length "$SEQ_LENGTH"            # tokens per sequence
    --max-position-embeddings "$SEQ_LENGTH"  # RoPE table covers the whole sequence
    --position-embedding-type rope        # rotary position embeddings
    --rotary-base 1000000                 # a RoPE base sized for a 32K window
    --normalization RMSNorm               # RMSNorm everywhere
    --swiglu                              # SwiGLU expert MLPs
    --disable-bias-linear                 # no biases in linear layers
    --untie-embeddings-and-output-weights # separate input embedding and output projection
    --attention-dropout 0.0               # no dropout
    --hidden-dropout 0.0                  # no dropout
    --transformer-impl "$TRANSFORMER_IMPL"  # transformer-engine (fused attention) or local modules
    --spec megatron_flat.megatron.spec "$SPEC"  # Megatron's MoE layer spec with FlatMoELayer
    # MoE: SequentialMLP experts (no --moe-grouped-gemm), as FlatMoELayer runs them.
    --num-experts 8                       # routed experts per layer
    --moe-router-topk 2                   # experts per token (k)
    --moe-ffn-hidden-size 1024            # each expert's FFN width
    --moe-router-load-balancing-type aux_loss  # load-balancing loss on the router
    --moe-aux-loss-coeff 1e-2             # its weight
    --moe-token-dispatcher-type alltoall  # Megatron's dispatcher (FlatMoELayer replaces its dispatch)
    # Parallelism: one GPU, so every size is 1 (EP 1: LLEP plans a single rank, the chunked
    # dispatch still caps the routes in flight).
    --tensor-model-parallel-size 1        # no TP
    --expert-model-parallel-size 1        # all 8 experts on this GPU
    --use-distributed-optimizer           # Megatron's distributed optimizer (DP 1: one shard)
    # Training.
    --micro-batch-size 1                  # one 32K-token sequence per micro-batch
    --global-batch-size 8                 # 8 micro-batches per step
    --train-iters "$TRAIN_ITERS"          # steps to run
    --bf16                                # bf16 weights and activations, fp32 master weights
    --optimizer adam                      # AdamW (what OffloadStreamAdamW implements)
    --lr 3e-4                             # peak learning rate
    --min-lr 3e-5                         # floor of the decay
    --lr-decay-style cosine               # cosine decay after warmup
    --lr-warmup-iters 2                   # linear warmup steps
    --weight-decay 0.1                    # decoupled weight decay
    --clip-grad 1.0                       # global gradient-norm clip
    --recompute-granularity full          # full recompute: one boundary per layer (needed by --flat-sco)
    --recompute-method uniform            # checkpoint every --recompute-num-layers layers
    --recompute-num-layers 1              # one layer per checkpoint
    # Data: synthetic tokens, no tokenizer files.
    --mock-data                           # synthetic tokens
    --tokenizer-type NullTokenizer        # token ids as they are
    --vocab-size 200000                   # vocabulary V
    --split 100,0,0                       # all mock data to training
    --log-interval 1                      # print loss and timings every step
    --eval-iters 0                        # no validation passes
    --eval-interval 1000000               # (and none scheduled)
    # megatron-flat: the paper's settings, two knobs sized for this run.
    --flat-preset paper                   # PipelinedLLEP, Ring-DTP, SCO, OffloadStreamAdamW all on
    --flat-dispatch-chunk-tokens 8192     # per-source token cap per chunk: 32K tokens -> K = 4 chunks
    --flat-sco-host-budget-gib 1          # 8 boundaries x 32,768 x 1024 x 2 B = 0.5 GiB of pinned host
)

if [[ "$TRANSFORMER_IMPL" == local ]]; then
    ARGS+=(--no-rope-fusion)              # the fused RoPE kernel comes with transformer-engine
fi
if [[ "${NO_APEX:-0}" == 1 ]]; then
    ARGS+=(--no-persist-layer-norm        # apex's persistent layer-norm kernel
           --no-gradient-accumulation-fusion)  # apex's fused weight-gradient accumulation
fi

CMD=(torchrun --standalone --nproc-per-node 1 "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}")

if [[ "${REHEARSE:-0}" == 1 ]]; then
    # The same flags at a tiny shape on one CPU rank; the overrides come last, so they win.
    # fp32 instead of --bf16 (a store-true flag, so it is left out rather than overridden).
    TINY=(
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
        --seq-length 64 --max-position-embeddings 64 --moe-ffn-hidden-size 64
        --micro-batch-size 1 --global-batch-size 2 --vocab-size 128 --no-masked-softmax-fusion
        --flat-dispatch-chunk-tokens 16
    )
    FULL=()
    for arg in "${ARGS[@]}"; do [[ "$arg" == --bf16 ]] || FULL+=("$arg"); done
    CMD=("$PYTHON" -m megatron_flat rehearse --nproc-per-node 1 -- "$MEGATRON_LM/pretrain_gpt.py"
         "${FULL[@]}" "${TINY[@]}")
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
