#!/usr/bin/env bash
# The test command (`make test`): single-process tests with pytest, then the multi-rank
# tests under torchrun (gloo) with 2 and 4 ranks. Fails if any run fails or runs no test.
#
# Each kind runs in two parts (tests/_megatron_use.py): the files that may run megatron-core
# code, then the others with megatron-core made unimportable, which proves them independent
# of its version. FLAT_SCOPE=megatron runs only the first part (CI's second megatron-core
# version), with one smoke rehearsal instead of every end-to-end rehearsal (FLAT_REHEARSALS).
# FLAT_TEST_JOBS (default 2) single-process workers (pytest-xdist).
#
# Order: single-process tests, the delayed-copies run, the multi-rank tests, then the mutation
# suite, which skips the unmutated baselines of the stages that already passed (--proven).
# Every stage prints its slowest tests (--durations).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="$(scripts/bootstrap.sh | tail -n 1)" || { echo "bootstrap failed"; exit 1; }
PY="$VENV/bin/python"
export TORCHDYNAMO_DISABLE=1 FLAT_DIST_TIMEOUT_S="${FLAT_DIST_TIMEOUT_S:-180}"
export PYTHONWARNINGS="ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning"
JUNIT="$(mktemp -d)"
export FLAT_JUNIT_DIR="$JUNIT"
status=0
SCOPE="${FLAT_SCOPE:-all}"
case "$SCOPE" in
  all) PARTS=(involved free) ;;
  megatron) PARTS=(involved); export FLAT_REHEARSALS=smoke ;;
  *) echo "FLAT_SCOPE=$SCOPE: expected all or megatron"; exit 2 ;;
esac
JOBS="${FLAT_TEST_JOBS:-2}"
# One intra-op thread per core and worker: torch starts one per core in every worker, and
# JOBS workers spinning twice the cores' threads ran the single-process stages 28 % slower
# (tests/vocab, dispatch, checkpoint, optim on 2 cores: 41-44 s -> 30-31 s). torchrun's
# ranks already run with one thread each; the rehearsals set one for their runs.
CORES="$(nproc 2>/dev/null || echo 2)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / JOBS > 0 ? CORES / JOBS : 1 ))}"
XDIST=()
# Work stealing: a worker that runs out takes half of another's queue. xdist's default hands
# out contiguous chunks, which gave one worker every rehearsal (~800 test-s) and left the
# other idle: the involved stage took 867 s instead of ~600.
[ "$JOBS" -gt 1 ] && XDIST=(-n "$JOBS" --dist worksteal)

stage() {  # a stage's header, with the seconds since the start (CI's time limit)
  echo "== $* [at ${SECONDS}s]"
}

check() {  # check NAME RC
  if [ "$2" -eq 5 ]; then echo "FAILED: $1 ran no test"; status=1;
  elif [ "$2" -ne 0 ]; then echo "FAILED: $1 (exit $2)"; status=1; fi
}

