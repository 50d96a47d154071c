"""`fuyouctl top` through a pseudo-terminal, against a real fuyoud with a
training session (issue 13): the live frames show the session updating, and an
idle frame's figures are GetStats' (fuyouctl stats --json)."""

from __future__ import annotations

import os
import pty
import pwd
import re
import select
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from metrics_util import fuyouctl_binary, free_port, get_stats, open_optimizer, start_metrics_daemon, train

CLEAR = "\x1b[H\x1b[2J"


def run_in_pty(args, timeout=30.0) -> str:
    """Runs `args` with its stdout and stderr on a pseudo-terminal; returns what
    it printed (the process must end by itself within `timeout`)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            if not ready:
                proc.kill()
                pytest.fail(f"{args} printed nothing for {timeout} s; so far: {out!r}")
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
        assert proc.wait(timeout) == 0, out.decode(errors="replace")
    return out.decode().replace("\r\n", "\n")


def frames(output: str) -> list[str]:
    assert output.startswith(CLEAR), "on a terminal each frame starts by clearing the screen"
    return output.split(CLEAR)[1:]


def session_row(frame: str, job: str) -> dict:
    lines = frame.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOB "))
    columns = re.split(r"\s{2,}", lines[header].strip())
    for line in lines[header + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == job:
            return dict(zip(columns, cells))
    raise AssertionError(f"no row for job {job} in:\n{frame}")


def test_top_shows_a_training_session_live_and_the_numbers_of_get_stats(tmp_path):
    daemon = start_metrics_daemon(tmp_path, free_port())
    try:
        ctl = [fuyouctl_binary(), "--socket", daemon.socket_path, "top"]
        model, opt = open_optimizer(daemon, "top-job")
        stop = threading.Event()
        steps = [0]

        def training():
            while not stop.is_set():
                train(model, opt, steps=1, first=steps[0])
                steps[0] += 1

        trainer = threading.Thread(target=training)
        trainer.start()
        try:
            live = frames(run_in_pty(ctl + ["--iterations", "2", "--interval", "1"]))
        finally:
            stop.set()
            trainer.join()
        assert len(live) == 2
        row = session_row(live[-1], "top-job")
        assert row["USER"] == pwd.getpwuid(os.geteuid()).pw_name
        assert float(row["UPDATES/S"].split()[0]) > 0, live[-1]
        assert float(row["UPDATE MS"]) > 0 and float(row["I/O MS"]) >= 0, live[-1]
        assert "STORAGE PATH" in live[-1] and daemon.data_dir in live[-1]

        # Idle now (the session stays open): one frame against GetStats.
        (idle,) = frames(run_in_pty(ctl + ["--once", "--interval", "0.5"]))
        stats = get_stats(daemon)
        row = session_row(idle, "top-job")
        assert int(row["STEP"]) == steps[0] == stats["steps_committed"]
        assert row["UPDATES/S"] == "0" and row["UPDATE MS"] == "-"
        assert f"{stats['steps_committed']} steps committed" in idle
        assert f"({stats['cache_hits']} hits, {stats['cache_misses']} misses)" in idle
        lookups = stats["cache_hits"] + stats["cache_misses"]
        assert f"cache hit rate {100 * stats['cache_hits'] / lookups:.1f}%" in idle
        assert "of 256 MiB" in idle
        assert f"speculative updates {stats['chunks_speculative']}," in idle
        assert "1 session ·" in idle
        opt.close()
    finally:
        daemon.stop()


def test_top_into_a_pipe_prints_plain_frames(tmp_path):
    daemon = start_metrics_daemon(tmp_path, free_port())
    try:
        out = subprocess.run([fuyouctl_binary(), "--socket", daemon.socket_path, "top", "--iterations", "2",
                              "--interval", "0.2"], check=True, capture_output=True, text=True).stdout
        assert CLEAR not in out
        assert out.count("fuyoud up") == 2 and "no live sessions" in out
    finally:
        daemon.stop()
