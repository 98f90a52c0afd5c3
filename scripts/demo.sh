#!/usr/bin/env bash
# The main job (`make demo`): a small MoE GPT trained with Megatron-Core on CPU, 2 ranks,
# stock and with all four megatron-flat techniques on; prints both peak columns, then a
# context sweep (seq 256 -> 4096, stock vs flat, measured and planned) drawn to
# results/demo_sweep.png.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/bootstrap.sh | tail -n 1)"
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONWARNINGS="ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning"
exec "$VENV/bin/torchrun" --standalone --nproc-per-node 2 --log-dir "$(mktemp -d)" --redirects 3 --tee 3 \
  --local-ranks-filter 0 examples/train_tiny_moe.py --json results/demo.json \
  --sweep 256 512 1024 2048 4096 --sweep-plot results/demo_sweep.png "$@"
