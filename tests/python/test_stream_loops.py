"""The loops torch users write, in the streamed mode (offload_params +
stream_parameters, overlap on), against torch.optim.AdamW (issue 19, item 2).

The gradients of a streamed chunk are sent during backward, journaled by the
daemon and freed; ``.grad`` is then a FreedGrad. Each test runs the same loop
on a resident model with torch.optim.AdamW and on the streamed model, and
compares every weight (the daemon's, export_checkpoint) after every step:
``|a - b| <= 1e-6 + 1e-5 |b|``. Every test also checks that updates were sent
during backward (the overlap was kept).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import fuyou
from fuyou._freed_grad import FreedGrad
from test_stream_parameters import (TwiceNet, assert_matches_daemon, offload_adamw,
                                    stream_backend, torch_adamw, twice_batch)  # noqa: F401


def _binding_journals() -> bool:
    try:
        from fuyou import _native
        return hasattr(_native.module().Session, "journal_stats")
    except Exception:
        return False


@pytest.fixture
def loop_backend(stream_backend):
    if stream_backend.name == "daemon" and not _binding_journals():
        pytest.skip("fuyou._fuyou.Session has no journal_stats (the gradient journal) yet")
    return stream_backend


def run_side_by_side(backend, steps, body, *, zero=lambda o: o.zero_grad(), sched=None,
                     opt_kw=None, what="", dtype=torch.float32, compare=None):
    """Trains TwiceNet twice with `body(model, opt, step)` (backward and what the
    loop does to .grad; returns whether step() is called), then step() and
    `zero(opt)`; compares after every step."""
    torch.manual_seed(1)
    model = TwiceNet().to(dtype)
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(backend, model.parameters(), **(opt_kw or {}))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB", prefetch=2)
    scheds = [sched(ref_opt), sched(opt)] if sched is not None else []
    try:
        for step in range(steps):
            for m, o in ((ref, ref_opt), (model, opt)):
                if body(m, o, step):
                    o.step()
                zero(o)
            for s in scheds:
                s.step()
            (compare or assert_matches_daemon)(opt, ref, step, what)
        assert opt.loop_stats.speculative_updates > 0, "no update was sent during backward"
        return opt, model
    finally:
        handle.close()
        opt.close()


def _loss(m, step, micro=0):
    return m(*twice_batch(step, micro=micro), step=step)


@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clips", "never-clips"])
def test_external_clip_grad_norm(loop_backend, max_norm):
    norms = {}

    def body(m, o, step):
        _loss(m, step).backward()
        norms.setdefault(step, []).append(float(torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                               max_norm)))
        return True

    opt, _ = run_side_by_side(loop_backend, 5, body, what=f"clip_grad_norm_({max_norm})")
    for step, (a, b) in norms.items():  # the norm clip_grad_norm_ returns is torch's
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)
    if max_norm < 1:
        assert opt.loop_stats.redone_changed > 0
    else:
        assert opt.loop_stats.redone_changed + opt.loop_stats.redone_clipped == 0


def test_external_clip_inf_norm(loop_backend):
    def body(m, o, step):
        _loss(m, step).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01, norm_type=math.inf)
        return True

    run_side_by_side(loop_backend, 3, body, what="clip_grad_norm_(inf)")


def test_manual_unscale(loop_backend):
    def body(m, o, step):
        (_loss(m, step) * 1024).backward()
        for p in m.parameters():
            if p.grad is not None:
                p.grad.div_(1024)
        return True

    run_side_by_side(loop_backend, 4, body, what="loss x 1024, grad.div_(1024)")


def test_grad_scaler_shaped_loop_with_a_skipped_step(loop_backend):
    """GradScaler's sequence by hand: scaled loss, inf check of every .grad,
    unscale, clip, step() or skip and halve the scale; an inf at step 2."""
    scales = {}

    def body(m, o, step):
        scale = scales.setdefault(id(o), [2.0 ** 12])
        hook = (m.shared.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
                if step == 2 else None)
        (_loss(m, step) * scale[0]).backward()
        if hook is not None:
            hook.remove()
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        found_inf = any(not bool(torch.isfinite(g).all()) for g in grads)
        if found_inf:
            scale[0] /= 2
            return False
        for g in grads:
            g.mul_(1.0 / scale[0])
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        return True

    opt, _ = run_side_by_side(loop_backend, 5, body, what="GradScaler-shaped")
    assert opt.committed_step == 4
    assert opt.loop_stats.rolled_back_skipped > 0


def test_grad_scalers_fused_unscale_on_freed_grads(loop_backend):
    """GradScaler.unscale_ calls torch._amp_foreach_non_finite_check_and_unscale_
    on every .grad (CUDA only for real tensors; the FreedGrads answer it anywhere):
    found_inf and the unscale as torch's manual equivalent."""
    found = []

    def body(m, o, step):
        (_loss(m, step) * 512).backward()
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        freed = [g for g in grads if isinstance(g, FreedGrad)]
        if freed:
            found_inf = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(freed, found_inf,
                                                             torch.tensor([1 / 512]))
            found.append(float(found_inf))
        for g in grads:  # torch's own op is CUDA only: the same by hand on the CPU
            if not isinstance(g, FreedGrad):
                g.mul_(1 / 512)
        return True

    opt, _ = run_side_by_side(loop_backend, 3, body, what="fused unscale")
    assert found == [0.0, 0.0, 0.0]
    assert opt.loop_stats.replayed > 0 and opt.loop_stats.journaled_bytes > 0


