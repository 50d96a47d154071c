"""Exactness, second round (issue 31): habits an experienced torch user has,
against torch.optim.AdamW on the same model and batches, weights compared
after every step (``|a - b| <= 1e-6 + 1e-5 |b|``).

- streamed: hyper-parameters edited between backward() and step() (a
  scheduler stepped first, lr/betas/eps/weight_decay set by hand) are redone
  from the daemon's gradient journal in this step, not the next;
- streamed: ``p.grad = None`` after backward() skips the parameter, as torch
  does (whole parameters, one of a chunk's several, with clipping);
- resident: a parameter frozen when the optimizer was built and unfrozen later
  is updated from its first gradient on, with fresh moments;
- resident: weights edited outside step() (``p.data.clamp_``, a ``no_grad``
  rescale, ``reset_parameters()``, ``model.load_state_dict``) are taken into the
  masters before the next update;
- streamed: what it cannot do is refused at step(), naming the parameter (its
  weight edits and uses outside its modules: test_exact_streamed_uses.py).
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
from torch import nn

import fuyou
from test_stream_loops import _loss, loop_backend, run_side_by_side  # noqa: F401
from test_stream_parameters import LR, TwiceNet, stream_backend  # noqa: F401
from test_training_loops import (ATOL, RTOL, assert_matches, fuyou_adamw, loss_of,  # noqa: F401
                                 make_pair, torch_adamw)

_jobs = (f"x2-{os.getpid()}-{i}" for i in itertools.count())



# ---------------------------------------------------------------- streamed: late edits
@pytest.mark.parametrize("edit", ["lr", "betas", "eps", "weight_decay", "scheduler_first"])
def test_streamed_hyper_parameters_set_between_backward_and_step(loop_backend, edit):
    schedulers = {}  # per optimizer: stepped before optimizer.step(), a common slip

    def body(m, o, step):
        _loss(m, step).backward()
        g = o.param_groups[0]
        if edit == "lr":
            g["lr"] = LR * (1.0 + step)
        elif edit == "betas":
            g["betas"] = (0.8 + 0.02 * step, 0.99)
        elif edit == "eps":
            g["eps"] = 1e-3 * (step + 1)
        elif edit == "weight_decay":
            g["weight_decay"] = 0.05 * (step + 1)
        else:
            schedulers.setdefault(id(o), torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)).step()
        return True

    opt, _model = run_side_by_side(loop_backend, 4, body, what=edit)
    assert opt.loop_stats.redone_changed > 0, "no chunk was redone for the new hyper-parameters"


@pytest.mark.parametrize("which", ["one", "all_of_a_module", "tied_head", "with_clip"])
def test_streamed_grad_set_to_none_after_backward_skips_the_parameter(loop_backend, which):
    def names_to_drop(m, step):
        named = dict(m.named_parameters())
        if which == "one" or which == "with_clip":
            return ["gated.bias"] if step % 2 == 0 else ["shared.weight"]
        if which == "all_of_a_module":
            return [n for n in named if n.startswith("shared.")]
        return ["emb.weight"]  # the embedding tied to the head

    def body(m, o, step):
        _loss(m, step).backward()
        named = dict(m.named_parameters())
        for n in names_to_drop(m, step):
            named[n].grad = None
        if which == "with_clip":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        return True

    run_side_by_side(loop_backend, 4, body, what=f"grad None ({which})",
                     zero=lambda o: o.zero_grad(set_to_none=True))


def test_twice_net_has_the_parameters_these_tests_drop():
    names = dict(TwiceNet().named_parameters())
    for n in ("gated.bias", "shared.weight", "emb.weight"):
        assert n in names, sorted(names)


# ---------------------------------------------------------------- resident: edits of the weights
def _edit(model, step, how, saved):
    """One of the edits users make outside optimizer.step(), on `model`."""
    with torch.no_grad():
        if how == "data_clamp":  # WGAN's critic: invisible to torch's version counters
            for p in model.parameters():
                p.data.clamp_(-0.05, 0.05)
        elif how == "no_grad_rescale":
            model.fc1.weight.mul_(0.5)
        elif how == "reset_parameters":
            torch.manual_seed(100 + step)
            model.extra.reset_parameters()
        elif how == "load_state_dict":
            model.load_state_dict(saved)
        elif how == "permute_rows":  # keeps every sum: the version counter sees it
            model.head.weight.copy_(model.head.weight.flip(0))


@pytest.mark.parametrize("how", ["data_clamp", "no_grad_rescale", "reset_parameters",
                                 "load_state_dict", "permute_rows"])
@pytest.mark.parametrize("when", ["between_steps", "between_backward_and_step"])
def test_resident_weights_edited_outside_step_are_the_masters(fuyou_adamw, how, when):
    model, ref = make_pair()
    saved = copy.deepcopy(ref.state_dict())
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    for step in range(5):
        for m, o in ((ref, ref_opt), (model, opt)):
            edit_now = step in (1, 3)
            if edit_now and when == "between_steps":
                _edit(m, step, how, saved)
            loss_of(m, step).backward()
            if edit_now and when == "between_backward_and_step":
                _edit(m, step, how, saved)
            o.step()
            o.zero_grad(set_to_none=True)
        assert_matches(model, ref, step, f"{how} {when}")
    exported = opt.export_checkpoint()["model"]  # the masters, not only the weights
    for i, p in enumerate(ref.parameters()):
        assert torch.allclose(exported[i], p.detach(), rtol=RTOL, atol=ATOL), i


def test_resident_bf16_edit_keeps_the_fp32_master_where_nothing_changed(fuyou_adamw):
    """bf16 weights, fp32 masters: an edit of some elements of fc1 puts exactly
    those into the masters; every other master keeps its fp32 value (it is not
    replaced by its bf16 rounding)."""
    model, _ = make_pair(dtype=torch.bfloat16)
    opt = fuyou_adamw(model.parameters())
    for step in range(2):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    before = opt.export_checkpoint()["model"]
    names = [n for n, _ in model.named_parameters()]
    fc1 = names.index("fc1.weight")
    with torch.no_grad():
        model.fc1.weight.data[0].fill_(0.25)
    edits = opt._mode.edits
    edited = edits.edited()
    assert edited and all(any(seg.param is model.fc1.weight for seg in c.segments)
                          for c in edited), edited
    with opt._lock:
        edits.take_into_masters(edited)
    after = opt.export_checkpoint()["model"]
    expected = before[fc1].clone()
    expected[0] = 0.25
    assert torch.equal(after[fc1], expected)
    for i in range(len(names)):
        if i != fc1:
            assert torch.equal(after[i], before[i]), names[i]
    assert not torch.equal(before[fc1], before[fc1].to(torch.bfloat16).float())  # fp32 masters
    assert edits.edited() == []


# ---------------------------------------------------------------- freezing and unfreezing
@pytest.mark.parametrize("schedule", ["gradual_unfreezing", "freeze_then_unfreeze"])
def test_resident_parameters_frozen_at_construction_train_once_unfrozen(fuyou_adamw, schedule):
    """torch keeps every parameter of its groups and updates one from its first
    gradient on (fresh moments, step count 1): fuyou as well."""
    model, ref = make_pair()
    for m in (model, ref):
        if schedule == "gradual_unfreezing":  # the classic recipe: the top first
            for name in ("emb", "fc1", "ln1", "fc2"):
                getattr(m, name).requires_grad_(False)
    ref_opt = torch_adamw(ref.parameters())
    opt = fuyou_adamw(model.parameters(), track_frozen=True)
    for step in range(6):
        for m in (model, ref):
            if schedule == "gradual_unfreezing":
                if step == 2:
                    m.fc2.requires_grad_(True)
                    m.ln1.requires_grad_(True)
                if step == 4:
                    m.fc1.requires_grad_(True)
                    m.emb.requires_grad_(True)
            else:
                m.fc1.requires_grad_(step not in (1, 2))  # frozen mid-run, then back
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert_matches(model, ref, step, schedule)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i, st in ref_sd["state"].items():
        assert float(sd["state"][i]["step"]) == float(st["step"]), i


def test_resident_frozen_parameters_get_chunks_of_their_own(fuyou_adamw):
    model, _ = make_pair()
    model.emb.requires_grad_(False)
    opt = fuyou_adamw(model.parameters(), track_frozen=True)
    for c in opt._pipeline.plan.chunks:
        assert len({seg.param.requires_grad for seg in c.segments}) == 1, c
    assert any(seg.param is model.emb.weight for c in opt._pipeline.plan.chunks
               for seg in c.segments)


def test_resident_unfreezing_without_track_frozen_is_refused_at_step(daemon):
    """Frozen parameters cost nothing by default (a LoRA's frozen base passed
    with model.parameters()); unfreezing one then is refused, naming the route."""
    model, _ = make_pair()
    model.fc1.requires_grad_(False)
    with fuyou.AdamW(model.parameters(), address=daemon.address,
                     job=f"untracked-{next(_jobs)}") as opt:
        assert not any(seg.param is model.fc1.weight for c in opt._pipeline.plan.chunks
                       for seg in c.segments)
        loss_of(model, 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.fc1.requires_grad_(True)
        loss_of(model, 1).backward()
        with pytest.raises(fuyou.FailedPrecondition, match="track_frozen=True"):
            opt.step()
        assert opt.committed_step == 1  # nothing of the refused step was kept


def test_track_frozen_is_refused_where_it_cannot_work():
    """Data parallel: refused (with offload_params it streams the frozen
    parameters read-only: tests/python/test_hf_peft.py)."""
    from fuyou._groups import check_track_frozen
    with pytest.raises(NotImplementedError, match="is for one process"):
        check_track_frozen(True, offload_params=True, data_parallel=object())
    check_track_frozen(True, offload_params=True, data_parallel=None)


def test_streamed_parameter_frozen_at_construction_is_refused_once_it_has_a_gradient(
        stream_backend):
    from test_stream_parameters import offload_adamw
    torch.manual_seed(1)
    model = TwiceNet()
    model.shared.requires_grad_(False)
    opt = offload_adamw(stream_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB", prefetch=2)
    try:
        _loss(model, 0).backward()
        opt.step()
        opt.zero_grad()
        model.shared.requires_grad_(True)
        _loss(model, 1).backward()
        with pytest.raises(fuyou.FailedPrecondition,
                           match=r"frozen .*when the optimizer was built.*track_frozen=True would "
                                 r"stream it read-only.*build the optimizer with it requiring "
                                 r"grad and freeze it after construction"):
            opt.step()
        assert opt.committed_step == 1
    finally:
        handle.close()
        opt.close()


# ---------------------------------------------------------------- hyper-parameters checked early
def test_eps_zero_is_refused_at_construction_and_at_an_edit(fuyou_adamw):
    model, _ = make_pair()
    with pytest.raises(ValueError, match="eps=0 is not supported"):
        fuyou.AdamW(model.parameters(), eps=0.0, job="never-opened")  # before any connection
    opt = fuyou_adamw(model.parameters())
    opt.param_groups[0]["eps"] = 0.0
    loss_of(model, 0).backward()
    with pytest.raises(ValueError, match="group 0 .*eps=0 is not supported"):
        opt.step()
    opt.param_groups[0]["eps"] = 1e-8  # fixed: the step goes on
    opt.step()
    assert opt.committed_step == 1


@pytest.mark.parametrize("overlap", [True, False])
def test_sparse_gradients_are_refused_clearly(daemon, overlap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, overlap=overlap,
                      job=f"sparse-{overlap}")
    try:
        with pytest.raises(TypeError, match="does not support sparse gradients"):
            model(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()  # overlap off: no hook ran during backward
    finally:
        opt.close()


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s),
    lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-3, 1e-2, cycle_momentum=False),
    lambda o: torch.optim.lr_scheduler.SequentialLR(o, [torch.optim.lr_scheduler.LinearLR(o),
                                                        torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
                                                    milestones=[2]),
], ids=["OneCycleLR", "LambdaLR", "CyclicLR", "SequentialLR"])
def test_a_schedulers_state_dict_saves_with_torch_save(daemon, make, tmp_path):
    """torch 1.13's OneCycleLR kept a bound method that pickled the optimizer
    (refused: fuyou.AdamW cannot be pickled); torch 2's schedulers do not."""
    opt = fuyou.AdamW(nn.Linear(4, 4).parameters(), address=daemon.address,
                      job=f"sched-{tmp_path.name}")
    try:
        sched = make(opt)
        torch.save(sched.state_dict(), tmp_path / "sched.pt")
        sched.load_state_dict(torch.load(tmp_path / "sched.pt", weights_only=False))
    finally:
        opt.close()
