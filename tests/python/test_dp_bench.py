"""benchmarks/dp_bench.py runs at a tiny size (1 and 2 ranks) and reports what
its doc says; no figures (the lead runs it on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import require_daemon

ROOT = Path(__file__).resolve().parents[2]


def test_dp_bench_reports_scaling_at_a_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "dp_bench.py"), "--fuyoud", require_daemon(),
         "--model", "nano", "--ranks", "1,2", "--global-batch", "4", "--seq-len", "16",
         "--steps", "2", "--warmup", "1", "--chunk-bytes", "65536", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-4000:]
    report = json.loads(out.read_text())
    one, two = report["results"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert (one["per_rank_batch"], two["per_rank_batch"]) == (4, 2)
    assert one["efficiency"] == 1.0 and 0 < two["efficiency"]
    assert two["tokens_per_s"] > 0 and len(two["step_s_all"]) == 2
    # fuyou reduced every chunk during backward on both ranks, every step
    assert two["started_in_backward"] == [3 * two["chunks"]] * 2
