"""What fuyou.AdamW tells the daemon in each training loop (issue 10): which chunk
updates are speculative, which are redone and why, which steps are abandoned and
why, which segments have no gradient. The fake session records every message;
the weights are compared with torch.optim.AdamW. The same loops on a real fuyoud
are tests/python/test_training_loops.py."""

import math

import pytest
import torch

from helpers import assert_models_close, clone_model, make_model
from train_util import CHUNK_BYTES, step_loss

RTOL = 1e-5
ATOL = 1e-6
REDO_CHANGED, REDO_CLIPPED = 1, 2
ABORT_SKIPPED, ABORT_OVERFLOW = 1, 2


def flags(session):
    """(chunk_id, segments_without_grad, speculative, redo) of every GradReady."""
    return [m[1:] for m in session.log if m[0] == "grad_ready_flags"]


def torch_pair(model):
    ref = clone_model(model)
    return ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)


def make_opt(fake_backend, model, **kw):
    import fake_session
    kw.setdefault("num_slots", 2)
    kw.setdefault("chunk_bytes", CHUNK_BYTES)
    kw.setdefault("lr", 1e-3)
    opt = fake_backend.adamw(model.parameters(), weight_decay=0.1, **kw)
    return opt, fake_session.open_fake.last


def test_unchanged_gradients_are_not_redone(fake_backend):
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model)
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            step_loss(m, step).backward()
            o.step()
            o.zero_grad()
        assert_models_close(model, ref, RTOL, ATOL, f"step {step}")
    sent = flags(session)
    assert len(sent) == 3 * opt.num_chunks
    assert all(speculative and redo == 0 for _, _, speculative, redo in sent)
    assert session.redone == [] and session.aborts == []
    stats = opt.loop_stats
    assert (stats.steps, stats.speculative_updates, stats.steps_with_redo) == (
        3, 3 * opt.num_chunks, 0)
    opt.close()


def test_a_gradient_changed_after_it_was_sent_is_redone_alone(fake_backend):
    """Only the chunk whose .grad changed between backward and step() is redone."""
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model, num_slots=64)
    target = opt.pipeline.plan.chunks[-1]  # the token embedding: sent last in backward
    for m, o in ((ref, ref_opt), (model, opt)):
        step_loss(m, 0).backward()
        m.tok.weight.grad.mul_(0.5)
        o.step()
    assert_models_close(model, ref, RTOL, ATOL)
    assert session.redone == [(target.chunk_id, REDO_CHANGED)]
    stats = opt.loop_stats
    assert (stats.redone_changed, stats.redone_clipped, stats.steps_with_redo) == (1, 0, 1)
    assert stats.redo_seconds > 0
    opt.close()


@pytest.mark.parametrize("max_norm,clips", [(1e-3, True), (1e6, False)])
def test_max_grad_norm_keeps_overlap(fake_backend, max_norm, clips):
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model, max_grad_norm=max_norm)
    for step in range(3):
        step_loss(ref, step).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        step_loss(model, step).backward()
        opt.pipeline.wait_sent()  # the hooks only enqueue; the sender thread sends
        sent_in_backward = len(flags(session))
        opt.step()
        opt.zero_grad()
        assert sent_in_backward > 0, "max_grad_norm turned overlap off"
        assert_models_close(model, ref, RTOL, ATOL, f"step {step}")
    n = opt.num_chunks
    assert session.redone == ([(c.chunk_id, REDO_CLIPPED) for c in opt.pipeline.plan.chunks] * 3
                              if clips else [])
    assert opt.loop_stats.redone_clipped == (3 * n if clips else 0)
    opt.close()


