#!/usr/bin/env bash
# The main job (`make demo`): a small MoE GPT trained with Megatron-Core on CPU, 2 ranks,
# stock and with all four megatron-flat techniques on; prints both peak columns, then a
# context sweep (seq 256 -> 2048, stock vs flat, measured and planned) drawn to
# results/demo_sweep.png. `make demo ARGS=--full-sweep` sweeps to 4096 (docs/demo_sweep.png;
# about a minute more on 2 cores): the default keeps a fresh clone's demo, set-up included,
# under 3 minutes there. Other ARGS go to examples/train_tiny_moe.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/bootstrap.sh | tail -n 1)"
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONWARNINGS="ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning"
SWEEP=(256 512 1024 2048)
if [ "${1:-}" = "--full-sweep" ]; then SWEEP+=(4096); shift; fi
exec "$VENV/bin/torchrun" --standalone --nproc-per-node 2 --log-dir "$(mktemp -d)" --redirects 3 --tee 3 \
  --local-ranks-filter 0 examples/train_tiny_moe.py --json results/demo.json \
  --sweep "${SWEEP[@]}" --sweep-plot results/demo_sweep.png "$@"
