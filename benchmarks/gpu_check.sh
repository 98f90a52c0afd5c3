#!/usr/bin/env bash
# Everything GPU-only, on one GPU, in three parts of at most 8 minutes each (the sum of their
# stages' limits), so that a GPU lent for a few minutes at a time runs it in turns:
#   benchmarks/gpu_check.sh --part 1 OUTDIR   # then --part 2, --part 3, into the same OUTDIR
#   benchmarks/gpu_check.sh --stages ledger,sco OUTDIR  # named stages only
#   benchmarks/gpu_check.sh OUTDIR            # every stage (about 21 minutes of limits)
#   benchmarks/gpu_check.sh --dry-run [--part N] OUTDIR  # anywhere: argument handling, the
#                                             # plan of stages, the ledger stage at a tiny shape
# Part 1 holds the stages the first GPU run failed or that every figure rests on (calibrate, ledger,
# dispatch-syncs, tests, meter, tier); part 2 races, sco, optim, vocab, replay-te; part 3
# mutants, param-offload, replay, replay-time.
# Each stage is bounded by `timeout` and writes into OUTDIR; a failed stage does not stop the
# others, the exit status says whether all that ran passed. Runs into one OUTDIR add up:
# stages.tsv keeps each stage's latest result, and the summary covers every stage run so far.
# Stages:
#  1. tests   the CUDA-only tests (-m cuda) and the runtime/optim/checkpoint suites on CUDA
#             (meter peak stats, real streams/events, pinned pool, SCO copy races,
#             OffloadStreamAdamW on streams, the ledger against set_sync_debug_mode)
#  1b. races  the optim and checkpoint suites again with a sleep kernel before every
#             side-stream copy (FLAT_CUDA_COPY_SLEEP_CYCLES): late copies, missing waits fail
#  1c. mutants scripts/mutants.py --gpu: the mutants only a GPU can kill (a producer stream
#             not waited, a record_stream dropped, ...) must fail their CUDA selections, under
#             late copies or, for a missing wait for the compute stream, late producers
#             (FLAT_CUDA_PRODUCER_SLEEP_CYCLES: the sleep on the compute stream instead)
#  1d. tier   benchmarks/gpu_host_tier.py: the host tier pins exactly the bytes asked for
#             (cudaHostRegister) where torch's caching host allocator rounds up
#  2. meter   benchmarks/gpu_meter_check.py: MemoryMeter on CUDA against known allocations
#  2b. calibrate  benchmarks/gpu_calibrate.py: the step-time model's device constants by
#             microbenchmark (launch, sync, kernel floor, pinned copies, GEMMs at the units'
#             shapes, HBM, 16/32-bit atomics), used by the ledger stage's predictions
#  3. ledger  benchmarks/gpu_ledger.py: per technique, the ledger's counts with the CUDA
#             sync-debug count beside them, measured time, the step-time model's predicted
#             time, and a torch.profiler summary of how much copy time ran under compute
#  4. sco     benchmarks/checkpoint.py on CUDA, real copy streams, at two shapes: 64 MiB
#             boundaries ([32768, 1, 1024] bf16; layers of milliseconds, where the target of
#             1.10x plain's step is judged) and the default 512 KiB ones (layers of a few
#             microseconds: host-bound, SCO's host calls per boundary show; the model's
#             predicted ratio is printed beside the measured one)
#  5. optim   benchmarks/optimizer.py at ~1B parameters (step time vs the transfer floor,
#             against Megatron's own --optimizer-cpu-offload HybridDeviceOptimizer)
#  5b. dispatch-syncs  benchmarks/dispatch_scale.py on CUDA: one rank of EP 64 (the stand-in
#             group), 384 experts, top-8, K 10: the forward's host syncs counted by the ledger
#             beside set_sync_debug_mode's warnings, the steady-state backward under
#             set_sync_debug_mode("error") (one sync fails the stage), host planning time
#  5c. param-offload  benchmarks/model_state.py on CUDA: device model state flat in depth with
#             param offload, bitwise against the resident stack, step time against the knob
#             off and the copies' bytes over it (tests/params also runs in 1 and 1b)
#  6. vocab   benchmarks/vocab.py at P = 1 on CUDA (dense vs Ring-DTP blocked)
#  6b. replay, replay-time  attention replay on the CUDA flash kernel (deterministic mode):
#             tests/attention/test_replay_cuda.py (kept O equals a second kernel run,
#             gradients bitwise on the device and through a pinned pool), then
#             benchmarks/gpu_attention_replay.py (8 layers x 16K tokens: step time stock vs
#             replay, measured saving against the FLOP-predicted one)
#  6c. replay-te  attention replay in transformer-engine's fused attention (needs TE):
#             tests/megatron/test_te_replay_cuda.py (bitwise stock under Megatron's checkpoint,
#             device and pinned host tiers, attention dropout 0 and 0.1)
#  7. summary OUTDIR/summary.txt and summary.json: stage results, predicted vs measured
# megatron-core is optional on the GPU image; wheels in .whl/ are installed when present.
# Uses the machine's python3 (CUDA torch), or $PYTHON.
set -uo pipefail
ALL_STAGES=(tests races mutants tier meter calibrate ledger sco optim dispatch-syncs param-offload
            vocab replay replay-time replay-te)
