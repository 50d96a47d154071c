"""step() of a data-parallel rank whose chunks fuyou averaged during backward
(_dp_overlap.py), after ``ChunkReductions.settle``: the loss scaler's overflow
and ``max_grad_norm`` agreed over the ranks, the own chunks sent or redone,
every rank committing or skipping alike."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _native
from ._chunking import Chunk
from ._mode import clip_coefficient
from ._protocol import ABORT_OVERFLOW, REDO_CLIPPED, REDO_GRADIENTS_CHANGED

__all__ = ["finish_reduced_step"]


def _own_squares(reductions, chunks: List[Chunk]) -> float:
    """The sum of squares of this rank's averaged chunks (fp64)."""
    total = 0.0
    for c in chunks:
        flat = reductions.averaged(c)[0]
        if flat.device.type == "cpu" and flat.dtype == torch.float32:
            total += _native.module().sum_and_squares([(flat.data_ptr(), flat.numel())])[1]
        else:
            total += float(flat.double().square().sum())
    return total


def _own_finite(reductions, chunks: List[Chunk]) -> bool:
    flags = [torch.isfinite(reductions.averaged(c)[0]).all() for c in chunks]
    return not flags or bool(torch.stack(flags).all())


def _agree(reductions, squares: float, overflow: bool) -> Tuple[float, bool]:
    """(the ranks' sums of squares summed, whether any rank overflowed): one
    all-reduce."""
    t = reductions.all_reduce(torch.tensor([squares, 1.0 if overflow else 0.0],
                                           dtype=torch.float64), dist.ReduceOp.SUM)
    return float(t[0]), bool(t[1] > 0)


def finish_reduced_step(pipeline, reductions, scaler,
                        max_grad_norm: Optional[float], before_commit) -> bool:
    """step() of a rank whose chunks fuyou averaged (after ``settle``): an
    inf/nan in any averaged chunk (loss scaling) or a non-finite norm skips the
    step on every rank (one all-reduce of [sum of squares, overflow]);
    ``max_grad_norm`` clips by the norm of the averaged gradients; a chunk sent
    during backward is redone when it changed since (reduced again, or edited
    alike on every rank), its group's hyper-parameters changed, or the norm
    clipped. Every rank commits or skips alike: ``before_commit(True)`` once
    the own chunks' updates are answered (the ranks' agreement, which raises
    when another rank is not ready), ``before_commit(False)`` when they
    failed here. Returns whether committed."""
    own = pipeline.plan.chunks
    if reductions.gate is not None:
        reductions.gate.finish()  # every rank's last step durable before a send
    reductions.wait_all()
    pipeline.wait_sent()  # the sends of backward, and the sender's inf/nan check
    clipping = max_grad_norm is not None
    squares = _own_squares(reductions, own) if clipping else 0.0
    overflow = pipeline.step.overflow or (scaler.enabled and not _own_finite(reductions, own))
    total, overflow = _agree(reductions, squares, overflow)
    coef = 1.0
    if not overflow and clipping:
        coef = clip_coefficient([total], max_grad_norm, scaler)
        overflow = not math.isfinite(coef)
    if overflow:
        pipeline.abort(ABORT_OVERFLOW)
        scaler.update(overflow=True)
        return False
    grad_scale = coef / scaler.scale
    try:
        for c in own:
            packed = reductions.averaged(c)
            sent = pipeline.step.sent.get(c.chunk_id)
            if sent is None:
                pipeline.send(c, grad_scale, packed=packed)
            elif reductions.changed(c) or sent.hyper != pipeline.hyper_now(c.group_index):
                pipeline.redo(c, grad_scale, REDO_GRADIENTS_CHANGED, packed=packed)
            elif coef < 1.0:
                pipeline.redo(c, grad_scale, REDO_CLIPPED, packed=packed)
        pipeline.wait_sent()
    except BaseException:
        before_commit(False)
        raise
    before_commit(True)
    pipeline.commit()
    scaler.update(overflow=False)
    return True
