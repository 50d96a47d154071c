"""A missing or dying daemon gives an exception quickly, never a hang; the
embedded daemon and admin_stats (issue 3 (d), items 4 and 5)."""

import os
import signal
import time

import pytest
import torch

import fuyou
from conftest import require_daemon, start_daemon
from helpers import make_model
from train_util import CHUNK_BYTES, step_loss

STATS_KEYS = {"scope", "uid", "storage", "bytes_read", "bytes_written", "read_gbps", "write_gbps", "chunk_updates", "params_updated", "chunk_updates_per_second",
              "params_updated_per_second", "dram_bytes_in_use", "dram_budget_bytes",
              "cache_hits", "cache_misses", "live_sessions", "steps_committed",
              "uptime_seconds", "chunks_speculative", "chunks_redone_changed",
              "chunks_redone_clipped", "chunks_rolled_back_skipped_step", "redo_seconds",
              "weights_fetches", "weights_fetch_cache_hits", "weights_bytes_read",
              # Every GetStatsResponse field, by its name: the journal's too.
              "journal_bytes_total", "journal_spilled_bytes_total", "journal_replays_total",
              "journal_replay_seconds_total",
              "activation_spilled_bytes_total", "activation_recalled_bytes_total",
              "data_parallel_jobs"}
STORAGE_KEYS = {"path", "bytes_read", "bytes_written", "read_gbps", "write_gbps", "direct_io"}


def test_no_daemon_is_daemon_unavailable_fast(tmp_path, monkeypatch):
    """No daemon: refused at once, not after the 60 s timeout. The bounds are a
    quarter of that timeout (a loaded machine); torch 2's first optimizer of a
    process imports torch._dynamo (seconds), so one is made before timing."""
    model = make_model()
    torch.optim.AdamW(model.parameters())
    t0 = time.monotonic()
    with pytest.raises(fuyou.DaemonUnavailable) as info:
        fuyou.AdamW(model.parameters(), job="nodaemon", address=str(tmp_path / "none.sock"),
                    timeout=60.0)
    assert time.monotonic() - t0 < 15.0
    assert info.value.code == "UNAVAILABLE"
    assert "none.sock" in str(info.value)

    # Default address, embedded daemon disabled by the environment.
    monkeypatch.setenv("FUYOU_SOCKET", str(tmp_path / "default.sock"))
    monkeypatch.setenv("FUYOU_EMBEDDED", "0")
    t0 = time.monotonic()
    with pytest.raises(fuyou.DaemonUnavailable, match="FUYOU_EMBEDDED=0"):
        fuyou.AdamW(model.parameters(), job="nodaemon")
    with pytest.raises(fuyou.DaemonUnavailable, match="embedded=False"):
        monkeypatch.delenv("FUYOU_EMBEDDED")
        fuyou.AdamW(model.parameters(), job="nodaemon", embedded=False)
    assert time.monotonic() - t0 < 15.0


def test_native_errors_carry_code_and_message(daemon):
    from fuyou import _fuyou
    with pytest.raises(fuyou.InvalidArgument) as info:
        _fuyou.Session.open(job="bad/name", num_slots=2, slot_bytes=4096,
                            address=daemon.address)
    assert info.value.code == "INVALID_ARGUMENT" and "bad/name" in str(info.value)
    s = _fuyou.Session.open(job=f"dup-{os.getpid()}", num_slots=2, slot_bytes=4096,
                            address=daemon.address)
    try:
        with pytest.raises(fuyou.FailedPrecondition):
            _fuyou.Session.open(job=f"dup-{os.getpid()}", num_slots=2, slot_bytes=4096,
                                address=daemon.address)
    finally:
        s.close()