PART_1=(calibrate ledger dispatch-syncs tests meter tier)
PART_2=(races sco optim vocab replay-te)
PART_3=(mutants param-offload replay replay-time)
usage() {
  echo "usage: benchmarks/gpu_check.sh [--dry-run] [--part 1|2|3 | --stages NAME,...] OUTDIR" >&2
  echo "stages: ${ALL_STAGES[*]}" >&2
  exit 2
}
DRY=0
SELECTED=("${ALL_STAGES[@]}")
while [ $# -gt 1 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --part)
      case "${2:-}" in
        1) SELECTED=("${PART_1[@]}") ;; 2) SELECTED=("${PART_2[@]}") ;;
        3) SELECTED=("${PART_3[@]}") ;; *) echo "--part: 1, 2 or 3" >&2; usage ;;
      esac
      shift 2 ;;
    --stages)
      IFS=, read -r -a SELECTED <<< "${2:-}"
      for name in "${SELECTED[@]}"; do
        [[ " ${ALL_STAGES[*]} " == *" $name "* ]] || { echo "unknown stage: $name" >&2; usage; }
      done
      [ ${#SELECTED[@]} -gt 0 ] || usage
      shift 2 ;;
    *) usage ;;
  esac
done
if [ $# -ne 1 ] || [ -z "${1:-}" ] || [ "${1#-}" != "$1" ]; then usage; fi
OUT="$1"
cd "$(dirname "$0")/.."
mkdir -p "$OUT" || { echo "cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCHDYNAMO_DISABLE=1
touch "$OUT/stages.tsv"
# the stages run now replace their earlier results; the others' stay (an earlier part's)
for name in "${SELECTED[@]}"; do
  awk -F'\t' -v n="$name" '$1 != n' "$OUT/stages.tsv" > "$OUT/stages.tmp" \
    && mv "$OUT/stages.tmp" "$OUT/stages.tsv"
done
status=0

selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

run_stage() {  # run_stage NAME SECONDS CMD...: bounded, logged, recorded in stages.tsv
  local name="$1" limit="$2"; shift 2
  selected "$name" || return 0
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/log.txt"
  if [ $DRY -eq 1 ] && [ "$name" != "ledger" ]; then
    printf '%s\tplanned\t0\n' "$name" >> "$OUT/stages.tsv"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/stages.tsv"
  [ "$rc" -eq 0 ] || status=1
}

if [ $DRY -eq 0 ]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/device.txt" || exit 1
  if ! "$PY" -c "import megatron.core" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-deps --no-index .whl/*.whl
  fi
  DEV=cuda; TINY=()
else
  echo "dry run on $(uname -n): no GPU stage runs; the ledger stage runs on CPU" | tee "$OUT/device.txt"
  DEV=cpu; TINY=(--tiny)
fi

run_stage tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/runtime tests/optim tests/checkpoint \
  tests/params \
  --junitxml="$OUT/cuda-tests.xml"
# The copy-race check on CUDA: the same suites with a sleep kernel before every side-stream
# copy (each copy lands ~20 ms late), so a missing wait fails bitwise (CPU: delayed copies).
run_stage races 120 env FLAT_CUDA_COPY_SLEEP_CYCLES=20000000 "$PY" -m pytest -q -p no:cacheprovider \
  tests/optim tests/checkpoint tests/params --junitxml="$OUT/cuda-races.xml"
# The GPU-only mutants (scripts/mutants.py --gpu): each wait the CPU model cannot test is
# removed in a copy of the tree, and its CUDA selection must fail under late copies (or late
# producers, for the waits for the compute stream).
run_stage mutants 240 "$PY" scripts/mutants.py --gpu --jobs 1 --timeout 100
run_stage tier 30 "$PY" benchmarks/gpu_host_tier.py --json "$OUT/host-tier-cuda.json"
run_stage meter 40 "$PY" benchmarks/gpu_meter_check.py --json "$OUT/meter-cuda.json"
run_stage calibrate 30 "$PY" benchmarks/gpu_calibrate.py --device "$DEV" --json "$OUT/calibration.json"
# the ledger stage predicts with the constants just measured, when the calibrate stage ran
CAL=(); [ -f "$OUT/calibration.json" ] && CAL=(--calibration "$OUT/calibration.json")
run_stage ledger 90 "$PY" benchmarks/gpu_ledger.py --device "$DEV" "${TINY[@]}" --check-syncs \
  "${CAL[@]}" --json "$OUT/ledger-gpu.json"
run_stage sco 80 bash -c '"$0" benchmarks/checkpoint.py --device cuda --dtype bf16 --seq 32768 \
  --batch 1 --hidden 1024 --depths 4 8 16 --reps 2 --json "$1/checkpoint-cuda-64m.json" && "$0" \
  benchmarks/checkpoint.py --device cuda --depths 8 32 --reps 3 --json "$1/checkpoint-cuda.json"' \
  "$PY" "$OUT"
run_stage optim 150 "$PY" benchmarks/optimizer.py --hidden 4096 --layers 5 --repeats 1 \
  --json "$OUT/optimizer-cuda.json"
run_stage dispatch-syncs 60 "$PY" benchmarks/dispatch_scale.py --device cuda --ep 64 --experts 384 \
  --topk 8 --tokens 16384 --chunk-tokens 1639 --hidden 256 --ffn 256 --reps 3 \
  --check-syncs --json "$OUT/dispatch-scale-cuda.json"
# Param offload on CUDA: the device model state against depth (4, 8, 16 layers of 8 experts,
# H 1024, F 4096, bf16), bitwise against the resident stack, and each step's time with the
# copies on their own streams against the knob off (the bytes moved over that time: the
# bandwidth the overlap leaves).
run_stage param-offload 90 "$PY" benchmarks/model_state.py --device cuda --hidden 1024 --ffn 4096 \
  --experts 8 --tokens 8192 --repeats 3 --json "$OUT/model-state-cuda.json"
run_stage vocab 40 "$PY" benchmarks/vocab.py --device cuda --scale 4 --reps 2 --json "$OUT/vocab-cuda.json"
# Attention replay on the CUDA flash kernel, deterministic mode: kept O/LSE equal a second
# kernel run, gradients bitwise (device and pinned host tier), then its step time.
run_stage replay 60 "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_replay_cuda.py \
  --junitxml="$OUT/replay-cuda.xml"
run_stage replay-time 60 "$PY" benchmarks/gpu_attention_replay.py --json "$OUT/replay-cuda.json"
# Attention replay in transformer-engine's fused attention (skipped where TE is missing):
# bitwise stock under Megatron's checkpoint, with and without attention dropout.
run_stage replay-te 70 "$PY" -m pytest -q -p no:cacheprovider tests/megatron/test_te_replay_cuda.py \
  --junitxml="$OUT/replay-te.xml"

"$PY" - "$OUT" "$DRY" "${ALL_STAGES[*]}" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out, dry = sys.argv[1], sys.argv[2] == "1"
order = sys.argv[3].split()
stages = [line.rstrip("\n").split("\t") for line in open(os.path.join(out, "stages.tsv"))]
stages.sort(key=lambda row: order.index(row[0]))
summary = {"dry_run": dry, "stages": {n: {"rc": rc, "seconds": int(s)} for n, rc, s in stages}}
print("stage     result    seconds")
for n, rc, s in stages:
    print(f"{n:10s}{'ok' if rc == '0' else rc if rc == 'planned' else 'FAILED ' + rc:10s}{s:>7s}")
path = os.path.join(out, "ledger-gpu.json")
if os.path.exists(path):
    data = json.load(open(path))
    rows = []
    print("\npredicted (step-time model; calibrated constants when the calibrate stage ran) "
          "vs measured, per unit:")
    print(f"{'unit':10s}{'variant':8s}{'predicted':>11s}{'measured':>11s}{'ratio':>7s}"
          f"{'syncs':>7s}{'cuda':>6s}{'copy under compute':>20s}")
    for r in data["records"]:
        ratio = r["measured_s"] / r["predicted_s"] if r["predicted_s"] else None
        ov = (r.get("profile") or {}).get("copy_overlap")
        rows.append({k: r[k] for k in ("unit", "variant", "predicted_s", "measured_s", "syncs")}
                    | {"cuda_sync_warnings": r.get("cuda_sync_warnings"), "copy_overlap": ov,
                       "measured_over_predicted": ratio})
        print(f"{r['unit']:10s}{r['variant']:8s}{r['predicted_s'] * 1e3:9.2f}ms"
              f"{r['measured_s'] * 1e3:9.2f}ms{'' if ratio is None else f'{ratio:.2f}':>7s}"
              f"{r['syncs']:>7d}{str(r.get('cuda_sync_warnings', '-')):>6s}"
              f"{'-' if ov is None else f'{ov:.0%}':>20s}")
    summary["ledger"] = rows
    if dry:
        print("(dry run: CPU times and CPU counts; not comparable with the prediction)")
path = os.path.join(out, "replay-cuda.json")
if os.path.exists(path):
    data = json.load(open(path))
    steps = {r["variant"]: r["step_s"] for r in data["records"]}
    print(f"\nattention replay ({data['layers']} layers x {data['seq']} tokens): step "
          f"{steps['stock'] * 1e3:.1f} ms stock, {steps['replay'] * 1e3:.1f} ms replay; saving "
          f"measured {data['measured_saving']:.1%}, predicted {data['predicted_saving']:.1%}; "
          f"{'bitwise' if data['bitwise'] else 'NOT bitwise'}")
    summary["replay"] = {k: data[k] for k in ("measured_saving", "predicted_saving", "bitwise")}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
exit $status
