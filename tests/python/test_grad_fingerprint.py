"""The resident mode's gradient fingerprint (_fingerprints.fingerprint): float32
CPU gradients go through the binding's one-pass sum_and_squares, others through
torch; both must see every change and give the same value for the same bits."""

import types

import pytest
import torch

from fuyou import _native
from fuyou._chunking import plan_chunks
from fuyou._fingerprints import changed_chunks, fingerprint


def _chunks(params, chunk_bytes=4096):
    return plan_chunks([params], chunk_bytes)[0]


def _model_with_grads(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in (1000, 37, 2048)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_sum_and_squares_is_the_double_sum_read_once():
    values = torch.randn(100_003, dtype=torch.float32)
    total, squares = _native.module().sum_and_squares([(values.data_ptr(), values.numel())])
    as_double = values.double()
    assert total == pytest.approx(as_double.sum().item(), rel=1e-12, abs=1e-9)
    assert squares == pytest.approx(as_double.square().sum().item(), rel=1e-12)
    # Pieces add up in order: two halves give the same as the whole to rounding.
    half = 50_000
    a, b = values[:half], values[half:]
    total2, squares2 = _native.module().sum_and_squares([(a.data_ptr(), a.numel()), (b.data_ptr(), b.numel())])
    assert total2 == pytest.approx(total, rel=1e-12, abs=1e-9)
    assert squares2 == pytest.approx(squares, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_gradients_give_the_same_fingerprint_and_a_change_is_seen(dtype):
    params = _model_with_grads(dtype)
    chunks = _chunks(params)
    before = [fingerprint(c) for c in chunks]
    again = [fingerprint(c) for c in chunks]
    for x, y in zip(before, again):
        assert torch.equal(x, y)
    params[2].grad[1234] += 1e-3 if dtype == torch.float32 else 0.25
    after = [fingerprint(c) for c in chunks]
    changed = [i for i, (x, y) in enumerate(zip(before, after)) if not torch.equal(x, y)]
    owner = [i for i, c in enumerate(chunks) if any(s.param is params[2] and s.start <= 1234 < s.end
                                                     for s in c.segments)]
    assert changed == owner


def test_float32_cpu_fingerprints_come_from_the_binding():
    params = _model_with_grads(torch.float32)
    chunk = _chunks(params, chunk_bytes=1 << 20)[0]
    fp = fingerprint(chunk)
    assert fp.dtype == torch.float64  # the binding's double, not torch's fp32 reductions
    grads = torch.cat([p.grad.reshape(-1).double() for p in params])
    assert fp[0].item() == pytest.approx(grads.sum().item(), rel=1e-9, abs=1e-9)
    assert fp[1].item() == pytest.approx(grads.square().sum().item(), rel=1e-9)


def test_changed_chunks_sees_an_in_place_clip_and_reports_the_squares():
    params = _model_with_grads(torch.float32)
    chunks = _chunks(params)
    # What changed_chunks reads of a sent chunk's record (_slots.Sent).
    sent = {c.chunk_id: types.SimpleNamespace(missing=(), fingerprint=fingerprint(c), hyper=None)
            for c in chunks}
    changed, squares = changed_chunks(chunks, sent, lambda group: None)
    assert changed == []
    total = sum(squares.values())
    assert total == pytest.approx(sum(p.grad.double().square().sum().item() for p in params), rel=1e-9)
    torch.nn.utils.clip_grad_norm_(params, max_norm=total ** 0.5 / 2)
    changed, _ = changed_chunks(chunks, sent, lambda group: None)
    assert sorted(c.chunk_id for c in changed) == sorted(c.chunk_id for c in chunks)
