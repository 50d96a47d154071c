"""What an ordinary user sees of a shared daemon (GetStats covers only their own
activity, and the example's progress bar still counts their bytes), and a clean
exit after DaemonUnavailable (issue 8, items 9 and 12)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from conftest import require_daemon

import fuyou

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "python_client" / "examples"
NOBODY = 65534


def run_python(script: str, env_extra=None, as_uid=None, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python_client"), str(EXAMPLES)])
    env.update(env_extra or {})
    preexec = None
    if as_uid is not None:
        def preexec():
            os.setgid(as_uid)
            os.setuid(as_uid)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec)


@pytest.mark.parametrize("caught", [True, False])
def test_daemon_unavailable_leaves_stderr_clean_at_exit(tmp_path, caught):
    require_daemon()  # needs the native binding
    build = f"fuyou.AdamW(model.parameters(), job='x', address={str(tmp_path / 'none.sock')!r}, embedded=False)"
    body = f"""
        import torch, fuyou
        model = torch.nn.Linear(4, 4)
        """
    if caught:
        body += f"""
        try:
            {build}
        except fuyou.DaemonUnavailable as e:
            print("caught", e.code)
        """
    else:
        body += f"""
        {build}
        """
    result = run_python(body)
    assert "Exception ignored" not in result.stderr, result.stderr
    assert "sys.meta_path" not in result.stderr, result.stderr
    if caught:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "caught UNAVAILABLE"
        assert result.stderr == ""
    else:
        assert result.returncode == 1
        assert "DaemonUnavailable" in result.stderr and "none.sock" in result.stderr


def test_a_daemon_lost_mid_training_leaves_stderr_clean_at_exit(tmp_path):
    # The optimizer is never closed: its __del__ runs at interpreter exit, where
    # the session's failing close() used to import fuyou._errors after
    # sys.meta_path was gone ("Exception ignored ... sys.meta_path is None").
    binary = require_daemon()
    script = f"""
        import os, signal, torch, fuyou
        d = fuyou.EmbeddedDaemon(data_dir={str(tmp_path / 'data')!r}, socket_path={str(tmp_path / 's.sock')!r},
                                 binary={binary!r}, extra_args=["--dram-budget", "64MiB"])
        model = torch.nn.Linear(4, 4)
        opt = fuyou.AdamW(model.parameters(), job="lost", address=d.address, embedded=False, timeout=5)
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        os.kill(d.pid, signal.SIGKILL)
        try:
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
        except fuyou.DaemonUnavailable as e:
            print("caught", e.code)
        """
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "caught UNAVAILABLE"
    assert "Exception ignored" not in result.stderr, result.stderr
    assert "sys.meta_path" not in result.stderr, result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second user")
def test_progress_bar_counts_an_ordinary_users_own_bytes():
    binary = require_daemon()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fuyou-limits-"))
    try:
        os.chmod(tmp, 0o1777)  # nobody reaches the socket and has a HOME here (sticky, as fuyoud requires)
        with fuyou.EmbeddedDaemon(data_dir=str(tmp / "data"), socket_path=str(tmp / "s.sock"),
                                  extra_args=["--dram-budget", "64MiB", "--socket-mode", "0666"],
                                  binary=binary) as d:
            # Root's job counts toward the daemon's totals, not toward nobody's.
            import torch
            model = torch.nn.Linear(128, 128)
            with fuyou.AdamW(model.parameters(), job="roots", address=d.address, embedded=False) as opt:
                for _ in range(3):
                    model(torch.ones(2, 128)).sum().backward()
                    opt.step()
                    opt.zero_grad()
            script = f"""
                import json, torch, fuyou
                from finetune_gpt import StatsPoller
                model = torch.nn.Linear(64, 64)
                opt = fuyou.AdamW(model.parameters(), job="mine", address={d.address!r}, embedded=False)
                poller = StatsPoller(opt, min_interval_s=0)
                for _ in range(2):
                    model(torch.ones(2, 64)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                poller.poll(force=True)
                print(json.dumps({{"scope": poller.latest["scope"], "uid": poller.latest["uid"],
                                  "storage": poller.latest["storage"],
                                  "dram_budget_bytes": poller.latest["dram_budget_bytes"],
                                  "steps_committed": poller.latest["steps_committed"],
                                  "moved": poller.bytes_since_start(), "rates": poller.rates_gbps(),
                                  "error": poller.error}}))
                opt.close()
                """
            result = run_python(script, env_extra={"HOME": str(tmp)}, as_uid=NOBODY)
            assert result.returncode == 0, result.stderr
            seen = json.loads(result.stdout.strip().splitlines()[-1])
            assert seen["error"] is None
            assert seen["scope"] == "user" and seen["uid"] == NOBODY
            assert seen["storage"] == [] and seen["dram_budget_bytes"] == 0
            assert seen["steps_committed"] == 2, "root's 3 steps must not show"
            read, written = seen["moved"]
            # Two steps of one job's new states (12 bytes a parameter, 4 KiB-aligned extents).
            assert written >= 2 * 12 * (64 * 64 + 64)
            assert len(seen["rates"]) == 2
            everything = fuyou.admin_stats(d.address)  # root: the whole daemon
            assert everything["scope"] == "daemon"
            assert everything["steps_committed"] == 5
            assert everything["storage"] and everything["bytes_written"] > written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