def test_a_chunk_both_changed_and_clipped_is_redone_once_as_changed(fake_backend):
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model, max_grad_norm=1e-3, num_slots=64)
    step_loss(ref, 0).backward()
    ref.tok.weight.grad.mul_(0.5)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    ref_opt.step()
    step_loss(model, 0).backward()
    model.tok.weight.grad.mul_(0.5)
    opt.step()
    assert_models_close(model, ref, RTOL, ATOL)
    reasons = dict(session.redone)
    assert len(session.redone) == opt.num_chunks
    assert reasons[opt.pipeline.plan.chunks[-1].chunk_id] == REDO_CHANGED
    assert sorted(reasons.values()).count(REDO_CLIPPED) == opt.num_chunks - 1
    opt.close()


def test_accumulation_is_learned_and_sent_after_the_kth_pass(fake_backend):
    k = 3
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model, num_slots=64)
    for step in range(4):
        for m, o in ((ref, ref_opt), (model, opt)):
            for i in range(k):
                before = len(flags(session))
                step_loss(m, step, micro=(k, i)).backward()
                if m is model:
                    opt.pipeline.wait_sent()  # the hooks only enqueue; the sender sends
                if m is model and step > 0:
                    # From the second step on, nothing is sent before the k-th pass.
                    assert (len(flags(session)) > before) == (i == k - 1), (step, i)
            o.step()
            o.zero_grad()
        assert_models_close(model, ref, RTOL, ATOL, f"step {step}")
    assert opt.pipeline.passes.passes_per_step == k
    # The first step's updates (sent after pass 1) were redone; no redo since.
    assert len(session.redone) == opt.num_chunks
    assert all(reason == REDO_CHANGED for _, reason in session.redone)
    assert opt.loop_stats.steps_with_redo == 1
    opt.close()


@pytest.mark.parametrize("how", ["opt.zero_grad", "model.zero_grad(None)",
                                 "model.zero_grad(zeros)"])
def test_a_skipped_step_is_aborted_as_skipped(fake_backend, how):
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model)
    for step in range(3):
        skip = step == 1
        for m, o in ((ref, ref_opt), (model, opt)):
            step_loss(m, step).backward()
            if skip:
                if how == "opt.zero_grad":
                    o.zero_grad()
                else:
                    m.zero_grad(set_to_none=how.endswith("(None)"))
                continue
            o.step()
            o.zero_grad()
        assert_models_close(model, ref, RTOL, ATOL, f"step {step}")
    assert session.aborts == [(2, ABORT_SKIPPED)]
    assert opt.committed_step == 2
    assert opt.loop_stats.rolled_back_skipped == opt.num_chunks
    assert opt.loop_stats.steps == 2
    opt.close()


def test_hand_written_grad_scaler_sequence(fake_backend):
    """scale the loss, unscale .grad in place, check finite, skip step() when not."""
    model = make_model()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model)
    scale = 2.0 ** 12
    for step in range(4):
        for m, o in ((ref, ref_opt), (model, opt)):
            handle = None
            if step == 2:
                handle = m.tok.weight.register_hook(lambda g: torch.full_like(g, math.inf))
            (step_loss(m, step) * scale).backward()
            if handle is not None:
                handle.remove()
            found_inf = False
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / scale)
                    found_inf |= not bool(torch.isfinite(p.grad).all())
            if not found_inf:
                o.step()
            o.zero_grad()
        assert_models_close(model, ref, RTOL, ATOL, f"step {step}")
    assert session.aborts == [(3, ABORT_SKIPPED)]
    assert opt.committed_step == 3
    opt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: the real "
                    "torch.cuda.amp.GradScaler needs a GPU (the hand-written sequence runs)")
def test_real_grad_scaler(fake_backend):
    model = make_model().cuda()
    ref, ref_opt = torch_pair(model)
    opt, session = make_opt(fake_backend, model)
    scalers = [torch.cuda.amp.GradScaler(init_scale=2.0 ** 12, growth_interval=2)
               for _ in range(2)]
    for step in range(5):
        for (m, o), scaler in zip(((ref, ref_opt), (model, opt)), scalers):
            handle = None
            if step == 2:
                handle = m.tok.weight.register_hook(lambda g: torch.full_like(g, math.inf))
            scaler.scale(step_loss(m, step)).backward()
            if handle is not None:
                handle.remove()
            scaler.unscale_(o)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        assert_models_close(model, ref, RTOL, ATOL, f"step {step}")
    assert session.aborts == [(3, ABORT_SKIPPED)]
    opt.close()


