"""Gradient fingerprints of the resident mode: speculate, validate, redo.

A chunk sent during backward leaves a fingerprint of its gradients (sum and
sum of squares, on the gradients' device, not waited for). At step()
``changed_chunks`` takes them again from ``.grad`` in one pass and one wait for
the device: a chunk whose fingerprint, missing gradients or group
hyper-parameters differ was changed after it was sent and must be redone."""

from __future__ import annotations

import collections
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _native
from ._chunking import Chunk
from ._protocol import Hyper

__all__ = ["fingerprint", "missing_grads", "changed_chunks", "same_values"]


def missing_grads(c: Chunk) -> Tuple[int, ...]:
    """The chunk's segments whose parameter has no gradient."""
    return tuple(i for i, seg in enumerate(c.segments) if seg.param.grad is None)


def fingerprint(c: Chunk) -> Optional[torch.Tensor]:
    """[sum, sum of squares] of the chunk's current gradients on their device
    (None: no gradient at all), without waiting for the device. float32 CPU
    gradients are read once, in double, by the binding (``sum_and_squares``);
    others take two fp32 reductions in torch. The same gradients always give the
    same fingerprint."""
    pieces = []
    for seg in c.segments:
        g = seg.param.grad
        if g is None:
            continue
        g = g.detach()
        pieces.append(g.reshape(-1) if seg.numel == g.numel() else g.reshape(-1)[seg.start:seg.end])
    if not pieces:
        return None
    if all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in pieces):
        total, squares = _native.module().sum_and_squares([(p.data_ptr(), p.numel()) for p in pieces])
        return torch.tensor((total, squares), dtype=torch.float64)
    sums = [torch.sum(p, dtype=torch.float32) for p in pieces]
    squares = [torch.linalg.vector_norm(p, dtype=torch.float32).square() for p in pieces]
    if len(sums) == 1:
        return torch.stack((sums[0], squares[0]))
    return torch.stack((torch.stack(sums).sum(), torch.stack(squares).sum()))


def changed_chunks(chunks: List[Chunk], sent: Dict[int, object],
                   hyper_now: Callable[[int], Hyper]) -> Tuple[List[Chunk], Dict[int, float]]:
    """Of `chunks`, those sent speculatively (`sent`: chunk id -> _slots.Sent)
    whose gradients changed since, and every chunk's current sum of squares
    (chunks without any gradient left out), in one pass over the gradients and
    one wait for the device."""
    now = [fingerprint(c) for c in chunks]
    by_device: Dict[torch.device, list] = collections.defaultdict(list)
    changed: List[Chunk] = []
    for c, fp in zip(chunks, now):
        s = sent.get(c.chunk_id)
        if s is not None and s.fingerprint is not None:
            if s.missing != missing_grads(c) or (fp is None) != (s.fingerprint is None) \
                    or s.hyper != hyper_now(c.group_index):
                changed.append(c)  # or lr, betas, ... set between backward and step()
            elif fp is not None:
                by_device[fp.device].append((c, torch.stack((fp, s.fingerprint))))
        if fp is not None:
            by_device[fp.device].append((c, fp))
    sums_of_squares: Dict[int, float] = {}
    for items in by_device.values():
        flat = torch.cat([t.reshape(-1) for _, t in items]).cpu().tolist()
        pos = 0
        for c, t in items:
            n = t.numel()
            values = flat[pos:pos + n]
            pos += n
            if n == 2:
                sums_of_squares[c.chunk_id] = values[1]
            elif not same_values(values[0:2], values[2:4]):
                changed.append(c)
    return changed, sums_of_squares


def same_values(a: Sequence[float], b: Sequence[float]) -> bool:
    """Exact equality of two fingerprints; nan equals nan (the same gradients)."""
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))
