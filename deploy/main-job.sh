#!/usr/bin/env bash
# The main job: installs dependencies, builds, then fine-tunes a transformers Llama
# (LlamaForCausalLM from python_client/examples/configs/llama-main.json, random
# init, trained first on the KJV text the repository ships, byte-level vocabulary)
# with fuyou.AdamW against a private ("embedded") fuyoud that the script starts and
# stops itself. The model (25.6M parameters, preset "main") has 307 MB of fp32
# optimizer states, 4.6x the embedded fuyoud's DRAM budget (64 MiB, fuyoud's
# smallest), so the states stream from the SSD every step. It trains on CUDA when
# torch.cuda.is_available(), else on the CPU (--device). At the end it prints a
# side-by-side table: fuyou's tokens/s, the same steps with torch.optim.AdamW, the
# SSD traffic and cache hit rate, the overlap achieved and the redo counts.
# Outputs go to runs/<job>/ (checkpoint, loss.png, timeline.png, metrics.json, and
# hf/: the model with save_pretrained in safetensors, which the job loads back with
# AutoModelForCausalLM.from_pretrained and compares tensor by tensor).
#
# Arguments go to python_client/examples/finetune_gpt.py and override the defaults
# below, e.g.:
#   deploy/main-job.sh --optimizer torch        # the whole run with torch.optim.AdamW
#   deploy/main-job.sh --steps 400 --model tiny --batch-size 16 --seq-len 128
#   deploy/main-job.sh --arch gpt               # the example GPT (gpt.py) instead
#   deploy/main-job.sh --commit-every 10        # fuyoud --commit-every-steps 10
#   deploy/main-job.sh --ddp [--nproc N]        # N data-parallel ranks (default 2) under
#                                               # torchrun, one fuyoud (see below)
#
# Each run starts from empty daemon state (runs/main-job/fuyou-data is wiped), so
# the job is new every time; set KEEP_STATE=1 to keep it and resume the job.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  deploy/install-deps.sh
  deploy/build.sh
fi

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

# A CPU budget for the two sides when they share cores (a CPU-only machine), for a
# torch built on OpenBLAS (Debian's was): its idle threads spin on sched_yield for
# about 2^28 cycles before they sleep, taking the cores fuyoud's optimizer and I/O
# threads need during backward (perf: a fifth of all CPU time in sched_yield with
# the default; 4% with 4). PyPI's torch 2 (the lock's) uses MKL and OpenMP, where
# it changes nothing. It must be set before torch loads; the torch comparison
# runs under the same setting.
export OPENBLAS_THREAD_TIMEOUT=${OPENBLAS_THREAD_TIMEOUT:-4}

# Data parallel (--ddp): N ranks under torch's own launcher (torchrun), gloo on
# the CPU, nccl on CUDA; each rank trains the job <job>.rank<r>-of<N>; local rank
# 0 starts the embedded fuyoud and the other ranks of the node find it.
python=$ROOT/${FUYOU_VENV:-.venv}/bin/python  # deploy/install-deps.sh's venv
launch=("$python")
args=()
nproc=2
while (($#)); do
  case $1 in
    --nproc) nproc=$2; shift ;;
    --ddp) launch=("$python" -m torch.distributed.run --standalone); args+=("$1") ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [[ ${launch[*]} == *torch.distributed.run* ]]; then
  launch+=(--nproc_per_node="$nproc")
fi

start=$(date +%s)
# --base-lr 3e-4: at 1e-3 and above the base run's loss jumps (3 -> 6-12) around its
# 10th step before it recovers; 3e-4 trains without a spike to a lower held-out loss.
"${launch[@]}" python_client/examples/finetune_gpt.py \
  --job gpt-finetune-demo --daemon embedded --model main --batch-size 4 --seq-len 64 \
  --base-lr 3e-4 --base-steps 30 --steps 60 --eval-every 20 --eval-batches 4 --chunk-bytes 4194304 \
  --dram-budget 64MiB --serial-steps 5 --compare-steps 10 ${args[@]+"${args[@]}"}
echo "main-job: finished in $(( $(date +%s) - start )) s"
