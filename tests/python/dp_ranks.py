"""Runs the ranks of a data-parallel test worker as gloo subprocesses on one
node (the data-parallel tests beside test_data_parallel.py: its dp_worker.py
ranks are run by its own run_ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_daemon

HERE = Path(__file__).resolve().parent
RANK_TIMEOUT_S = 400  # generous: a loaded 2-core machine


def run_worker(script: str, tmp: Path, world: int, *flags: str, name: str = "run") -> list:
    """Runs `world` ranks of ``script RANK WORLD STORE OUT.json FLAGS...``;
    their JSON results, by rank. No default socket answers, so the node's
    lowest rank starts an embedded fuyoud on ``tmp/data`` for all of them."""
    binary = require_daemon()
    env = dict(os.environ, FUYOU_DAEMON=binary, FUYOU_SOCKET=str(tmp / "no-daemon.sock"),
               FUYOU_DATA_DIR=str(tmp / "data"),
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "python_client"), str(HERE)]))
    env.pop("FUYOU_EMBEDDED", None)
    store = tmp / f"{name}.store"
    outs = [tmp / f"{name}.{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(HERE / script), str(r), str(world),
                               str(store), str(outs[r]), *flags], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=RANK_TIMEOUT_S)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish; its output:\n" + p.communicate()[0].decode())
    results = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.exists(), f"rank {r} failed:\n{logs[r]}"
        res = json.loads(out.read_text())
        assert "error" not in res, f"rank {r}: {res['error']}\n{res.get('traceback')}"
        results.append(res)
    return results
