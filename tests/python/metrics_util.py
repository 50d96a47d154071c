"""Helpers for the tests of fuyoud's Prometheus endpoint and `fuyouctl top`: a
free TCP port, a daemon with metrics on, a few training steps, a scrape."""

from __future__ import annotations

import json
import os
import subprocess
import socket
import urllib.request
from pathlib import Path

import fuyou
from conftest import require_daemon
from helpers import make_model
from train_util import CHUNK_BYTES, step_loss


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_metrics_daemon(tmp: Path, port: int) -> fuyou.EmbeddedDaemon:
    binary = require_daemon()
    return fuyou.EmbeddedDaemon(data_dir=str(tmp / "data"), socket_path=str(tmp / "d.sock"),
                                extra_args=["--dram-budget", "256MiB", "--metrics-listen", f"127.0.0.1:{port}"],
                                binary=binary)


def open_optimizer(daemon, job: str):
    model = make_model()
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, timeout=20.0, chunk_bytes=CHUNK_BYTES,
                      lr=1e-3, job=job)
    return model, opt


def train(model, opt, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        opt.zero_grad()
        step_loss(model, step).backward()
        opt.step()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return answer.read().decode()


def fuyouctl_binary() -> str:
    daemon = Path(require_daemon())
    ctl = daemon.parents[1] / "clientlib" / "fuyouctl"
    assert os.access(ctl, os.X_OK), f"fuyouctl not built next to {daemon} (ninja -C build fuyouctl)"
    return str(ctl)


def get_stats(daemon) -> dict:
    """GetStats in full (every field of admin.proto), through `fuyouctl stats
    --json`; 64-bit counters arrive as JSON strings and are made ints."""
    out = subprocess.run([fuyouctl_binary(), "--socket", daemon.socket_path, "stats", "--json"],
                         check=True, capture_output=True, text=True).stdout
    stats = json.loads(out)

    def numbers(node):
        if isinstance(node, dict):
            return {k: numbers(v) for k, v in node.items()}
        if isinstance(node, list):
            return [numbers(v) for v in node]
        if isinstance(node, str) and node.isdigit():
            return int(node)
        return node
    return numbers(stats)
