"""A job SIGKILLed mid-step resumes at its last committed step and ends where an
uninterrupted run ends (issue 3 (c))."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STEPS = 8
HANG_AT = 5


def _worker(daemon, job, out, hang_at=-1):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parents[1] / "python_client"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "resume_worker.py"), "--address", daemon.address,
           "--job", job, "--steps", str(STEPS), "--out", str(out),
           "--hang-at-step", str(hang_at)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _run(daemon, job, out):
    proc = _worker(daemon, job, out)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    return output


def test_sigkill_mid_step_then_resume(daemon, tmp_path):
    pid = os.getpid()
    full = _run(daemon, f"resume-full-{pid}", tmp_path / "full.pt")
    assert "opened resumed=False committed=0" in full

    job = f"resume-killed-{pid}"
    proc = _worker(daemon, job, tmp_path / "unused.pt", hang_at=HANG_AT)
    lines = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"mid-step {HANG_AT}"):
            break
        assert time.monotonic() < deadline, "".join(lines)
    assert lines and lines[-1].startswith(f"mid-step {HANG_AT}"), "".join(lines)
    time.sleep(0.3)  # let the daemon apply some of the step's chunk updates
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert f"committed {HANG_AT - 1}\n" in lines

    resumed = _run(daemon, job, tmp_path / "resumed.pt")
    assert f"opened resumed=True committed={HANG_AT - 1}" in resumed, resumed
    a = torch.load(tmp_path / "full.pt")
    b = torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_durable_step_trails_the_applied_step_by_at_most_one_and_close_makes_it_durable(daemon):
    """EndStep answers when the step is applied; its durable commit runs on in
    fuyoud. ``durable_step`` (what a crash keeps) is the applied step or the one
    before, never more; closing waits for the commit, so a reopened job resumes
    at the last applied step."""
    import fuyou
    job = f"durable-{os.getpid()}"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = fuyou.AdamW(model.parameters(), lr=1e-3, job=job, address=daemon.address,
                      embedded=False)
    durable = []
    for step in range(1, 5):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        assert opt.committed_step == step
        assert opt.durable_step in (step - 1, step), (step, opt.durable_step)
        assert opt.durable_step >= (durable[-1] if durable else 0)
        durable.append(opt.durable_step)
    weights = model.weight.detach().clone()
    opt.close()
    again = torch.nn.Linear(64, 64)
    reopened = fuyou.AdamW(again.parameters(), lr=1e-3, job=job, address=daemon.address,
                           embedded=False)
    try:
        assert reopened.committed_step == reopened.durable_step == 4
        assert torch.equal(again.weight.detach(), weights)
    finally:
        reopened.close()
