#!/usr/bin/env bash
# Pretrain the paper's largest MoE (39 layers, hidden 7168, 384 experts, top-8, expert FFN 2048,
# vocabulary 200,000: 667B parameters) at 1M tokens per sequence with Megatron-LM's
# pretrain_gpt.py and all four megatron-flat techniques, on NNODES nodes of 8 GPUs
# (8 x 8 H200 by default: TP 8 x CP 8, EP 64).
#
# Once, on every node (megatron-flat importable from the Python that runs pretrain_gpt.py):
#   pip install -e /path/to/megatron-flat
#   python patches/apply.py "$MEGATRON_LM"    # pretrain_gpt.py: --flat-* flags + install()
# Then on node i = 0 .. NNODES-1:
#   MEGATRON_LM=/path/to/Megatron-LM NNODES=8 NODE_RANK=i MASTER_ADDR=<node 0> \
#       bash examples/pretrain_gpt_flat.sh
# DRY_RUN=1 prints the command instead of running it.
#
# Check this flag set on a laptop first (no GPU, checkout patched or not): REHEARSE=1 runs
#   python -m megatron_flat rehearse --nproc-per-node 2 -- "$MEGATRON_LM/pretrain_gpt.py" ...
# with every flag below plus tiny-shape overrides (see TINY), stock and flat, and compares the
# losses; it ends with "rehearsal: flat losses equal stock over N iterations".
#   MEGATRON_LM=/path/to/Megatron-LM REHEARSE=1 bash examples/pretrain_gpt_flat.sh
#
# Will it fit? The peak planner answers before launch (per-GPU peaks with and without flat):
#   python -m megatron_flat plan --model paper-667b --seq 1M --gpus 64 --gpu-mem 141GiB \
#       --host-mem 2TiB --tp 8 --cp 8 --ep 64 --pp 1 --all-on
set -euo pipefail

FLAT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (patched: python patches/apply.py \$MEGATRON_LM)}

# Launch geometry (torchrun): one process per GPU.
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

# Model and run size; the parallel split below assumes 64 GPUs (TP 8 x CP 8 x DP 1, EP 64).
NUM_LAYERS=${NUM_LAYERS:-39}            # 39: paper-667b; 14: paper-241b; 7: paper-120b
SEQ_LENGTH=${SEQ_LENGTH:-1048576}       # 1M tokens per sequence
TRAIN_ITERS=${TRAIN_ITERS:-100}

# Megatron serialises kernel launches per stream with one connection: needed for the
# sequence-parallel / tensor-parallel communication overlap order.
export CUDA_DEVICE_MAX_CONNECTIONS=1

if [[ "${REHEARSE:-0}" != 1 ]] && ! "$PYTHON" "$FLAT_ROOT/patches/apply.py" "$MEGATRON_LM" --check >/dev/null; then
    echo "error: $MEGATRON_LM/pretrain_gpt.py does not take the --flat-* flags yet;" \
         "run: $PYTHON $FLAT_ROOT/patches/apply.py $MEGATRON_LM" >&2
    exit 1
fi

LAUNCH=(
    torchrun
    --nnodes "$NNODES"                    # nodes in the job
    --node-rank "$NODE_RANK"              # this node's index, 0 on the master node
    --nproc-per-node "$GPUS_PER_NODE"     # one rank per GPU
    --master-addr "$MASTER_ADDR"          # rendezvous host (node 0)
    --master-port "$MASTER_PORT"          # rendezvous port
)

