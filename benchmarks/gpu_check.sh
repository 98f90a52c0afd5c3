#!/usr/bin/env bash
# GPU checks for the foundation, in one short run on one GPU (a few minutes):
#   benchmarks/gpu_check.sh OUTDIR
# 1. the runtime and optimizer tests, including the CUDA-only ones (meter on CUDA peak
#    stats, real streams/events, pinned host pool, OffloadStreamAdamW on streams);
# 2. benchmarks/gpu_meter_check.py: MemoryMeter on CUDA against known allocations, and the
#    tiny MoE GPT forward/backward on one GPU (when megatron-core is importable there; the
#    GPU image has torch/triton/pytest but not megatron-core: put its wheels in .whl/).
# 3. benchmarks/optimizer.py at ~1B parameters (step time vs serial CPU AdamW and vs the
#    host<->device transfer floor).
# Results land in OUTDIR (junit XML, JSON, log). Uses the machine's python3 with CUDA torch.
set -uo pipefail
OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/device.txt" || exit 1
if ! "$PY" -c "import megatron.core" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --no-deps --no-index .whl/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCHDYNAMO_DISABLE=1
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/runtime tests/optim tests/checkpoint --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/log.txt" || status=1
"$PY" benchmarks/gpu_meter_check.py --json "$OUT/meter-cuda.json" 2>&1 | tee -a "$OUT/log.txt" || status=1
# SCO with real copy streams (64 MiB boundaries: a reload that skips its wait would show).
"$PY" benchmarks/checkpoint.py --device cuda --json "$OUT/checkpoint-cuda.json" 2>&1 | tee -a "$OUT/log.txt" || status=1
# OffloadStreamAdamW at ~1B params: real pinned memory and streams, vs the transfer floor.
"$PY" benchmarks/optimizer.py --hidden 4096 --layers 5 --json "$OUT/optimizer-cuda.json" 2>&1 | tee -a "$OUT/log.txt" || status=1
exit $status
