"""The chunk pipeline's threads, on the CPU (issue 11): the gradient hooks only
enqueue, one sender thread copies and sends in hook order, step() waits for
everything, an error of the sender thread surfaces at the next hook or step(),
and close() with sends still queued ends cleanly.

The fake session blocks where the daemon would (a gate on wait_params or
send_grad_ready) so that "backward does not wait for the daemon" is a fact the
test observes (backward returns while the gate is closed), not a timing. A gate
that is never opened fails the test after 60 s instead of hanging it.
"""

from __future__ import annotations

import threading

import pytest
import torch

import fuyou
import fake_session
from fake_session import FakeError, FakeSession
from helpers import assert_models_close, clone_model, make_model
from train_util import CHUNK_BYTES, step_loss

RTOL, ATOL = 1e-5, 1e-6


class GatedSession(FakeSession):
    """A FakeSession whose `gated` calls wait until `gate` is set, and which can
    fail its n-th send_grad_ready."""

    def __init__(self, *a, gated=(), fail_send_at=None, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gated = set(gated)
        self.fail_send_at = fail_send_at
        self.sends = 0
        self.threads = set()
        if not self.gated:
            self.gate.set()

    def _pass_gate(self, name):
        if name in self.gated and not self.gate.wait(60):
            raise FakeError(f"test gate for {name} never opened")

    def send_grad_ready(self, chunk_id, slot, *a, **kw):
        self.threads.add(threading.get_ident())
        self._pass_gate("send_grad_ready")
        self.sends += 1
        if self.fail_send_at is not None and self.sends == self.fail_send_at:
            raise FakeError(f"injected failure sending chunk {chunk_id}")
        return super().send_grad_ready(chunk_id, slot, *a, **kw)

    def wait_params(self, chunk_id, timeout):
        self._pass_gate("wait_params")
        return super().wait_params(chunk_id, timeout)


def _open(monkeypatch, **kw):
    holder = {}

    def open_gated(job, num_slots, slot_bytes, client_info, address, rpc_timeout,
                   connect_timeout):
        holder["s"] = GatedSession(job, num_slots, slot_bytes, **kw)
        return holder["s"]

    fake_session.JOBS.clear()
    monkeypatch.setattr(fuyou._connection, "open_session", open_gated)
    return holder


def _adamw(params, **kw):
    kw.setdefault("chunk_bytes", CHUNK_BYTES)
    return fuyou.AdamW(params, job="threads", address="fake:local", timeout=20.0, **kw)


def test_grad_ready_in_hook_order_from_the_sender_thread_and_step_waits_for_all(monkeypatch):
    holder = _open(monkeypatch)
    model = make_model()
    ref = clone_model(model)
    opt = _adamw(model.parameters(), num_slots=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
    s = holder["s"]
    for step in range(3):
        step_loss(model, step).backward()
        enqueued = [c.chunk_id for c in opt.pipeline.step.sent_chunks()]  # hook order
        assert len(enqueued) == opt.num_chunks
        opt.step()
        sent = [m[1] for m in s.log if m[0] == "grad_ready" and m[2] == step + 1]
        assert sent == enqueued, "GradReady must go out in the order the hooks enqueued"
        assert s.log[-1] == ("end_step", step + 1)  # after every chunk's GradReady
        opt.zero_grad()
        step_loss(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_models_close(model, ref, rtol=RTOL, atol=ATOL, what=f"step {step}")
    assert threading.get_ident() not in s.threads, "GradReady sent from the autograd thread"
    opt.close()


def test_backward_completes_while_the_slots_are_exhausted(monkeypatch):
    # One slot: the second chunk needs the first one's new weights collected,
    # and wait_params is held closed. Backward must still return.
    holder = _open(monkeypatch, gated=("wait_params",))
    model = make_model()
    ref = clone_model(model)
    opt = _adamw(model.parameters(), num_slots=1)
    s = holder["s"]
    step_loss(model, 0).backward()  # returns: the hooks did not wait for a slot
    assert len(opt.pipeline.step.sent_chunks()) == opt.num_chunks
    assert s.sends <= 1, "the sender cannot have passed the closed gate"
    s.gate.set()
    opt.step()
    assert s.sends == opt.num_chunks and opt.committed_step == 1
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
    step_loss(ref, 0).backward()
    ref_opt.step()
    assert_models_close(model, ref, rtol=RTOL, atol=ATOL, what="step 0")
    opt.close()


def test_an_error_in_the_sender_thread_surfaces_at_step(monkeypatch):
    holder = _open(monkeypatch, gated=("send_grad_ready",), fail_send_at=2)
    model = make_model()
    opt = _adamw(model.parameters(), num_slots=4)
    step_loss(model, 0).backward()  # every hook ran before the sender failed
    holder["s"].gate.set()
    with pytest.raises(FakeError, match="injected failure"):
        opt.step()
    assert opt.pipeline.failed is not None
    with pytest.raises(fuyou.FailedPrecondition, match="failed earlier"):
        opt.step()
    opt.close()
    assert holder["s"].closed
    assert not opt.pipeline.slots.sender._thread.is_alive()


def test_an_error_in_the_sender_thread_surfaces_at_the_next_hook(monkeypatch):
    holder = _open(monkeypatch, gated=("send_grad_ready",), fail_send_at=1)
    model = make_model()
    opt = _adamw(model.parameters(), num_slots=4)
    step_loss(model, 0).backward()  # nothing sent yet: the gate is closed
    holder["s"].gate.set()
    with pytest.raises(FakeError, match="injected failure"):
        opt.pipeline.wait_sent()
    with pytest.raises(Exception, match="injected failure"):
        step_loss(model, 1).backward()  # the first hook that completes a chunk raises
    with pytest.raises(fuyou.FailedPrecondition):
        opt.step()
    opt.close()
    assert holder["s"].closed


def test_close_while_sends_are_queued(monkeypatch):
    holder = _open(monkeypatch, gated=("send_grad_ready",))
    model = make_model()
    opt = _adamw(model.parameters(), num_slots=2)
    s = holder["s"]
    step_loss(model, 0).backward()
    assert s.sends == 0
    s.gate.set()  # the sends run while close() waits for them
    opt.close()
    assert s.closed
    assert s.sends == opt.num_chunks
    assert s.aborts == [(1, 0)], "the step in progress is abandoned, not committed"
    assert sorted(s.free) == [0, 1], "every slot released"
    assert not opt.pipeline.slots.sender._thread.is_alive()
