"""fuyou.AdamW's optimizer state dict both ways, and zero_grad as the installed
torch has it (issue 19, items 1 and 4).

- zero_grad()'s default is torch's (False on 1.13): a zero .grad updates a
  parameter as torch does (moments decay, weight decay), None leaves it alone;
  a parameter whose gradient is legitimately zero does not make an
  accumulating step look skipped;
- state_dict() holds torch's per-parameter moments (up to
  state_dict_max_bytes), so optimizer.pt resumes in a new process into
  fuyou.AdamW or torch.optim.AdamW, and torch's optimizer.pt into fuyou.AdamW,
  each continuing as an uninterrupted torch.optim.AdamW run;
- above the limit, a job reference and a warning naming export_checkpoint.

Weights are compared with torch after every step within 1e-6 + 1e-5|w|.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fuyou
import state_dict_worker as worker
from conftest import start_daemon
from helpers import make_model
from test_stream_parameters import stream_backend  # noqa: F401
from test_training_loops import (ATOL, RTOL, StatsLog, assert_matches, fuyou_adamw,  # noqa: F401
                                 loss_of, make_pair, torch_adamw)

HERE = Path(__file__).resolve().parent
FIRST, MORE = 5, 5


# ---------------------------------------------------------------- zero_grad
def test_zero_grad_default_is_the_installed_torchs():
    import inspect
    want = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
    got = inspect.signature(fuyou.AdamW.zero_grad).parameters["set_to_none"].default
    assert got == want


@pytest.mark.parametrize("call", ["default", "False", "True"])
def test_zero_grad_like_torch_with_a_linear_without_gradient_on_odd_steps(fuyou_adamw, call):
    """`extra` gets no gradient on odd steps: after zero_grad(set_to_none=False)
    its .grad is a zero tensor, which torch (and fuyou) update with; after
    set_to_none=True it is None, which both skip. 12 steps, compared after each."""
    kw = {} if call == "default" else {"set_to_none": call == "True"}
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    log = StatsLog(opt)
    for step in range(12):
        use_extra = step % 2 == 0
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, step, use_extra=use_extra).backward()
            o.step()
            o.zero_grad(**kw)
        assert_matches(model, ref, step, f"zero_grad({kw})")
        log.after(step)
    log.check(f"zero_grad({kw})")
    set_to_none = kw.get("set_to_none", worker_default())
    assert (model.extra.weight.grad is None) == set_to_none  # after an odd step
    assert opt.loop_stats.rolled_back_skipped == 0
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[p_ref]["step"])


def worker_default():
    import inspect
    return inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default


def test_a_legitimately_zero_gradient_is_no_skipped_step(fuyou_adamw):
    """Two backward passes per step; on even steps (the first one included,
    where fuyou learns that the loop accumulates) `extra` gets an exactly zero
    gradient (0 * its weights) that does arrive, first of its chunk. The second
    pass reaching the chunks already sent is accumulation, not a skipped step:
    nothing is rolled back, and the weights match torch's."""
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    for step in range(8):
        use_extra = step % 2 == 1
        for m, o in ((ref, ref_opt), (model, opt)):
            for micro in range(2):
                loss = loss_of(m, step, micro=micro, use_extra=use_extra)
                if not use_extra:
                    loss = loss + 0.0 * sum(p.sum() for p in m.extra.parameters())
                (loss / 2).backward()
            o.step()
            o.zero_grad(set_to_none=False)
        assert_matches(model, ref, step, "a zero gradient that arrives")
    assert opt.loop_stats.rolled_back_skipped == 0


# ------------------------------------------------------- optimizer.pt both ways
def _save(kind, daemon, directory: Path, job):
    """The first FIRST steps with `kind`'s optimizer, saved as Trainer does."""
    model = make_model()
    opt = worker.make_optimizer(kind, model, daemon.address, job)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, worker.lr_lambda)
    weights = worker.run(model, opt, sched, 0, FIRST)
    directory.mkdir()
    torch.save(opt.state_dict(), directory / "optimizer.pt")
    torch.save(model.state_dict(), directory / "model.pt")
    torch.save(sched.state_dict(), directory / "scheduler.pt")
    if kind == "fuyou":
        opt.close()
    return weights


def _resume(into, daemon, directory: Path, job, out: Path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parents[1] / "python_client"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "state_dict_worker.py"), "--into", into, "--dir",
           str(directory), "--first", str(FIRST), "--steps", str(MORE), "--out", str(out),
           "--address", daemon.address, "--job", job]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    return torch.load(out)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted torch.optim.AdamW run: weights after each step."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(split_groups_of(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, worker.lr_lambda)
    return worker.run(model, opt, sched, 0, FIRST + MORE)


def split_groups_of(model):
    from train_util import split_groups
    return split_groups(model)


def _compare(got, want, step, what):
    for name, w in want.items():
        a, b = got[name].double(), w.double()
        err = (a - b).abs()
        assert bool((err <= ATOL + RTOL * b.abs()).all()), (
            f"{what}: after step {step}, {name} differs from the uninterrupted "
            f"torch.optim.AdamW run by up to {err.max().item():.3g}")


