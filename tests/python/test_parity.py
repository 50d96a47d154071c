"""fuyou.AdamW against torch.optim.AdamW, fp32, step by step (issue 3 (a), (e))."""

import io

import pytest
import torch

import fuyou
from helpers import assert_models_close, clone_model, make_model, max_rel_diff
from train_util import CHUNK_BYTES, split_groups, step_loss

STEPS = 20
RTOL = 1e-5
ATOL = 1e-7


def _lr_lambda(step):
    return 1.0 / (1.0 + 0.1 * step)


@pytest.mark.parametrize("overlap,num_slots,scheduler", [
    (True, 2, "lambda"),    # overlap, slots run out: weights staged during backward
    (True, 16, "step"),     # overlap, enough slots
    (False, 4, "lambda"),   # everything sent in step()
])
def test_matches_torch_adamw(backend, overlap, num_slots, scheduler):
    ref = make_model()
    ref.pos.weight.requires_grad_(False)  # a frozen parameter
    model = clone_model(ref)
    frozen_before = model.pos.weight.detach().clone()
    ref_opt = torch.optim.AdamW(split_groups(ref), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    opt = backend.adamw(split_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                        chunk_bytes=CHUNK_BYTES, num_slots=num_slots, overlap=overlap)
    assert opt.num_chunks >= 10
    assert not opt.resumed and opt.committed_step == 0

    def sched(o):
        if scheduler == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda)
        return torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)

    ref_sched, sched_ = sched(ref_opt), sched(opt)
    worst = 0.0
    for step in range(STEPS):
        ref_loss = step_loss(ref, step)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_sched.step()

        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched_.step()

        assert opt.committed_step == step + 1
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        assert_models_close(model, ref, rtol=RTOL, atol=ATOL, what=f"step {step}")
        worst = max(worst, max_rel_diff(model, ref))
    assert torch.equal(model.pos.weight, frozen_before)
    assert model.head.weight is model.tok.weight
    print(f"[{backend.name}] overlap={overlap} slots={num_slots}: worst relative "
          f"difference over {STEPS} steps {worst:.2e}")
    assert ref_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    opt.close()


def test_state_dict_round_trip(backend):
    model = make_model()
    opt = backend.adamw(split_groups(model), chunk_bytes=CHUNK_BYTES, loss_scale="dynamic")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    for step in range(3):
        step_loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt._scaler.scale = 512.0
    opt.skipped_steps = 2
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    job = opt.job
    opt.close()

    buf.seek(0)
    loaded = torch.load(buf)
    model2 = make_model()
    opt2 = backend.adamw(split_groups(model2), chunk_bytes=CHUNK_BYTES, loss_scale="dynamic",
                         job=job)
    assert opt2.resumed and opt2.committed_step == 3
    assert_models_close(model2, model, rtol=0, atol=0, what="resumed weights")
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, _lr_lambda)
    opt2.load_state_dict(loaded)
    sched2.load_state_dict(sched.state_dict())
    assert opt2.loss_scale == 512.0
    assert opt2.skipped_steps == 2
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in sd["param_groups"]]
    again = opt2.state_dict()
    assert again["fuyou"] == sd["fuyou"]
    assert again["param_groups"] == sd["param_groups"]
    opt2.close()


def test_state_dict_layout_mismatch_is_refused(fake_backend):
    model = make_model()
    opt = fake_backend.adamw(model.parameters(), chunk_bytes=CHUNK_BYTES)
    sd = opt.state_dict()
    other = fake_backend.adamw(make_model().parameters(), chunk_bytes=CHUNK_BYTES * 2)
    with pytest.raises(fuyou.InvalidArgument):
        other.load_state_dict(sd)


def test_add_param_group_after_construction_is_refused(fake_backend):
    model = make_model()
    opt = fake_backend.adamw(model.parameters(), chunk_bytes=CHUNK_BYTES)
    with pytest.raises(fuyou.InvalidArgument):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