def test_fp16_overflow_aborts_as_overflow(fake_backend):
    model = make_model(dtype=torch.float16)
    opt, session = make_opt(fake_backend, model, loss_scale=2.0 ** 10)
    handle = model.tok.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    opt.scale_loss(step_loss(model, 0).float()).backward()
    handle.remove()
    opt.step()
    assert opt.skipped_steps == 1 and opt.committed_step == 0
    assert session.aborts == [(1, ABORT_OVERFLOW)]
    opt.close()


def test_a_parameter_without_gradient_is_named_and_keeps_its_step(fake_backend):
    """A parameter unused in a step shares a chunk with used ones: its segment is
    sent in segments_without_grad; torch keeps its weights, moments and step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    unused = torch.nn.Parameter(torch.randn(3))
    params = list(model.parameters()) + [unused]
    ref_params = [p.detach().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    opt, session = make_opt(fake_backend, torch.nn.ParameterList(params), chunk_bytes=1 << 20,
                            lr=1e-2)
    assert opt.num_chunks == 1
    chunk = opt.pipeline.plan.chunks[0]
    unused_segment = [i for i, s in enumerate(chunk.segments) if s.param is unused]
    x = torch.randn(5, 8)
    for step in range(4):
        use = step % 2 == 0
        for ps, o in ((ref_params, ref_opt), (params, opt)):
            w1, b1, w2, b2, u = ps
            y = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
            loss = y.square().sum() + ((u.sum() * 0.5) if use else 0.0)
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)
    missing = [f[1] for f in flags(session)]
    assert missing == [(), tuple(unused_segment), (), tuple(unused_segment)]
    counts = opt.pipeline.states.update_counts(chunk)
    assert counts[unused_segment[0]] == 2 and max(counts) == 4
    state = opt.export_checkpoint()["optimizer"]["state"]
    assert float(state[4]["step"]) == 2.0 and float(state[0]["step"]) == 4.0
    opt.close()


def test_segments_are_registered(fake_backend):
    import fake_session
    model = make_model()
    opt, _ = make_opt(fake_backend, model)
    chunks = fake_session.JOBS[opt.job]["chunks"]
    for c in opt.pipeline.plan.chunks:
        assert chunks[c.chunk_id]["segments"] == [s.numel for s in c.segments]
    opt.close()


def test_daemon_counts_what_loop_stats_counts(daemon):
    """fuyou.admin_stats() carries GetStats' speculation counters; over a loop with
    an external clip (redone as changed), max_grad_norm is not set, and a skipped
    step, the daemon's deltas equal the optimizer's loop_stats."""
    import fuyou
    model = make_model()
    before = fuyou.admin_stats(address=daemon.address)
    opt = fuyou.AdamW(model.parameters(), job=f"stats-{id(model)}", address=daemon.address,
                      chunk_bytes=CHUNK_BYTES, num_slots=2, timeout=20.0)
    for step in range(4):
        step_loss(model, step).backward()
        if step == 2:
            opt.zero_grad()  # skipped
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()
    loop = opt.loop_stats
    opt.close()
    after = fuyou.admin_stats(address=daemon.address)
    delta = {k: after[k] - before[k] for k in (
        "chunks_speculative", "chunks_redone_changed", "chunks_redone_clipped",
        "chunks_rolled_back_skipped_step")}
    assert loop.steps == 3 and loop.redone_changed == 3 * opt.num_chunks
    assert delta == {"chunks_speculative": loop.speculative_updates,
                     "chunks_redone_changed": loop.redone_changed,
                     "chunks_redone_clipped": loop.redone_clipped,
                     "chunks_rolled_back_skipped_step": loop.rolled_back_skipped}
    assert after["redo_seconds"] > before["redo_seconds"]