@pytest.mark.parametrize("case", ["fuyou-into-fuyou-same-job", "fuyou-into-fuyou-new-job",
                                  "fuyou-into-torch", "torch-into-fuyou"])
def test_hf_trainer_checkpoint_resumes_in_a_new_process(daemon, tmp_path, reference, case):
    saved_by, into = case.split("-into-")
    into = into.split("-")[0]
    job = f"sd-{case}-{os.getpid()}"
    first = _save(saved_by, daemon, tmp_path / "checkpoint-5", job)
    for step, w in enumerate(first):
        _compare(w, reference[step], step, f"{case}: before the checkpoint")
    if saved_by == "fuyou":
        sd = torch.load(tmp_path / "checkpoint-5" / "optimizer.pt")
        assert sd["fuyou"]["state_included"] and len(sd["state"]) > 0
        assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in sd["state"].values())
    resume_job = job if case.endswith("same-job") else job + "-resumed"
    got = _resume(into, daemon, tmp_path / "checkpoint-5", resume_job, tmp_path / "out.pt")
    assert len(got) == MORE
    for i, w in enumerate(got):
        _compare(w, reference[FIRST + i], FIRST + i, f"{case}: after the resume")


def test_fuyou_checkpoint_into_a_job_of_another_daemon(daemon, tmp_path, reference):
    """The source job is not in the daemon the resumed run uses: the moments of
    the state dict are imported (the fork has nothing to copy)."""
    job = f"sd-other-daemon-{os.getpid()}"
    _save("fuyou", daemon, tmp_path / "checkpoint-5", job)
    other = start_daemon(tmp_path, "other")
    try:
        got = _resume("fuyou", other, tmp_path / "checkpoint-5", job + "-elsewhere",
                      tmp_path / "out.pt")
    finally:
        other.stop()
    for i, w in enumerate(got):
        _compare(w, reference[FIRST + i], FIRST + i, "into another daemon")


# ------------------------------------------------------------- the size limit
def test_state_dict_over_the_limit_is_a_job_reference_with_a_warning(fuyou_adamw):
    model, ref = make_pair()
    opt = fuyou_adamw(model.parameters(), state_dict_max_bytes=1024)
    assert opt.state_dict_max_bytes == 1024
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    with pytest.warns(UserWarning, match="export_checkpoint"):
        sd = opt.state_dict()
    assert sd["state"] == {} and sd["fuyou"]["state_included"] is False
    assert sd["fuyou"]["job"] == opt.job and sd["fuyou"]["committed_step"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)  # the same job at its step: nothing to import
        opt.state_dict_max_bytes = None  # settable: no limit
        assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


def test_default_limit_is_two_gib(fuyou_adamw):
    model, _ = make_pair()
    assert fuyou_adamw(model.parameters()).state_dict_max_bytes == 2 << 30
    assert fuyou.optimizer.DEFAULT_STATE_DICT_MAX_BYTES == 2 << 30


