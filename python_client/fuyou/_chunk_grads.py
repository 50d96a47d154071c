"""Writing a chunk's gradients, averaged over the data-parallel ranks, into
the parameters' ``.grad`` (what DDP leaves there after backward)."""

from __future__ import annotations

from typing import Container

import torch

from ._chunking import Chunk

__all__ = ["write_grads", "read_grads"]


@torch.no_grad()
def write_grads(c: Chunk, flat: torch.Tensor, skip: Container[int]) -> None:
    """Copies `flat` (laid out as chunk `c`) into the segments' ``.grad``, but
    the segments in `skip` (no rank has a gradient: ``.grad`` stays as it is).
    A parameter without ``.grad`` gets one, zeros outside this chunk's segment,
    as DDP gives a parameter that only other ranks had a gradient for."""
    for i, seg in enumerate(c.segments):
        if i in skip:
            continue
        p = seg.param
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        g = p.grad.detach()
        src = flat[seg.offset:seg.offset + seg.numel]
        if g.is_contiguous():
            g.view(-1)[seg.start:seg.end].copy_(src)
        else:  # a strided gradient: through a contiguous copy
            whole = g.reshape(-1).clone()
            whole[seg.start:seg.end].copy_(src)
            g.copy_(whole.view_as(g))


@torch.no_grad()
def read_grads(c: Chunk, flat: torch.Tensor) -> None:
    """Copies the segments' ``.grad`` into `flat` (laid out as chunk `c`),
    zeros where a parameter has none."""
    for seg in c.segments:
        piece = flat[seg.offset:seg.offset + seg.numel]
        g = seg.param.grad
        if g is None:
            piece.zero_()
        else:
            piece.copy_(g.detach().reshape(-1)[seg.start:seg.end])