MCORE_VERSION="$("$PY" -c 'import megatron.core as m; print(m.__version__)' 2>/dev/null)"
for part in "${PARTS[@]}"; do
  stage "single-process tests, megatron-$part files (megatron-core $MCORE_VERSION)"
  FLAT_MEGATRON=$part FLAT_JUNIT_TAG="megatron-$part" \
    "$PY" -m pytest -q -p no:cacheprovider --durations=15 "${XDIST[@]}" "$@" tests
  rc=$?
  [ $rc -eq 5 ] && [ $# -gt 0 ] && rc=0  # a -k selection may leave one part nothing
  check "single-process tests (megatron-$part files)" $rc
done

# The copy-race check: SCO's and OffloadStreamAdamW's tests again with delayed copies (a
# side-stream copy lands only when a wait makes it due; its destination is poison until
# then), so a missing wait fails bitwise instead of passing because CPU copies are instant.
stage "delayed-copies tests (SCO, OffloadStreamAdamW, param offload, attention replay's host tier)"
scope=""; [ "$SCOPE" = megatron ] && scope=involved
FLAT_DELAYED_COPIES=1 FLAT_JUNIT_TAG=delayed-copies FLAT_MEGATRON=$scope \
  "$PY" -m pytest -q -p no:cacheprovider --durations=10 "${XDIST[@]}" "$@" tests/checkpoint tests/optim tests/params \
  tests/megatron/test_param_offload.py \
  tests/attention/test_replay.py
rc=$?
# Only a selection given on the command line (-k ...) may leave them nothing to run.
[ $rc -eq 5 ] && [ $# -gt 0 ] && rc=0
check "delayed-copies tests" $rc
proven=()  # the stages that passed whole: the mutation suite need not rerun their selections
[ $rc -eq 0 ] && [ $# -eq 0 ] && proven+=(delayed)

# Each world size and part runs its multi-rank files in as few pytest sessions as keep the
# cores busy (shard_sessions below; files end in _world2.py / _world4.py; a torchrun start
# costs 5-9 s and the Megatron import again).
# tests/conftest.py fails a file that leaves a process group or Megatron's parallel state
# behind, so files cannot lean on each other. When a session fails, each of its files runs
# again alone to say which one fails by itself (and which only after another).
torchrun_pytest() {  # torchrun_pytest N PART TAG FILE... -> torchrun's exit code
  local n=$1 part=$2 tag=$3 logs rc
  shift 3
  logs="$JUNIT/logs-$tag"
  FLAT_MEGATRON=$part FLAT_JUNIT_TAG="$tag" "$VENV/bin/torchrun" --standalone \
    --nproc-per-node "$n" --log-dir "$logs" --redirects 3 --tee 3 --local-ranks-filter 0 \
    -m pytest -q -p no:cacheprovider --durations=10 "${ARGS[@]}" "$@"
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then  # show what the silent ranks said
    for f in "$logs"/*/attempt_0/*/stdout.log; do
      case "$f" in */0/stdout.log) continue ;; esac
      echo "---- $f"; tail -n 40 "$f"
    done
  fi
  return $rc
}

# The ranks of one session leave the cores a third idle (they wait on each other in gloo), so
# a part's files are dealt to SHARDS sessions that run at once, as many as keep the ranks at
# most two per core: at world size 2 on 2 cores, two sessions took 64 s where one took 87 s;
# at world size 4 two sessions were slower than one (120 s against 107 s). Files are dealt
# largest first to the session with the fewest bytes of test code so far (files dealt in turn
# left one session 453 s and the other 239 s; tests dealt in turn, every file in both
# sessions, took 448 s and 501 s; dealt by size, 325 s and 328 s).
shard_sessions() {  # shard_sessions N PART FILE... -> 0, 5 (no test) or the first failure
  local n=$1 part=$2 shards i k rc first=5 file size least mine
  shift 2
  shards=$(( 2 * CORES / n )); [ "$shards" -gt "$JOBS" ] && shards=$JOBS
  [ "$shards" -gt $# ] && shards=$#
  [ "$shards" -lt 1 ] && shards=1
  local pids=() tags=() load=()
  for (( i = 0; i < shards; i++ )); do
    tags[i]="world$n-$part$([ "$shards" -gt 1 ] && echo "-$((i + 1))")"
    load[i]=0
    : > "$JUNIT/files-${tags[i]}"
  done
  while read -r size file; do
    least=0
    for (( k = 1; k < shards; k++ )); do [ "${load[k]}" -lt "${load[least]}" ] && least=$k; done
    load[least]=$(( load[least] + size ))
    echo "$file" >> "$JUNIT/files-${tags[least]}"
  done < <(for file in "$@"; do echo "$(wc -c < "$file") $file"; done | sort -k1,1nr -k2,2)
  for (( i = 0; i < shards; i++ )); do
    mapfile -t mine < "$JUNIT/files-${tags[i]}"
    torchrun_pytest "$n" "$part" "${tags[i]}" "${mine[@]}" > "$JUNIT/out-${tags[i]}" 2>&1 &
    pids[i]=$!
  done
  for (( i = 0; i < shards; i++ )); do
    wait "${pids[i]}"; rc=$?
    [ "$shards" -gt 1 ] && echo "-- session $((i + 1)) of $shards:"
    cat "$JUNIT/out-${tags[i]}"
    [ $rc -eq 5 ] && continue
    if [ $rc -ne 0 ]; then
      echo "FAILED: world-$n megatron-$part session ${tags[i]} (exit $rc); each file alone:"
      mapfile -t mine < "$JUNIT/files-${tags[i]}"
      for file in "${mine[@]}"; do
        FLAT_JUNIT_DIR="" torchrun_pytest "$n" "$part" "alone-$(basename "$file" .py)" "$file" \
          > "$JUNIT/alone.log" 2>&1
        alone=$?
        case $alone in 0|5) echo "  passes alone: $file" ;;
          *) echo "  FAILS alone (exit $alone): $file"; tail -n 60 "$JUNIT/alone.log" ;; esac
      done
    fi
    if [ $rc -ne 0 ]; then first=$rc; elif [ "$first" -eq 5 ]; then first=0; fi
  done
  return "$first"
}

ARGS=("$@")
for n in 2 4; do
  stage "multi-rank tests, world size $n (torchrun, gloo, sessions per part)"
  ran=0
  world_failed=0
  for part in "${PARTS[@]}"; do
    mapfile -t files < <("$PY" tests/_megatron_use.py --world "$n" "--$part")
    [ "${#files[@]}" -gt 0 ] || { echo "FAILED: no megatron-$part world-$n files"; status=1; continue; }
    shard_sessions "$n" "$part" "${files[@]}"
    rc=$?
    # A selection (-k) may leave a part nothing; the world size as a whole must run some.
    [ $rc -eq 5 ] && continue
    ran=1
    if [ $rc -ne 0 ]; then
      world_failed=1
      check "world-$n tests (megatron-$part)" $rc
    fi
  done
  [ $ran -eq 1 ] || { echo "FAILED: world-$n tests ran no test"; status=1; }
  [ $ran -eq 1 ] && [ $world_failed -eq 0 ] && [ $# -eq 0 ] && proven+=("world$n")
done

# The mutation suite: each CPU-killable mutant (a wait removed, a record dropped, ...; see
# scripts/mutants.py) applied to a copy of the tree must make its test selection fail. Only for
# the whole suite (a -k selection skips it). FLAT_MUTANTS_ARGS=--megatron-only keeps the
# mutants whose result may depend on the megatron-core version (CI's second version).
if [ $# -eq 0 ]; then
  stage "mutation suite (scripts/mutants.py ${FLAT_MUTANTS_ARGS:-})"
  part=all; [ "$SCOPE" = megatron ] && part=involved
  proven_list="$(IFS=,; echo "${proven[*]}")"
  # shellcheck disable=SC2086
  "$PY" scripts/mutants.py ${FLAT_MUTANTS_ARGS:-} --proven "$proven_list" --proven-part $part
  check "mutation suite" $?
fi

# every rank's failures count (a test failing on rank 1 only is a failure)
"$PY" scripts/junit_summary.py "$JUNIT" || status=1
rm -rf "$JUNIT"
echo "make test: done in ${SECONDS}s"
exit $status
