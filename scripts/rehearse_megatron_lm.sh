#!/usr/bin/env bash
# Check megatron-flat against real Megatron-LM releases: for each git ref of a Megatron-LM
# clone, export a fresh tree, then patch / check / rehearse / revert and print one table row.
#
#   scripts/rehearse_megatron_lm.sh /path/to/Megatron-LM.git core_v0.16.1 core_v0.19.0 main
#
# PYTHON (default: python) must have torch, megatron-flat and Megatron-LM's training
# dependencies (six, regex, pyyaml, einops, pydantic, pybind11, triton; see docs/megatron.md). The
# trees go to WORK (default: a temporary directory); nothing is written to the clone.
# Rehearsal: 2 ranks, EP 2, 2 MoE layers with the flat layer spec, full recompute, the
# distributed optimizer, mock data, --flat-preset paper; flat losses must equal stock.
# CP=2 (default: unset) adds --context-parallel-size 2: CP 2 x EP 2 on the same 2 ranks (DP 1),
# the CPU backend's ContextParallelCoreAttention in both runs (the rehearsal sets
# --attention-dropout 0 for it: it has no attention dropout).
# PRODUCTION=1 rehearses the line as a GPU job script has it instead: no CPU flags (the
# rehearsal substitutes transformer-engine, the fused kernels and the TE layer spec itself),
# --moe-grouped-gemm --bf16, the transformer-engine layer spec and --save/--load paths.
# DISTOPT=0 leaves --use-distributed-optimizer out (Megatron's Float16/FP32 optimizer).
# RESUME_AT=I (default: unset) adds --resume-at I: both runs save at iteration I into the
# rehearsal's work directory, a flat run resumes from stock's checkpoint and a stock run from
# flat's; the verdict then ends "checkpoints cross both ways at iteration I".
set -uo pipefail

REPO=${1:?usage: $0 MEGATRON_LM_GIT_DIR REF...}
shift
PYTHON=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d)}
LINE=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128
    --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2
    --moe-token-dispatcher-type alltoall --use-distributed-optimizer
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --transformer-impl local --no-rope-fusion --no-persist-layer-norm
    --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    --eval-iters 0 --eval-interval 1000
    --spec megatron_flat.megatron.spec flat_gpt_layer_spec
    --flat-preset paper
)
if [[ -n "${PRODUCTION:-}" ]]; then
    CPU_FLAGS=" --transformer-impl local --no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
    KEPT=()
    for flag in "${LINE[@]}"; do
        [[ "$CPU_FLAGS" == *" $flag "* ]] || KEPT+=("$flag")
    done
    LINE=("${KEPT[@]/flat_gpt_layer_spec/flat_gpt_layer_te_spec}"
          --moe-grouped-gemm --bf16 --save "$WORK/user-ckpt" --load "$WORK/user-ckpt")
fi
if [[ "${DISTOPT:-1}" == 0 ]]; then  # DISTOPT=0: Megatron's non-distributed optimizer
    KEPT=()
    for flag in "${LINE[@]}"; do
        [[ "$flag" == --use-distributed-optimizer ]] || KEPT+=("$flag")
    done
    LINE=("${KEPT[@]}")
fi
if [[ -n "${CP:-}" ]]; then
    LINE+=(--context-parallel-size "$CP")
fi

echo "| Megatron-LM | commit | megatron-core | apply | check | rehearse | revert (byte-identical) |"
echo "|---|---|---|---|---|---|---|"
for ref in "$@"; do
    tree="$WORK/$ref"
    rm -rf "$tree" && mkdir -p "$tree"
    commit=$(git -C "$REPO" rev-parse --short=10 "$ref^{commit}") || { echo "| $ref | not found |"; continue; }
    git -C "$REPO" archive "$ref" | tar -x -C "$tree"
    cp "$tree/pretrain_gpt.py" "$WORK/$ref.orig"
    core=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) = \(.*\)/\2/p' "$tree/megatron/core/package_info.py" | paste -sd.)
    "$PYTHON" -m megatron_flat patch "$tree" > "$WORK/$ref.apply.log" 2>&1 && apply=ok || apply=FAIL
    "$PYTHON" -m megatron_flat patch "$tree" --check > /dev/null 2>&1 && check=ok || check=FAIL
    (cd "$tree" && "$PYTHON" -m megatron_flat rehearse --nproc-per-node 2 \
        ${RESUME_AT:+--resume-at "$RESUME_AT"} \
        --work-dir "$WORK/$ref.rehearsal" -- pretrain_gpt.py "${LINE[@]}") > "$WORK/$ref.rehearse.log" 2>&1
    verdict=$(tail -n 1 "$WORK/$ref.rehearse.log")
    "$PYTHON" -m megatron_flat patch "$tree" --revert > /dev/null 2>&1 \
        && cmp -s "$tree/pretrain_gpt.py" "$WORK/$ref.orig" && revert=ok || revert=FAIL
    echo "| $ref | $commit | $core | $apply | $check | ${verdict#rehearsal: } | $revert |"
done
echo "(logs: $WORK)" >&2
