"""Moving one chunk's weights between its parameters and a packed tensor (the
layout of the chunk: its segments one after another), and its gradients from
``.grad`` into the parts a slot copy takes."""

from __future__ import annotations

import torch

from ._chunking import Chunk
from ._freed_grad import FreedGrad

__all__ = ["gather_weights", "install", "as_byte_buffer", "grad_parts"]


def gather_weights(c: Chunk) -> torch.Tensor:
    """The chunk's current weights, packed, on the CPU."""
    buf = torch.empty(c.num_elements, dtype=c.dtype)
    for seg in c.segments:
        buf[seg.offset:seg.offset + seg.numel].copy_(
            seg.param.detach().reshape(-1)[seg.start:seg.end])
    return buf


def install(c: Chunk, src: torch.Tensor, non_blocking: bool = False) -> None:
    """Copies packed weights `src` of chunk `c` into its parameters (on the
    current stream; `non_blocking`: the caller waits before `src` changes)."""
    for seg in c.segments:
        part = src[seg.offset:seg.offset + seg.numel]
        data = seg.param.data
        if data.is_contiguous():
            data.view(-1)[seg.start:seg.end].copy_(part, non_blocking=non_blocking)
        else:
            flat = data.reshape(-1).clone()
            flat[seg.start:seg.end].copy_(part)
            data.copy_(flat.view_as(data))


def as_byte_buffer(t: torch.Tensor):
    """A writable buffer over a contiguous CPU tensor's bytes (works for bfloat16)."""
    return t.view(torch.uint8).numpy()

def grad_parts(c: Chunk):
    """The chunk's gradients in ``.grad`` as copy parts (offset, numel, piece or
    None: zeros), the gradient tensors (for the device marker), and the
    segments without one (None, or a FreedGrad: nothing new in ``.grad``)."""
    parts, grads, missing = [], [], set()
    for i, seg in enumerate(c.segments):
        g = seg.param.grad
        if g is None or isinstance(g, FreedGrad):
            parts.append((seg.offset, seg.numel, None))
            missing.add(i)
        else:
            g = g.detach()
            grads.append(g)
            parts.append((seg.offset, seg.numel, g.reshape(-1)[seg.start:seg.end]))
    return parts, grads, missing
