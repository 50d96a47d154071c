#!/usr/bin/env bash
# DeepSpeed beside fuyou on this machine: makes the benchmark's own venv with
# `deepspeed` from PyPI, then runs benchmarks/deepspeed_side_by_side.py in it.
#
#   benchmarks/deepspeed_side_by_side.sh [--parts kernel,io,zero3] [--json out.json] ...
#
# deepspeed is not one of fuyou's dependencies: it goes into
# benchmarks/.venv-deepspeed (git-ignored; DS_VENV overrides), a venv whose
# interpreter is the project venv's and which sees the project venv's packages
# (torch above all) through a .pth file, so torch is neither downloaded nor
# installed twice. DS_VERSION pins the release (default: PyPI's newest).
# Needs g++ and ninja (DeepSpeed JIT-builds its CPU Adam and async I/O ops on
# first use, into ~/.cache/torch_extensions) and libaio-dev for the async I/O op
# (apt-get install libaio-dev); the benchmark reports what it could not build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${FUYOU_VENV:-$ROOT/.venv}
VENV=${DS_VENV:-$ROOT/benchmarks/.venv-deepspeed}

if [[ ! -x $BASE/bin/python ]]; then
  echo "deepspeed_side_by_side: no project venv at $BASE (deploy/install-deps.sh)" >&2
  exit 1
fi
if [[ ! -x $VENV/bin/python ]]; then
  "$BASE/bin/python" -m venv "$VENV"
  purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
  # Appended after the venv's own site-packages: what pip installs here wins.
  purelib "$BASE/bin/python" > "$(purelib "$VENV/bin/python")/fuyou-project-venv.pth"
fi
if ! "$VENV/bin/python" -c 'import deepspeed' > /dev/null 2>&1; then
  # The project's wheelhouse first (deploy/install-deps.sh fills it); pip keeps its cache.
  "$VENV/bin/pip" install --find-links "$HOME/.cache/fuyou/wheels" \
    "deepspeed${DS_VERSION:+==$DS_VERSION}" ninja
fi

export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# DeepSpeed's JIT builds (torch.utils.cpp_extension) use MAX_JOBS compilers; the cores are shared.
export MAX_JOBS=${MAX_JOBS:-2}
export PYTHONPATH=$ROOT/python_client${PYTHONPATH:+:$PYTHONPATH}
exec "$VENV/bin/python" benchmarks/deepspeed_side_by_side.py "$@"
