"""Runs the ranks of a data-parallel test worker as gloo subprocesses, and
compares their results with torch: the one runner of every data-parallel test
file (dp_worker.py, dp_overlap_worker.py, dp_resume_worker.py,
dp_state_dict_worker.py, dp_stream_worker.py)."""

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


def run_worker(script: str, tmp: Path, world: int, *flags: str, name: str = "run",
               env_of=None, expect_killed=(), errors_allowed: bool = False,
               timeout_s: float = RANK_TIMEOUT_S) -> list:
    """Runs `world` ranks of ``script RANK WORLD STORE OUT.json FLAGS...``;
    their JSON results, by rank (None for the ranks in `expect_killed`, which
    must die by SIGKILL). A result holding "error" fails the test unless
    `errors_allowed`. `env_of(r)`: extra environment of rank r. Without it
    every rank shares one node: no default socket answers, so the node's
    lowest rank starts an embedded fuyoud on ``tmp/data`` for all of them."""
    binary = require_daemon()
    base = dict(os.environ, FUYOU_DAEMON=binary, FUYOU_SOCKET=str(tmp / "no-daemon.sock"),
                FUYOU_DATA_DIR=str(tmp / "data"),
                PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "python_client"), str(HERE)]),
                PYTHONFAULTHANDLER="1")  # a rank that aborts prints every thread's stack
    base.pop("FUYOU_EMBEDDED", None)
    base.pop("FUYOU_NODE_ID", None)
    store = tmp / f"{name}.store"
    outs = [tmp / f"{name}.{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(HERE / script), str(r), str(world),
                               str(store), str(outs[r]), *flags],
                              env=dict(base, **(env_of(r) if env_of else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout_s)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish (a hang); its output:\n" + p.communicate()[0].decode())
    results = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        if r in expect_killed:
            assert p.returncode == -9, f"rank {r} was to be killed:\n{logs[r]}"
            results.append(None)
            continue
        assert p.returncode == 0 and out.exists(), (
            f"rank {r} failed (exit status {p.returncode}, result file "
            f"{'written' if out.exists() else 'missing'}):\n{logs[r]}")
        res = json.loads(out.read_text())
        if not errors_allowed:
            assert "error" not in res, f"rank {r}: {res['error']}\n{res.get('traceback')}"
        results.append(res)
    return results


def assert_matches_torch(results: list, steps: int) -> None:
    """Every rank ran `steps` steps without error and matched torch after each
    (its "worst" differences beyond tolerance, one a step, all <= 0)."""
    for res in results:
        assert "error" not in res, res.get("traceback")
        assert len(res["worst"]) == steps
        assert max(res["worst"]) <= 0.0, f"rank {res['rank']}: {res['worst']}"


def node_b_holding_syncs(tmp: Path, job: str, release=None):
    """``env_of`` for two nodes, a fuyoud each (the node's rank embeds it):
    rank 0 on node b, rank 1 on node a; with `release`, node b's fuyoud holds
    the data syncs of rank 0's job `job` while the file `release` is missing
    (FUYOU_TEST_FAULTS, test-only)."""
    def env(r):
        node = "b" if r == 0 else "a"
        out = {"FUYOU_NODE_ID": f"node-{node}", "FUYOU_DATA_DIR": str(tmp / f"data-{node}")}
        if release is not None and r == 0:
            out["FUYOU_TEST_FAULTS"] = f"sync:HOLD:until={release}:job={job}"
        return out
    return env
