#!/usr/bin/env bash
# Create and fill the virtual environment for one megatron-core version; fast when done.
#   scripts/bootstrap.sh            -> .venv            (megatron-core 0.16.1)
#   MCORE=0.19.2 scripts/bootstrap.sh -> .venv-mcore0.19
# Prints the venv path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."

MCORE="${MCORE:-0.16.1}"
PYTHON="${PYTHON:-python3.11}"
TORCH_PIN="torch==2.13.0"   # the CPU wheel on local disk; never let pip pick a CUDA build
case "$MCORE" in
  0.16.*) VENV=.venv ;;
  *) VENV=".venv-mcore$(echo "$MCORE" | cut -d. -f1-2)" ;;
esac
STAMP="$VENV/.megatron-flat-installed"
TRITON_PIN="triton==3.9.0"  # the peers' kernels and 0.19's imports; CPU runs use its interpreter
WANT="mcore=$MCORE torch=$TORCH_PIN setup=$(cksum setup.py | cut -d' ' -f1) boot=$(cksum "$0" | cut -d' ' -f1)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "$VENV"
  exit 0
fi

command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" "$TORCH_PIN"
case "$MCORE" in
  0.16.*)
    "${PIP[@]}" "megatron-core==$MCORE" ;;
  *)
    # 0.17+ declare Python >= 3.12 and 0.19 imports triton without declaring it
    # (architecture.md §4): install its runtime deps ourselves, then the package without deps.
    "${PIP[@]}" numpy packaging "$TRITON_PIN"
    "${PIP[@]}" --no-deps --ignore-requires-python "megatron-core==$MCORE" ;;
esac
# The project itself; torch is already satisfied so nothing heavier is pulled.
"${PIP[@]}" --no-build-isolation -e ".[test,demo]"
# benchmarks/vocab.py's peers (setup.py's bench-peers extra), without deps: they need only
# torch and triton (the CPU wheel of torch does not bring triton), and must not pull another
# torch. Their tests require them, so every venv gets them.
"${PIP[@]}" "$TRITON_PIN"
"${PIP[@]}" --no-deps liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# 0.19 appends the git commit of the working directory (+abc1234) to its version.
PYTHONWARNINGS=ignore "$VENV/bin/python" - <<PY
import torch, megatron.core
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert megatron.core.__version__.split("+")[0] == "$MCORE", megatron.core.__version__
PY
echo "$WANT" > "$STAMP"
echo "$VENV"
