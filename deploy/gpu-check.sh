#!/usr/bin/env bash
# Runs fuyou's GPU check on the GPU machine (Python 3.12 + torch, none of Debian's
# libraries), from the folder deploy/gpu-bundle.sh built on the build machine:
#
#   1. the bundle's fuyoud starts (--version) with only the bundle's libraries;
#   2. tests/gpu/test_cuda_pipeline.py  (parity fp32/bf16/fp16, pinned slots, no sync in backward)
#   3. tests/gpu/check_loops_gpu.py     (GradScaler and transformers.Trainer loops; skips without transformers)
#   4. benchmarks/gpu_step_bench.py     (at most ~6 minutes; JSON + PNG into $OUT_DIR)
#   5. benchmarks/param_stream_bench.py --gpu  (a 302.7M-param GPT, 1155 MiB of fp32
#      weights, streamed under a 512 MiB device-memory cap; at most 150 s)
#
# Usage (repository root, GPU machine):  deploy/gpu-check.sh
#   BUNDLE=gpu-bundle  PY=python3  OUT_DIR=${OUT:-runs}/gpu-check  BENCH_ARGS="..."
# Exit status: 0 when every step passed (or skipped for lack of a GPU), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUNDLE=$(cd "${BUNDLE:-gpu-bundle}" && pwd)
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-$ROOT/runs}/gpu-check}
mkdir -p "$OUT_DIR"
status=0

# The binding next to the package sources (python_client/fuyou is the package).
cp "$BUNDLE"/python/fuyou/_fuyou.cpython-*.so python_client/fuyou/
export PYTHONPATH=$ROOT/python_client${PYTHONPATH:+:$PYTHONPATH}
export FUYOU_DAEMON=$BUNDLE/fuyoud FUYOU_EMBEDDED=1
LIBS=$BUNDLE/lib
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! "$PY" -c "import torch, fuyou._fuyou" 2>/dev/null; then
  # The system's libstdc++ is older than Debian's: use the bundle's too.
  export LD_LIBRARY_PATH=$LIBS:$BUNDLE/lib-cxx${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# fuyoud (started by the Python side) always finds its C++ runtime.
if ! env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$FUYOU_DAEMON" --version; then
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$BUNDLE/lib-cxx
  "$FUYOU_DAEMON" --version || { echo "gpu-check: the bundle's fuyoud does not start"; exit 1; }
fi
"$PY" -c "import sys, torch, fuyou._fuyou; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" \
  || { echo "gpu-check: fuyou's binding does not load"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUT_DIR/nvidia-smi.txt"
ulimit -l unlimited 2>/dev/null || true  # cudaHostRegister of the slots needs RLIMIT_MEMLOCK
echo "ulimit -l: $(ulimit -l)"

step() {
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  (( rc == 0 )) || status=1
}

step gpu_tests timeout 150 "$PY" tests/gpu/test_cuda_pipeline.py
step check_loops timeout 120 "$PY" tests/gpu/check_loops_gpu.py
# shellcheck disable=SC2086
# 280 s of configurations (+ the one running when that is spent): with the
# streaming run the whole check stays within one 10-minute device command.
step gpu_step_bench timeout 340 "$PY" benchmarks/gpu_step_bench.py --out "$OUT_DIR" ${BENCH_ARGS:---budget-s 280}
# The model's weights are 2.3x the device-memory cap and 9x device_budget; the
# daemon keeps its states in DRAM (that machine has the memory; its SSD is unknown).
# GPU only: skipped (not failed) without CUDA, as the steps above skip themselves.
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  step param_stream_bench timeout 150 "$PY" benchmarks/param_stream_bench.py --fuyoud "$FUYOU_DAEMON" \
    --gpu --gpu-cap 512MiB --device-budget 128MiB --dram-budget 16GiB \
    --layers 24 --embd 1024 --heads 16 --steps 3 --no-resident --json "$OUT_DIR/param_stream_bench.json"
else
  echo "=== param_stream_bench: skipped: no CUDA device"
fi

echo "gpu-check: $( ((status == 0)) && echo PASSED || echo FAILED ); logs and results in $OUT_DIR"
exit $status
