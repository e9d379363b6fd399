#!/usr/bin/env bash
# GPU check for the TensorRT backend: plans for tiny-gpt and the bench model, TensorRT
# greedy tokens == ONNX Runtime's (alone, batched, joining/leaving), decode tokens/s at
# batch 1, 8, 32 next to the memory-bandwidth bound. Under 5 minutes on one GPU.
#
#   WHEELS=/path/to/wheels scripts/gpu_check.sh      # offline host: missing packages come from $WHEELS
#   scripts/gpu_check.sh --dry-run                   # no GPU: emulated TensorRT, CPU throughput
#
# Nothing is downloaded: a package that is not importable is installed with
# `pip install --no-index --find-links "$WHEELS"` (default ./wheels), or the check stops
# and names it. Python: $PYTHON, else .venv/bin/python, else a venv in build/gpu-venv
# made from python3 with --system-site-packages (so an image's own TensorRT is used).
# Arguments go to scripts/gpu_check.py (--help). Exit: 0 equal, 1 mismatch, 2 environment.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="${WHEELS:-wheels}"
LIMIT="${GPU_CHECK_TIMEOUT:-290}"
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  if [[ ! -x build/gpu-venv/bin/python ]]; then
    mkdir -p build
    python3 -m venv --system-site-packages build/gpu-venv
  fi
  PY=build/gpu-venv/bin/python
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "gpu_check: $PY is older than Python 3.11" >&2; exit 2; }

dry=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry=1; done

# module to import -> package to install
missing=()
check() { "$PY" -c "import $1" >/dev/null 2>&1 || missing+=("$2"); }
check numpy numpy
check onnx onnx
check onnxruntime onnxruntime
check tokenizers tokenizers
check structlog structlog
check orjson orjson
if (( ! dry )); then
  check tensorrt tensorrt
  "$PY" -c 'import cuda.bindings.runtime' >/dev/null 2>&1 \
    || "$PY" -c 'from cuda import cudart' >/dev/null 2>&1 \
    || "$PY" -c 'import pycuda.driver' >/dev/null 2>&1 \
    || missing+=(cuda-python)
fi

if (( ${#missing[@]} )); then
  if [[ -d "$WHEELS" ]]; then
    echo "gpu_check: installing ${missing[*]} from $WHEELS (offline)" >&2
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"
  else
    echo "gpu_check: missing ${missing[*]}; put their wheels in a folder and set WHEELS=<folder>" >&2
    exit 2
  fi
fi

exec timeout --kill-after=10 "$LIMIT" "$PY" -m scripts.gpu_check "$@"