MODEL=(
    --num-layers "$NUM_LAYERS"            # transformer layers, every one MoE (see --spec)
    --hidden-size 7168                    # model width H
    --num-attention-heads 56              # 56 heads x 128 = 7168 (the planner's assumption)
    --kv-channels 128                     # head dimension
    --group-query-attention               # GQA: fewer key/value heads than query heads
    --num-query-groups 8                  # 8 key/value heads: one per TP rank at TP 8
    --seq-length "$SEQ_LENGTH"            # tokens per sequence
    --max-position-embeddings "$SEQ_LENGTH"  # RoPE table covers the whole sequence
    --position-embedding-type rope        # rotary position embeddings
    --rotary-base 10000000                # a RoPE base sized for a 1M-token window
    --normalization RMSNorm               # RMSNorm everywhere
    --swiglu                              # SwiGLU expert MLPs (gated linear unit + SiLU)
    --disable-bias-linear                 # no biases in linear layers
    --untie-embeddings-and-output-weights # separate input embedding and output projection
    --attention-dropout 0.0               # no dropout: pretraining at scale
    --hidden-dropout 0.0                  # no dropout: pretraining at scale
    --init-method-std 0.008               # weight init std for a 7168-wide model
    --transformer-impl transformer_engine # TE modules: fused attention with context parallelism
    # The layer spec: Megatron's transformer-engine MoE layer whose MoE block is megatron-flat's
    # FlatMoELayer (PipelinedLLEP) once install() ran with --flat-dispatch on; it repeats one
    # layer spec over every layer (for mixed dense/MoE models leave --spec out: install() puts
    # FlatMoELayer into Megatron's own block spec).
    --spec megatron_flat.megatron.spec flat_gpt_layer_te_spec
)

MOE=(
    --num-experts 384                     # routed experts per MoE layer
    --moe-router-topk 8                   # experts per token (k)
    --moe-ffn-hidden-size 2048            # each expert's FFN width
    --moe-router-load-balancing-type aux_loss  # load-balancing loss on the router
    --moe-aux-loss-coeff 1e-3             # its weight
    --moe-token-dispatcher-type alltoall  # Megatron's dispatcher (FlatMoELayer replaces its dispatch)
    # FlatMoELayer runs SequentialMLP experts with no expert tensor parallelism:
    # no --moe-grouped-gemm, and --expert-tensor-parallel-size 1.
)

PARALLEL=(
    --tensor-model-parallel-size 8        # TP 8 inside a node (NVLink)
    --sequence-parallel                   # SP: activations outside attention/MLP split over TP
    --context-parallel-size 8             # CP 8: 1M tokens -> 131,072 per CP rank (16,384 per TP rank with SP)
    --cp-comm-type p2p                    # ring attention (a2a would need heads/TP divisible by CP)
    --pipeline-model-parallel-size 1      # no pipeline: the whole depth on every rank
    --expert-model-parallel-size 64       # EP 64: 6 experts per GPU, across all 64 GPUs
    --expert-tensor-parallel-size 1       # experts are not TP-split (FlatMoELayer needs 1)
    --use-distributed-optimizer           # shard optimizer state over data-parallel ranks
)

TRAINING=(
    --micro-batch-size 1                  # one 1M-token sequence per micro-batch
    --global-batch-size 8                 # 8 sequences (8M tokens) per step; DP 1 -> 8 micro-batches
    --train-iters "$TRAIN_ITERS"          # steps to run
    --bf16                                # bf16 weights and activations, fp32 master weights
    --optimizer adam                      # AdamW (OffloadStreamAdamW implements Adam only)
    --lr 3e-4                             # peak learning rate
    --min-lr 3e-5                         # floor of the decay
    --lr-decay-style cosine               # cosine decay after warmup
    --lr-warmup-iters 10                  # linear warmup steps
    --weight-decay 0.1                    # decoupled weight decay (AdamW)
    --adam-beta1 0.9                      # Adam first-moment decay
    --adam-beta2 0.95                     # Adam second-moment decay
    --clip-grad 1.0                       # global gradient-norm clip
    # Full recompute: each layer's input is the only activation kept from forward to backward;
    # --flat-sco offloads exactly these boundaries (install() refuses SCO without it).
    --recompute-granularity full          # recompute whole layers in backward
    --recompute-method uniform            # checkpoint every group of --recompute-num-layers layers
    --recompute-num-layers 1              # one layer per checkpoint: one boundary per layer
)