@pytest.mark.parametrize("passes", [2, 4])
def test_undeclared_accumulation_with_clip(loop_backend, passes):
    def body(m, o, step):
        for i in range(passes):
            (_loss(m, step, micro=i) / passes).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        return True

    opt, _ = run_side_by_side(loop_backend, 4, body, what=f"{passes} undeclared passes + clip")
    assert opt.pipeline.passes.passes_per_step == passes  # learned: later steps send at the last pass


def test_lr_scheduler_with_clip(loop_backend):
    def lam(step):
        return (step + 1) / 3 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 4))

    def body(m, o, step):
        _loss(m, step).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        return True

    run_side_by_side(loop_backend, 5, body, what="LambdaLR + clip",
                     sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam))


@pytest.mark.parametrize("zero", ["default", "set_to_none=False", "set_to_none=True"])
def test_parameters_without_gradient_with_each_zero_grad(loop_backend, zero):
    """TwiceNet's `sometimes` and gated bias get no gradient on odd steps: a
    zero .grad (zero_grad() on torch 1.13, set_to_none=False) updates them as
    torch does, None skips them."""
    calls = {"default": lambda o: o.zero_grad(),
             "set_to_none=False": lambda o: o.zero_grad(set_to_none=False),
             "set_to_none=True": lambda o: o.zero_grad(set_to_none=True)}

    def body(m, o, step):
        _loss(m, step).backward()
        return True

    run_side_by_side(loop_backend, 6, body, zero=calls[zero], what=f"zero_grad({zero})")


def test_model_zero_grad_between_steps(loop_backend):
    """HF's loop: model.zero_grad() (set_to_none=False on torch 1.13)."""
    models = {}

    def body(m, o, step):
        models[id(o)] = m
        _loss(m, step).backward()
        return True

    run_side_by_side(loop_backend, 4, body, zero=lambda o: models[id(o)].zero_grad(),
                     what="model.zero_grad()")


def test_bf16_clip_and_unscale_match_the_resident_run(loop_backend):
    """bf16 parameters: each in-place op rounds to bf16 in torch; the journal's
    replay rounds alike, so the streamed run is the resident fuyou run bit for bit."""
    def body(m, o, step):
        (_loss(m, step) * 64).backward()
        for p in m.parameters():
            if p.grad is not None:
                p.grad.div_(64)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        return True

    torch.manual_seed(1)
    model = TwiceNet().to(torch.bfloat16)
    resident_model = copy.deepcopy(model)
    resident = loop_backend.adamw(resident_model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1, chunk_bytes=8 << 10, num_slots=3)
    opt = offload_adamw(loop_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB", prefetch=2)
    try:
        for step in range(4):
            for m, o in ((resident_model, resident), (model, opt)):
                body(m, o, step)
                o.step()
                o.zero_grad()
            streamed = opt.export_checkpoint()["model"]
            for i, p in enumerate(resident_model.parameters()):
                assert torch.equal(streamed[i].to(torch.bfloat16), p.detach()), (step, i)
    finally:
        handle.close()
        opt.close()
        resident.close()


@contextlib.contextmanager
def streamed_twice_net(backend):
    """A streamed TwiceNet and its optimizer, closed afterwards."""
    torch.manual_seed(1)
    model = TwiceNet()
    opt = offload_adamw(backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        yield model, opt
    finally:
        handle.close()
        opt.close()


def test_freed_grad_answers_and_refuses(loop_backend):
    with streamed_twice_net(loop_backend) as (model, opt):
        _loss(model, 0).backward()
        g = model.shared.weight.grad
        assert isinstance(g, FreedGrad) and g.shape == (24, 24)
        assert bool(torch.isfinite(g).all()) and float(g.norm()) > 0
        with pytest.raises(fuyou.FuyouError, match="clip_grad_value_"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        with pytest.raises(fuyou.FuyouError, match="freed"):
            g.sum()
        opt.step()
        with pytest.raises(fuyou.FuyouError, match="after step"):
            g.mul_(2)
        opt.zero_grad()
        assert opt.committed_step == 1


def test_backward_without_zero_grad_after_step_is_refused(loop_backend):
    """torch would add the new gradients to the last step's, which fuyou freed."""
    with streamed_twice_net(loop_backend) as (model, opt):
        _loss(model, 0).backward()
        opt.step()
        with pytest.raises(RuntimeError, match="zero_grad"):
            _loss(model, 1).backward()
        opt.zero_grad()
        _loss(model, 1).backward()
        opt.step()
        opt.zero_grad()
        assert opt.committed_step == 2
