#!/usr/bin/env bash
# The main job: installs dependencies, builds, then fine-tunes the example GPT with
# fuyou.AdamW against a private ("embedded") fuyoud that the script starts and
# stops itself, and prints the loss before/after, tokens/s, the daemon's storage
# traffic and its final stats. Outputs go to runs/<job>/ (checkpoint, loss.png,
# metrics.json).
#
# Arguments go to python_client/examples/finetune_gpt.py and override the defaults
# below, e.g.:
#   deploy/main-job.sh --optimizer torch        # the same run with torch.optim.AdamW
#   deploy/main-job.sh --steps 400 --model tiny
#
# Each run starts from empty daemon state (runs/main-job/fuyou-data is wiped), so
# the job is new every time; set KEEP_STATE=1 to keep it and resume the job.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

deploy/install-deps.sh
deploy/build.sh

export FUYOU_DAEMON=${FUYOU_DAEMON:-$ROOT/build/daemon/fuyoud}
export FUYOU_DATA_DIR=${FUYOU_DATA_DIR:-$ROOT/runs/main-job/fuyou-data}
export PYTHONPATH=$ROOT/python_client${PYTHONPATH:+:$PYTHONPATH}

if [[ ${KEEP_STATE:-0} != 1 ]]; then
  rm -rf -- "$FUYOU_DATA_DIR"
fi
mkdir -p "$FUYOU_DATA_DIR"
if [[ ! -x $FUYOU_DAEMON && " $* " != *" --optimizer torch "* ]]; then
  echo "main-job: warning: no fuyoud at $FUYOU_DAEMON (set FUYOU_DAEMON)" >&2
fi

start=$(date +%s)
/usr/bin/python3 python_client/examples/finetune_gpt.py \
  --job gpt-finetune-demo --daemon embedded "$@"
echo "main-job: finished in $(( $(date +%s) - start )) s"