DATA=(
    --mock-data                           # synthetic tokens: no dataset needed
    --tokenizer-type NullTokenizer        # token ids as they are; no tokenizer files
    --vocab-size 200000                   # vocabulary V (Megatron pads it to a multiple of 128 x TP)
    --split 100,0,0                       # all mock data to training
)

LOGGING=(
    --log-interval 1                      # print loss and timings every step
    --eval-iters 0                        # no validation passes
    --eval-interval 1000000               # (and none scheduled)
)

# megatron-flat: --flat-preset paper turns all four techniques on with the paper's settings;
# every flag below restates or overrides one of them (a flag left at its default keeps the
# preset's value). Table of all flags: docs/flags.md.
FLAT=(
    --flat-preset paper                   # start from the paper's settings
    # PipelinedLLEP: the expert-dispatch peak.
    --flat-dispatch pipelined             # least-loaded EP plan + chunked dispatch
    --flat-dispatch-chunk-tokens 4096     # per-source token cap per chunk (c): 16,384 tokens -> K = 4 chunks
    --flat-dispatch-max-chunks 10         # at most K_max chunks per layer per step
    --flat-dispatch-membership strided    # token t goes to chunk t mod K
    --flat-llep-alpha 1.0                 # capacity cap = alpha x mean load per EP rank
    --flat-llep-min-tokens-per-gemm 1024  # no spill pieces smaller than m tokens
    --flat-llep-imbalance-threshold 1.3   # plain EP when max/mean load is below lambda
    # Ring-DTP: the vocabulary-projection peak.
    --flat-vocab                          # output projection + loss over the TP ring, fp32 online LSE
    --flat-vocab-mode auto                # move weights or activations around the ring, whichever is cheaper
    --flat-vocab-block-size 8192          # strip width when the ring has one rank (unused at TP 8)
    # SCO: the checkpoint-boundary peak.
    --flat-sco                            # boundaries to pinned host memory, prefetched back in backward
    --flat-sco-host-budget-gib 16         # per GPU: 39 boundaries x 16,384 tokens x 7168 x 2 B = 8.5 GiB fit
    --flat-sco-prefetch 1                 # restore one boundary ahead of the recompute
    # OffloadStreamAdamW: the optimizer-state peak.
    --flat-optimizer-offload              # fp32 master weights + moments live in pinned host memory
    --flat-optimizer-bucket-numel 100000000  # parameters per bucket streamed through the GPU
    --flat-optimizer-num-slots 2          # device staging slots: transfers overlap the update
)

CMD=("${LAUNCH[@]}" "$MEGATRON_LM/pretrain_gpt.py"
     "${MODEL[@]}" "${MOE[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${LOGGING[@]}"
     "${FLAT[@]}")

if [[ "${REHEARSE:-0}" == 1 ]]; then
    # The same flags at a tiny shape on 2 CPU ranks; the overrides come last, so they win.
    # Megatron-Core's local modules stand in for transformer-engine (no CP, no fused kernels);
    # fp32 instead of --bf16 (a store-true flag, so it is left out rather than overridden).
    TINY=(
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16
        --num-query-groups 2 --seq-length 64 --max-position-embeddings 64
        --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64
        --tensor-model-parallel-size 1 --context-parallel-size 1 --expert-model-parallel-size 2
        --micro-batch-size 1 --global-batch-size 4 --vocab-size 128 --lr-warmup-iters 1
        --transformer-impl local --spec megatron_flat.megatron.spec flat_gpt_layer_spec
        --no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion
        --no-masked-softmax-fusion
        --flat-dispatch-chunk-tokens 16 --flat-optimizer-bucket-numel 65536
    )
    FULL=()
    for arg in "${CMD[@]:${#LAUNCH[@]}}"; do [[ "$arg" == --bf16 ]] || FULL+=("$arg"); done
    CMD=("$PYTHON" -m megatron_flat rehearse --nproc-per-node 2 -- "${FULL[@]}" "${TINY[@]}")
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
