"""Mixed precision, loss scaling, overflow skips, clipping, accumulation (issue 3 (b))."""

import pytest
import torch

from helpers import (assert_models_close, clone_model, global_rel_diff, make_model,
                     max_rel_diff)
from train_util import CHUNK_BYTES, split_groups, step_loss

RTOL = 1e-5
ATOL = 1e-7
STEPS = 12
# bf16 keeps 8 bits of mantissa (relative rounding 2**-9 = 2e-3), fp16 11 bits
# (2**-12 = 2.4e-4). Stated tolerances against an fp32 run of torch.optim.AdamW
# from the same initial weights and batches, at every step of STEPS:
#   weights: ||w - w_fp32|| / ||w_fp32|| over all parameters (measured: bf16
#            about 4e-3, fp16 about 4e-4 after 12 steps);
#   loss:    relative difference.
WEIGHT_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
LOSS_TOL = {torch.bfloat16: 1e-3, torch.float16: 1e-4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tracks_fp32(backend, dtype):
    ref = make_model()
    model = make_model(dtype=dtype)
    ref_opt = torch.optim.AdamW(split_groups(ref))
    loss_scale = "dynamic" if dtype == torch.float16 else None
    opt = backend.adamw(split_groups(model), chunk_bytes=CHUNK_BYTES, loss_scale=loss_scale)
    assert all(c.dtype == dtype for c in opt.pipeline.plan.chunks)
    worst = 0.0
    for step in range(STEPS):
        loss = step_loss(model, step)
        ref_loss = step_loss(ref, step)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=LOSS_TOL[dtype])
        opt.scale_loss(loss).backward()
        skipped = opt.skipped_steps
        opt.step()
        opt.zero_grad()
        if opt.skipped_steps == skipped:  # the reference steps when fuyou did
            ref_loss.backward()
            ref_opt.step()
        ref_opt.zero_grad()
        diff = global_rel_diff(model, ref)
        worst = max(worst, diff)
        assert diff < WEIGHT_TOL[dtype], f"step {step}: relative difference {diff:.2e}"
        assert all(p.dtype == dtype for p in model.parameters())
    assert opt.skipped_steps <= 2
    print(f"[{backend.name}] {dtype}: worst relative difference to fp32 {worst:.2e}, "
          f"skipped {opt.skipped_steps}, loss scale {opt.loss_scale}")
    opt.close()


def _poison(param):
    """Makes `param`'s gradient inf in the next backward (before accumulation)."""
    return param.register_hook(lambda g: torch.full_like(g, float("inf")))


def _chunk_updates(backend):
    """Chunk updates applied so far (even those later rolled back)."""
    if backend.name == "fake":
        import fake_session
        return sum(1 for m in fake_session.open_fake.last.log if m[0] == "grad_ready")
    import fuyou
    return fuyou.admin_stats(backend.address)["chunk_updates"]


def test_overflow_skips_the_step_on_every_chunk(backend):
    ref = make_model()
    model = clone_model(ref)
    ref_opt = torch.optim.AdamW(split_groups(ref))
    opt = backend.adamw(split_groups(model), chunk_bytes=CHUNK_BYTES, loss_scale="dynamic",
                        num_slots=3)
    # A parameter in the middle of the backward order: chunks after the last layers
    # are sent (and updated by the daemon) before the overflow is seen.
    victim = model.blocks[0].fc.weight
    for step in range(6):
        scale_before = opt.loss_scale
        committed_before = opt.committed_step
        before = [p.detach().clone() for p in model.parameters()]
        handle = _poison(victim) if step == 2 else None
        updates_before = _chunk_updates(backend)
        opt.scale_loss(step_loss(model, step)).backward()
        if handle is not None:
            handle.remove()
        opt.step()
        opt.zero_grad()
        if step == 2:
            # The daemon did update chunks in the skipped step before the overflow
            # was seen, so the rollback had something to undo.
            assert _chunk_updates(backend) - updates_before >= 3
            assert opt.skipped_steps == 1
            assert opt.loss_scale == scale_before / 2
            assert opt.committed_step == committed_before
            for p, b in zip(model.parameters(), before):
                assert torch.equal(p, b), "a weight changed in a skipped step"
            continue
        step_loss(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # The chunks the daemon updated before the overflow were rolled back:
        # later steps still agree with torch, which never took the bad step.
        assert_models_close(model, ref, rtol=RTOL, atol=ATOL, what=f"step {step}")
    assert opt.skipped_steps == 1 and opt.committed_step == 5
    opt.close()


@pytest.mark.parametrize("loss_scale", [None, 1024.0])
def test_clipping_matches_clip_grad_norm(backend, loss_scale):
    ref = make_model()
    model = clone_model(ref)
    max_norm = 0.3
    ref_opt = torch.optim.AdamW(split_groups(ref))
    opt = backend.adamw(split_groups(model), chunk_bytes=CHUNK_BYTES, max_grad_norm=max_norm,
                        loss_scale=loss_scale)
    clipped = 0
    for step in range(10):
        step_loss(ref, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        clipped += int(norm > max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.scale_loss(step_loss(model, step)).backward()
        opt.step()
        opt.zero_grad()
        assert_models_close(model, ref, rtol=RTOL, atol=ATOL, what=f"step {step}")
    assert clipped >= 5, "the test should exercise clipping"
    opt.close()


def test_accumulation_equals_large_batch(backend):
    k = 4
    ref = make_model()
    big = clone_model(ref)
    model = clone_model(ref)
    ref_opt = torch.optim.AdamW(split_groups(ref))
    big_opt = torch.optim.AdamW(split_groups(big))
    opt = backend.adamw(split_groups(model), chunk_bytes=CHUNK_BYTES, accumulation_steps=k)
    for step in range(6):
        for i in range(k):
            (step_loss(ref, step, micro=(k, i), batch_size=8) / k).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        step_loss(big, step, batch_size=8).backward()
        big_opt.step()
        big_opt.zero_grad()
        for i in range(k):
            (step_loss(model, step, micro=(k, i), batch_size=8) / k).backward()
        opt.step()
        opt.zero_grad()
        assert opt.committed_step == step + 1
        assert_models_close(model, ref, rtol=RTOL, atol=ATOL, what=f"step {step}")
        # One 4x batch: the same up to the order of the gradient sums.
        assert max_rel_diff(model, big) < 1e-4
    opt.close()


def test_hooks_send_during_backward_and_only_at_the_kth(fake_backend):
    import fake_session
    model = make_model()
    opt = fake_backend.adamw(model.parameters(), chunk_bytes=CHUNK_BYTES, accumulation_steps=3,
                             num_slots=64)
    log = fake_session.open_fake.last.log
    for i in range(3):
        step_loss(model, 0, micro=(3, i), batch_size=6).backward()
        opt.pipeline.wait_sent()  # the hooks only enqueue; the sender thread sends
        sent = [m for m in log if m[0] == "grad_ready"]
        assert len(sent) == (opt.num_chunks if i == 2 else 0)
    # Arrival order follows backward: the first chunk sent holds the last layers.
    assert sent[0][1] == opt.pipeline.plan.chunks[0].chunk_id
    opt.step()
    assert log[-1] == ("end_step", 1)
