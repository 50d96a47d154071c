"""Packing of parameters into chunks (pure Python)."""

import torch
import torch.nn as nn

from fuyou._chunking import GROUP_SHIFT, plan_chunks
from fuyou._loss_scale import make_loss_scaler
from helpers import make_model


def _covered(chunks, params):
    """Every element of every trainable param lies in exactly one chunk segment."""
    seen = {id(p): torch.zeros(p.numel(), dtype=torch.int32) for p in params}
    for c in chunks:
        off = 0
        for s in c.segments:
            assert s.offset == off
            off += s.numel
            seen[id(s.param)][s.start:s.end] += 1
        assert off == c.num_elements
    return all(bool((v == 1).all()) for v in seen.values())


def test_chunks_respect_size_and_cover_every_element():
    model = make_model()
    params = list(model.parameters())
    chunks, unique = plan_chunks([params], 8 << 10)
    assert len(chunks) > 10
    assert all(c.nbytes <= 8 << 10 for c in chunks)
    assert _covered(chunks, unique)
    # Reverse order: the first chunk holds the last parameter.
    assert chunks[0].segments[0].param is params[-1]


def test_tied_and_frozen_params():
    model = make_model()
    model.pos.weight.requires_grad_(False)
    # tok.weight appears twice (tied head); pass it twice explicitly as well.
    params = list(model.parameters()) + [model.head.weight]
    chunks, unique = plan_chunks([params], 8 << 10)
    ids = [id(p) for p in unique]
    assert len(ids) == len(set(ids))
    assert id(model.pos.weight) not in ids
    assert id(model.tok.weight) in ids
    assert all(s.param is not model.pos.weight for c in chunks for s in c.segments)
    assert _covered(chunks, unique)


def test_groups_and_dtypes_never_mix():
    a = [nn.Parameter(torch.randn(10)), nn.Parameter(torch.randn(10, dtype=torch.bfloat16)),
         nn.Parameter(torch.randn(10))]
    b = [nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(5, dtype=torch.float16))]
    chunks, unique = plan_chunks([a, b], 1 << 20)
    for c in chunks:
        assert len({s.param.dtype for s in c.segments}) == 1
        assert all(s.param.dtype == c.dtype for s in c.segments)
    groups = {c.chunk_id >> GROUP_SHIFT for c in chunks}
    assert groups == {0, 1}
    for c in chunks:
        members = a if c.group_index == 0 else b
        assert all(any(s.param is p for p in members) for s in c.segments)


def test_large_param_is_split_and_ids_are_stable():
    big = nn.Parameter(torch.randn(1000))
    small = nn.Parameter(torch.randn(3))
    chunks, unique = plan_chunks([[small, big]], 256 * 4)
    assert [c.num_elements for c in chunks] == [256, 256, 256, 235]
    assert _covered(chunks, unique)
    again, _ = plan_chunks([[nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(1000))]],
                           256 * 4)
    assert [c.chunk_id for c in chunks] == [c.chunk_id for c in again]
    assert [c.chunk_id for c in chunks] == [0, 1, 2, 3]


def test_loss_scaler_schedule():
    s = make_loss_scaler("dynamic")
    assert s.scale == 2.0 ** 16
    s.update(overflow=True)
    assert s.scale == 2.0 ** 15
    for _ in range(2000):
        s.update(overflow=False)
    assert s.scale == 2.0 ** 16
    static = make_loss_scaler(128.0)
    static.update(True)
    assert static.scale == 128.0
    assert make_loss_scaler(None).scale == 1.0