# --------------------------------------------- a torch state dict, in process
def test_torch_state_dict_into_a_trained_job_continues_like_torch(fuyou_adamw):
    """load_state_dict of torch's state dict into a job that trained other
    steps: its moments and steps replace the job's, the masters are the model's."""
    model, ref = make_pair()
    ref_opt = torch_adamw(ref.parameters())
    for step in range(3):
        loss_of(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt = fuyou_adamw(model.parameters())
    for step in range(2):  # other training, to be replaced
        loss_of(model, 10 + step).backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    opt.load_state_dict(ref_opt.state_dict())
    for step in range(3, 8):
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
        assert_matches(model, ref, step, "torch's state dict into a trained job")


def test_mismatched_state_dicts_are_refused_before_anything_is_written(fuyou_adamw):
    model, ref = make_pair()
    ref_opt = torch_adamw(ref.parameters())
    loss_of(ref, 0).backward()
    ref_opt.step()
    opt = fuyou_adamw(model.parameters())
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    before = opt.export_checkpoint()["optimizer"]["state"]
    sd = ref_opt.state_dict()
    two_groups = {"state": sd["state"], "param_groups": [
        dict(sd["param_groups"][0], params=sd["param_groups"][0]["params"][:2]),
        dict(sd["param_groups"][0], params=sd["param_groups"][0]["params"][2:])]}
    with pytest.raises(fuyou.InvalidArgument, match="parameter groups"):
        opt.load_state_dict(two_groups)
    bad_shape = {"state": dict(sd["state"]), "param_groups": sd["param_groups"]}
    last = max(bad_shape["state"])
    bad_shape["state"][last] = dict(sd["state"][last], exp_avg=torch.zeros(3, 3))
    with pytest.raises(fuyou.InvalidArgument, match="shape"):
        opt.load_state_dict(bad_shape)
    after = opt.export_checkpoint()["optimizer"]["state"]
    for i in before:
        assert torch.equal(before[i]["exp_avg"], after[i]["exp_avg"])
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


# ------------------------------------------------ the streamed mode (offload_params)
@pytest.fixture
def daemon_backend(daemon):
    """The streamed imports need WriteState, which the fake session lacks."""
    from conftest import Backend
    return Backend("daemon", daemon.address, daemon)


def _streamed_pair(backend):
    import copy
    from test_stream_parameters import offload_adamw, torch_adamw as stream_torch_adamw
    from train_util import StreamGPT
    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    ref = copy.deepcopy(model)
    return model, ref, stream_torch_adamw, offload_adamw


def _train(pairs, steps, first=0):
    from train_util import stream_batch
    for step in range(first, first + steps):
        for m, o in pairs:
            m(*stream_batch(step)).backward()
            o.step()
            o.zero_grad(set_to_none=True)


def _assert_close_to(opt, ref, step, what):
    from test_stream_parameters import assert_matches_daemon
    assert_matches_daemon(opt, ref, step, what)


def test_streamed_state_dict_holds_the_moments(stream_backend):
    """With offload_params state_dict() holds the moments as torch has them, and
    a state dict of the job at its committed step loads (nothing to import)."""
    model, ref, torch_adamw_, offload_adamw = _streamed_pair(stream_backend)
    ref_opt = torch_adamw_(ref.parameters())
    opt = offload_adamw(stream_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="32KiB")
    try:
        _train([(ref, ref_opt), (model, opt)], 2)
        sd = opt.state_dict()
        assert sd["fuyou"]["state_included"]
        want = ref_opt.state_dict()["state"]
        assert set(sd["state"]) == set(want)
        for i, st in want.items():
            assert float(sd["state"][i]["step"]) == float(st["step"]) == 2.0
            torch.testing.assert_close(sd["state"][i]["exp_avg"], st["exp_avg"],
                                       rtol=1e-5, atol=1e-7)
        opt.load_state_dict(sd)  # this job at its step: nothing to import
    finally:
        handle.close()
        opt.close()


def test_streamed_resume_from_torchs_model_and_optimizer_files(daemon_backend, tmp_path):
    """torch's model.pt and optimizer.pt into a fresh streamed model (new job):
    model.load_state_dict writes the weights, opt.load_state_dict the moments
    and step counts; the next steps match torch's own continuation."""
    import copy
    model, ref, torch_adamw_, offload_adamw = _streamed_pair(daemon_backend)
    ref_opt = torch_adamw_(ref.parameters())
    _train([(ref, ref_opt)], 3)
    torch.save(ref.state_dict(), tmp_path / "model.pt")
    torch.save(ref_opt.state_dict(), tmp_path / "optimizer.pt")
    opt = offload_adamw(daemon_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="32KiB")
    try:
        model.load_state_dict(torch.load(tmp_path / "model.pt"))
        opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
        for step in range(3, 6):
            _train([(ref, ref_opt), (model, opt)], 1, first=step)
            _assert_close_to(opt, ref, step, "torch's files into a streamed fuyou")
    finally:
        handle.close()
        opt.close()


def test_streamed_files_into_torch(daemon_backend, tmp_path):
    """A streamed fuyou run's model.pt and optimizer.pt into a plain model and
    torch.optim.AdamW: torch continues exactly as the streamed run does."""
    import copy
    model, ref, torch_adamw_, offload_adamw = _streamed_pair(daemon_backend)
    opt = offload_adamw(daemon_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="32KiB")
    try:
        _train([(model, opt)], 3)
        torch.save(model.state_dict(), tmp_path / "model.pt")
        torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
        plain = copy.deepcopy(ref)
        plain.load_state_dict(torch.load(tmp_path / "model.pt"))
        plain_opt = torch_adamw_(plain.parameters())
        plain_opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
        for step in range(3, 6):
            _train([(plain, plain_opt), (model, opt)], 1, first=step)
            _assert_close_to(opt, plain, step, "a streamed fuyou's files into torch")
    finally:
        handle.close()
        opt.close()


def test_streamed_load_before_registration_is_refused(daemon_backend):
    model, ref, torch_adamw_, offload_adamw = _streamed_pair(daemon_backend)
    ref_opt = torch_adamw_(ref.parameters())
    _train([(ref, ref_opt)], 1)
    opt = offload_adamw(daemon_backend, model.parameters())
    try:
        with pytest.raises(fuyou.FailedPrecondition, match="stream_parameters"):
            opt.load_state_dict(ref_opt.state_dict())
    finally:
        opt.close()


def test_state_dict_during_a_step_is_a_job_reference_with_a_warning(fuyou_adamw):
    model, _ = make_pair()
    opt = fuyou_adamw(model.parameters())
    loss_of(model, 0).backward()
    opt.step()
    loss_of(model, 1).backward()  # chunks sent, no step() yet
    with pytest.warns(UserWarning, match="during a step"):
        sd = opt.state_dict()
    assert sd["state"] == {} and not sd["fuyou"]["state_included"]
    opt.step()
