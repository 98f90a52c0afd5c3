#!/usr/bin/env bash
# The test command (`make test`): single-process tests with pytest, then the multi-rank
# tests under torchrun (gloo) with 2 and 4 ranks. Fails if any run fails or runs no test.
#
# Each kind runs in two parts (tests/_megatron_use.py): the files that may run megatron-core
# code, then the others with megatron-core made unimportable, which proves them independent
# of its version. FLAT_SCOPE=megatron runs only the first part (CI's second megatron-core
# version). FLAT_TEST_JOBS (default 2) single-process workers (pytest-xdist).
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
  megatron) PARTS=(involved) ;;
  *) echo "FLAT_SCOPE=$SCOPE: expected all or megatron"; exit 2 ;;
esac
JOBS="${FLAT_TEST_JOBS:-2}"
XDIST=()
[ "$JOBS" -gt 1 ] && XDIST=(-n "$JOBS")

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
    "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" "$@" tests
  rc=$?
  [ $rc -eq 5 ] && [ $# -gt 0 ] && rc=0  # a -k selection may leave one part nothing
  check "single-process tests (megatron-$part files)" $rc
done

# The copy-race check: SCO's and OffloadStreamAdamW's tests again with delayed copies (a
# side-stream copy lands only when a wait makes it due; its destination is poison until
# then), so a missing wait fails bitwise instead of passing because CPU copies are instant.
stage "delayed-copies tests (SCO, OffloadStreamAdamW, attention replay's host tier)"
scope=""; [ "$SCOPE" = megatron ] && scope=involved
FLAT_DELAYED_COPIES=1 FLAT_JUNIT_TAG=delayed-copies FLAT_MEGATRON=$scope \
  "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" "$@" tests/checkpoint tests/optim \
  tests/attention/test_replay.py
rc=$?
# Only a selection given on the command line (-k ...) may leave them nothing to run.
[ $rc -eq 5 ] && [ $# -gt 0 ] && rc=0
check "delayed-copies tests" $rc

# The mutation suite: each CPU-killable mutant (a wait removed, a record dropped, ...; see
# scripts/mutants.py) applied to a copy of the tree must make its test selection fail. Only for
# the whole suite (a -k selection skips it). FLAT_MUTANTS_ARGS=--megatron-only keeps the
# mutants whose result may depend on the megatron-core version (CI's second version).
if [ $# -eq 0 ]; then
  stage "mutation suite (scripts/mutants.py ${FLAT_MUTANTS_ARGS:-})"
  # shellcheck disable=SC2086
  "$PY" scripts/mutants.py ${FLAT_MUTANTS_ARGS:-}
  check "mutation suite" $?
fi

# One torchrun per multi-rank test file (files end in _world2.py / _world4.py), so a file
# that fails or hangs cannot take the others down with it.
run_world_file() {  # run_world_file N PART FILE -> the torchrun's exit code
  local n=$1 part=$2 file=$3 tag logs rc
  tag="$(basename "$(dirname "$file")")-$(basename "$file" .py)"
  logs="$JUNIT/logs-$tag"
  FLAT_MEGATRON=$part FLAT_JUNIT_TAG="$tag" "$VENV/bin/torchrun" --standalone \
    --nproc-per-node "$n" --log-dir "$logs" --redirects 3 --tee 3 --local-ranks-filter 0 \
    -m pytest -q -p no:cacheprovider "${ARGS[@]}" "$file"
  rc=$?
  if [ $rc -ne 0 ]; then  # show what the silent ranks said
    for f in "$logs"/*/attempt_0/*/stdout.log; do
      case "$f" in */0/stdout.log) continue ;; esac
      echo "---- $f"; tail -n 40 "$f"
    done
  fi
  return $rc
}

ARGS=("$@")
for n in 2 4; do
  stage "multi-rank tests, world size $n (torchrun, gloo, one run per file)"
  ran=0
  for part in "${PARTS[@]}"; do
    mapfile -t files < <("$PY" tests/_megatron_use.py --world "$n" "--$part")
    [ "${#files[@]}" -gt 0 ] || { echo "FAILED: no megatron-$part world-$n files"; status=1; }
    for file in "${files[@]}"; do
      run_world_file "$n" "$part" "$file"
      rc=$?
      # A file with no test selected (e.g. by -k) is fine; the world size must run some.
      [ $rc -eq 5 ] && continue
      ran=1
      check "world-$n tests in $file" $rc
    done
  done
  [ $ran -eq 1 ] || { echo "FAILED: world-$n tests ran no test"; status=1; }
done

"$PY" - "$JUNIT" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in glob.glob(sys.argv[1] + "/junit-*.xml"):
    if "-rank" in path and not path.endswith("-rank0.xml"):
        continue  # every rank runs the same tests; count them once
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for k in tot:
            tot[k] += int(suite.get(k, 0))
failed = tot["failures"] + tot["errors"]
passed = tot["tests"] - failed - tot["skipped"]
print(f"make test: {passed} passed, {failed} failed, {tot['skipped']} skipped")
PY
rm -rf "$JUNIT"
echo "make test: done in ${SECONDS}s"
exit $status
