"""Streamed working weights at the binding's level (issue 12): register_chunk's
store_weights, send_fetch_weights and wait_weights, the same on the in-process
fake (fake_session.py) and on a real fuyoud through fuyou._fuyou, so that the
fake the streaming tests use behaves as the daemon does:
  - a fetch gives the committed weights: the registered ones, then after each
    commit the weights ParamsReady returned, bit for bit;
  - a fetch during a step, after the chunk's own update, still gives the
    committed (previous) weights; after an abort too;
  - a chunk without store_weights, a slot not held, a resume with the other
    store_weights are refused (FailedPrecondition).
"""

from __future__ import annotations

import os

import pytest
import torch

import fuyou
from fake_session import FakeSession
from fuyou._protocol import Hyper

DT_BF16 = 2
DT_F32 = 1
N = 1000
SLOT_BYTES = 4096
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(params=["fake", "daemon"])
def opener(request):
    """opener(job) -> a session object with the binding's methods."""
    if request.param == "fake":
        import fake_session
        fake_session.JOBS.clear()
        return lambda job, slots=3: FakeSession(job, slots, SLOT_BYTES)
    d = request.getfixturevalue("daemon")
    from fuyou import _fuyou
    return lambda job, slots=3: _fuyou.Session.open(job, slots, SLOT_BYTES, address=d.address,
                                                    rpc_timeout=20.0)


_jobs = iter(range(10**6))


def job_name(prefix):
    return f"{prefix}-{os.getpid()}-{next(_jobs)}"


def bf16(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def region(session, slot, dtype=torch.bfloat16, n=N):
    return torch.frombuffer(session.param_region(slot), dtype=dtype, count=n).clone()


def register(session, chunk_id, weights, store_weights=True):
    buf = bytearray(weights.view(torch.uint8).numpy().tobytes())
    resumed, _, _ = session.register_chunk(chunk_id, weights.numel(), DT_BF16, DT_F32, buf,
                                           store_weights=store_weights)
    return resumed, torch.frombuffer(buf, dtype=torch.bfloat16).clone()


def fetch(session, chunk_id):
    slot = session.acquire_slot(5.0)
    session.send_fetch_weights(chunk_id, slot)
    got = session.wait_weights(chunk_id, 10.0)
    assert got == slot
    weights = region(session, got)
    session.release_slot(got)
    return weights


def update(session, chunk_id, step, grads):
    """GradReady of the chunk; returns the weights ParamsReady gave."""
    slot = session.acquire_slot(5.0)
    torch.frombuffer(session.grad_region(slot), dtype=torch.float32, count=N).copy_(grads)
    session.send_grad_ready(chunk_id, slot, step, Hyper(**HYPER))
    assert session.wait_params(chunk_id, 10.0) == slot
    weights = region(session, slot)
    session.release_slot(slot)
    return weights


def bits_equal(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_fetch_gives_the_committed_weights(opener):
    session = opener(job_name("fetch"))
    initial = bf16([0.01 * (i % 97) - 0.4 for i in range(N)])
    resumed, _ = register(session, 1, initial)
    assert not resumed
    assert bits_equal(fetch(session, 1), initial)

    committed = initial
    for step in (1, 2, 3):
        grads = torch.linspace(-1, 1, N) * step
        new = update(session, 1, step, grads)
        assert not bits_equal(new, committed)
        # The step's update is not committed: the fetch gives the previous weights.
        assert bits_equal(fetch(session, 1), committed)
        session.end_step(step)
        assert bits_equal(fetch(session, 1), new)
        committed = new

    # An aborted step leaves the committed weights.
    update(session, 1, 4, torch.ones(N))
    session.abort_step(4)
    assert bits_equal(fetch(session, 1), committed)
    session.close()


def test_a_resume_gets_the_committed_weights_and_keeps_store_weights(opener):
    job = job_name("resume")
    session = opener(job)
    register(session, 1, bf16([0.5] * N))
    register(session, 2, bf16([0.25] * N), store_weights=False)
    new = update(session, 1, 1, torch.ones(N))
    session.end_step(1)
    session.close()

    session = opener(job)
    resumed, weights = register(session, 1, bf16([0.0] * N))
    assert resumed
    assert bits_equal(weights, new)
    assert bits_equal(fetch(session, 1), new)
    # A chunk created without store_weights: no fetch, no resume with it.
    with pytest.raises(fuyou.FailedPrecondition):
        register(session, 2, bf16([0.0] * N), store_weights=True)
    session.close()

    session = opener(job)
    with pytest.raises(fuyou.FailedPrecondition, match="store_weights"):
        register(session, 1, bf16([0.0] * N), store_weights=False)
    session.close()


def test_bad_fetches_are_refused(opener):
    session = opener(job_name("bad"))
    register(session, 1, bf16([1.0] * N))
    register(session, 2, bf16([1.0] * N), store_weights=False)
    slot = session.acquire_slot(5.0)
    with pytest.raises(fuyou.FailedPrecondition, match="store_weights"):
        session.send_fetch_weights(2, slot)
    with pytest.raises(fuyou.InvalidArgument):
        session.send_fetch_weights(7, slot)
    free = next(s for s in range(3) if s != slot)
    with pytest.raises(fuyou.FailedPrecondition):
        session.send_fetch_weights(1, free)  # not acquired
    session.send_fetch_weights(1, slot)
    assert session.wait_weights(1, 10.0) == slot
    session.release_slot(slot)
    with pytest.raises(fuyou.FailedPrecondition):
        session.wait_weights(1, 0.1)  # nothing in flight
    session.close()
