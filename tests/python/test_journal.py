"""The gradient journal at the binding's level (issue 19, streamed mode):
send_grad_ready's journal= and grad_ops=, journal_stats, and the module's
JOURNAL_* / GRAD_OP_* constants, on the in-process fake (fake_session.py) and
on a real fuyoud through fuyou._fuyou, so that the fake behaves as the daemon:
  - KEEP, then REPLAY with [(GRAD_OP_MUL, 0.5)] and junk in the slot's
    gradient region, gives the weights a fresh job gets from 0.5 * g, bit for
    bit; journal_stats has the journal's per-segment sum of squares and max |x|;
  - ADD adds the slot's gradients to the journal;
  - a journal ends with its step: a REPLAY in the next step is refused.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from fuyou._errors import FailedPrecondition
from fuyou._protocol import Hyper
from test_fetch_weights import job_name, opener  # noqa: F401  (a fixture)

DT_F32 = 1
N = 1000
SEGMENTS = [400, 600]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
JOURNAL_KEEP, JOURNAL_ADD, JOURNAL_REPLAY = 1, 2, 3
GRAD_OP_MUL, GRAD_OP_DIV = 1, 2


def register(session, weights):
    buf = bytearray(weights.numpy().tobytes())
    session.register_chunk(0, N, DT_F32, DT_F32, buf, segment_elements=SEGMENTS)


def send(session, step, grads, hyper=None, **kw):
    slot = session.acquire_slot(5.0)
    region = torch.frombuffer(session.grad_region(slot), dtype=torch.float32, count=N)
    if grads is None:
        region.fill_(float("nan"))  # junk: a replay must not read it
    else:
        region.copy_(grads)
    session.send_grad_ready(0, slot, step, Hyper(**HYPER) if hyper is None else hyper, **kw)
    assert session.wait_params(0, 10.0) == slot
    weights = torch.frombuffer(session.param_region(slot), dtype=torch.float32, count=N).clone()
    session.release_slot(slot)
    return weights


def bits_equal(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_binding_names_the_protocol_values():
    from fuyou import _fuyou
    assert (_fuyou.JOURNAL_KEEP, _fuyou.JOURNAL_ADD, _fuyou.JOURNAL_REPLAY) == (1, 2, 3)
    assert (_fuyou.GRAD_OP_MUL, _fuyou.GRAD_OP_DIV) == (1, 2)


def test_the_hyper_parameters_are_one_object_read_by_name(opener):
    """send_grad_ready takes a group's hyper-parameters as one object and reads
    lr, beta1, beta2, eps and weight_decay by name: any object with them gives
    the update a Hyper gives; one without them is refused before anything is sent."""
    w = torch.linspace(-1, 1, N)
    g = torch.linspace(-0.3, 0.2, N)
    session = opener(job_name("hyper"))
    register(session, w)
    slot = session.acquire_slot(5.0)
    no_eps = types.SimpleNamespace(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1)
    with pytest.raises(AttributeError):
        session.send_grad_ready(0, slot, 1, no_eps)
    session.release_slot(slot)
    by_name = send(session, 1, g, hyper=types.SimpleNamespace(**HYPER))
    session.end_step(1)
    reference = opener(job_name("hyper"))
    register(reference, w)
    assert bits_equal(by_name, send(reference, 1, g))


def test_keep_then_replay_is_the_update_from_the_scaled_gradients(opener):
    w = torch.linspace(-1, 1, N)
    g = torch.linspace(-0.3, 0.2, N)
    session = opener(job_name("journal"))
    register(session, w)
    send(session, 1, g, journal=JOURNAL_KEEP)
    stats = session.journal_stats(0)
    assert stats is not None
    replayed = send(session, 1, None, redo=1, journal=JOURNAL_REPLAY, grad_ops=[(GRAD_OP_MUL, 0.5)])
    sums, maxes = session.journal_stats(0)
    half = (g * 0.5).double()
    assert len(sums) == len(maxes) == 2
    for s, (begin, end) in enumerate([(0, 400), (400, 1000)]):
        assert math.isclose(sums[s], float((half[begin:end] ** 2).sum()), rel_tol=1e-12)
        assert maxes[s] == float(half[begin:end].abs().max())
    session.end_step(1)

    fresh = opener(job_name("fresh"))
    register(fresh, w)
    expected = send(fresh, 1, g * 0.5)
    assert bits_equal(replayed, expected)
    assert fresh.journal_stats(0) is None  # that update used no journal


def test_add_accumulates_and_a_journal_ends_with_its_step(opener):
    w = torch.linspace(-1, 1, N)
    g1 = torch.linspace(-0.3, 0.2, N)
    g2 = torch.linspace(0.1, -0.1, N)
    session = opener(job_name("add"))
    register(session, w)
    send(session, 1, g1, journal=JOURNAL_KEEP)
    added = send(session, 1, g2, redo=1, journal=JOURNAL_ADD)
    session.end_step(1)
    fresh = opener(job_name("fresh-add"))
    register(fresh, w)
    assert bits_equal(added, send(fresh, 1, g1 + g2))

    send(session, 2, g1)
    with pytest.raises(FailedPrecondition):
        send(session, 2, None, redo=1, journal=JOURNAL_REPLAY)
