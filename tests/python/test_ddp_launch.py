"""Launch (issue 24 item 5): the example fine-tuning under torch 1.13's torchrun
with two gloo ranks on one node, finding one fuyoud, for three steps: through
deploy/main-job.sh --ddp (the model in DDP), and the torchrun command of the
README with --ddp-model plain (fuyou reduces during backward)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import require_daemon

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "nano", "--steps", "3", "--base-steps", "1", "--batch-size", "2",
        "--seq-len", "32", "--eval-batches", "1", "--eval-every", "0", "--serial-steps", "0",
        "--compare-steps", "0", "--sample-bytes", "0", "--chunk-bytes", "65536",
        "--threads", "1", "--no-progress"]
TIMEOUT_S = 400  # two ranks and a daemon on a loaded 2-core machine


def run(cmd, tmp: Path) -> str:
    env = dict(os.environ, FUYOU_DAEMON=require_daemon(), FUYOU_DATA_DIR=str(tmp / "data"),
               FUYOU_SOCKET=str(tmp / "none.sock"), SKIP_BUILD="1",
               PYTHONPATH=str(ROOT / "python_client"))
    env.pop("FUYOU_EMBEDDED", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out[-6000:]
    return out


def check_two_ranks_one_daemon(out: str, out_dir: Path) -> dict:
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["committed_step"] == 3 and metrics["optimizer"] == "fuyou"
    stats = metrics["daemon_stats"]
    # both ranks' jobs on the one daemon, 3 steps each (read before rank 0
    # closes; rank 1 may have closed already)
    assert stats["steps_committed"] == 6
    assert out.count("started an embedded fuyoud") == 1  # rank 0's; rank 1 prints nothing
    # the checkpoint holds the whole job's optimizer states (a collective of both ranks)
    ckpt = torch.load(out_dir / "finetuned.pt")
    states = ckpt["optimizer"]["state"]
    params = [i for g in ckpt["optimizer"]["param_groups"] for i in g["params"]]
    assert params and sorted(states) == sorted(params)
    assert all(int(s["step"]) == 3 and s["exp_avg"].numel() > 0 for s in states.values())
    return metrics


def test_main_job_ddp_runs_two_ranks_on_one_daemon(tmp_path):
    out = run(["bash", "deploy/main-job.sh", "--ddp", "--nproc", "2", *TINY,
               "--out-dir", str(tmp_path / "out")], tmp_path)
    metrics = check_two_ranks_one_daemon(out, tmp_path / "out")
    # DDP averaged too: fuyou found it at the first step, whose own averages it had
    # written into .grad after DDP's (the same average): nothing sent was redone
    assert metrics["loop_stats"]["speculative_updates"] > 0
    assert metrics["loop_stats"]["redone_changed"] == 0


def test_torchrun_with_a_plain_model_reduces_during_backward(tmp_path):
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2",
               "python_client/examples/finetune_gpt.py", "--ddp", "--ddp-model", "plain",
               "--daemon", "embedded", *TINY, "--out-dir", str(tmp_path / "out")], tmp_path)
    metrics = check_two_ranks_one_daemon(out, tmp_path / "out")
    assert metrics["loop_stats"]["redone_changed"] == 0  # nothing DDP made moot


def test_ddp_outside_torchrun_says_how_to_launch(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python_client"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "python_client/examples/finetune_gpt.py",
                           "--ddp", *TINY, "--out-dir", str(tmp_path / "out")], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode != 0
    assert b"--ddp runs under torchrun" in proc.stdout
