#!/usr/bin/env bash
# The GPU machine's packaging, rehearsed on this (build) machine, so that the
# first device run finds nothing to fix in it (issue 30, item 5):
#
#   1. a venv of pyenv's Python 3.12 (the GPU machine's) with torch 2.11.0 (its
#      torch) and every other package at the lock file's pin (deploy/python-lock.txt
#      without its torch, nvidia-*, cuda-* and triton lines);
#   2. deploy/gpu-bundle.sh: fuyoud, its libraries and the binding built for 3.12;
#   3. deploy/gpu-check.sh with that venv's Python: the bundle's fuyoud starts on
#      the bundle's libraries, the binding loads beside torch 2.11, and each GPU
#      step runs or skips for lack of a device (exit 0).
#
# Usage: deploy/gpu-rehearsal.sh   (PY312=/path/to/python3.12, VENV=.venv-py312,
#        TORCH=2.11.0, OUT_DIR=runs/gpu-rehearsal)
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}
VENV=${VENV:-.venv-py312}
TORCH=${TORCH:-2.11.0}
if [[ -z "$PY312" || ! -x "$PY312" ]]; then
  echo "gpu-rehearsal: no Python 3.12 found (set PY312=/path/to/python3.12)" >&2
  exit 2
fi
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
grep -vE '^(torch|nvidia-|cuda-|triton)' deploy/python-lock.txt > "$pins"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -c "$pins" "torch==$TORCH" numpy pytest hypothesis grpcio protobuf \
  transformers accelerate
PY312=$PY312 deploy/gpu-bundle.sh
PY="$(realpath "$VENV")/bin/python" OUT_DIR=${OUT_DIR:-$PWD/runs/gpu-rehearsal} deploy/gpu-check.sh