@pytest.mark.parametrize("when", ["before_step", "before_backward", "stopped"])
def test_daemon_killed_mid_step_raises_within_timeout(tmp_path, when):
    d = start_daemon(tmp_path, "victim")
    timeout = 4.0
    try:
        model = make_model()
        opt = fuyou.AdamW(model.parameters(), job="victim", address=d.address,
                          chunk_bytes=CHUNK_BYTES, num_slots=2, timeout=timeout)
        step_loss(model, 0).backward()
        opt.step()
        opt.zero_grad()
        if when in ("before_step", "stopped"):
            step_loss(model, 1).backward()  # chunks sent, some updated
        # "stopped": alive but frozen (SIGSTOP): only the timeouts can save the job.
        os.kill(d.pid, signal.SIGSTOP if when == "stopped" else signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(fuyou.FuyouError) as info:
            if when == "before_backward":
                step_loss(model, 1).backward()  # the hooks meet the dead daemon
            opt.step()
        elapsed = time.monotonic() - t0
        # A bound, not a speed: without the timeouts this waits forever. Loose
        # enough for a loaded 2-core CI machine under ASan.
        assert elapsed < 2 * timeout + 10.0, f"took {elapsed:.1f} s"
        print(f"daemon killed {when}: {type(info.value).__name__} [{info.value.code}] after "
              f"{elapsed:.2f} s: {info.value}")
        with pytest.raises(fuyou.FailedPrecondition):
            opt.step()
        t0 = time.monotonic()
        opt.close()
        assert time.monotonic() - t0 < 3 * timeout + 10.0
    finally:
        if when == "stopped":
            os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_embedded_daemon_and_admin_stats(tmp_path, monkeypatch):
    binary = require_daemon()
    monkeypatch.setenv("FUYOU_DAEMON", binary)
    monkeypatch.setenv("FUYOU_SOCKET", str(tmp_path / "nobody-here.sock"))
    monkeypatch.setenv("FUYOU_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("FUYOU_EMBEDDED", raising=False)
    model = make_model()
    with fuyou.AdamW(model.parameters(), job="embedded", chunk_bytes=CHUNK_BYTES) as opt:
        d = opt.embedded_daemon
        assert d is not None and d.running()
        assert opt.address == d.address and d.data_dir == str(tmp_path / "data")
        for step in range(2):
            step_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        stats = fuyou.admin_stats()  # no address: this process's embedded daemon
        assert set(stats) == STATS_KEYS
        assert stats["scope"] == "daemon"  # the daemon's own user: everything
        assert stats["storage"] and set(stats["storage"][0]) == STORAGE_KEYS
        assert stats["live_sessions"] == 1
        assert stats["steps_committed"] >= 2
        assert stats["chunk_updates"] >= 2 * opt.num_chunks
        assert stats["params_updated"] >= 2 * sum(c.num_elements for c in opt.pipeline.plan.chunks)
        assert stats["uptime_seconds"] > 0
        assert fuyou.admin_stats(d.address)["steps_committed"] == stats["steps_committed"]
        pid = d.pid
    assert not d.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_embedded_daemon_context_manager(tmp_path):
    binary = require_daemon()
    with fuyou.EmbeddedDaemon(data_dir=str(tmp_path / "data"),
                              socket_path=str(tmp_path / "s.sock"), binary=binary) as d:
        assert d.address == f"unix:{tmp_path / 's.sock'}"
        assert fuyou.admin_stats(d.address)["live_sessions"] == 0
    assert not d.running()
    assert d.stop() is None  # idempotent


def test_embedded_daemon_that_fails_to_start_reports_its_output(tmp_path):
    binary = require_daemon()
    t0 = time.monotonic()
    with pytest.raises(fuyou.DaemonUnavailable) as info:
        fuyou.EmbeddedDaemon(data_dir=str(tmp_path / "data"), socket_path=str(tmp_path / "s"),
                             extra_args=["--no-such-flag"], binary=binary)
    assert time.monotonic() - t0 < 15.0
    assert "--no-such-flag" in str(info.value) and "exited with status" in str(info.value)
