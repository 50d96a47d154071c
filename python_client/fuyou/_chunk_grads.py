"""A chunk's gradients averaged over the data-parallel ranks (``ChunkAverage``:
one all-reduce of the chunk's gradients and a presence flag per segment), and
the average written into the parameters' ``.grad`` (what DDP leaves there
after backward) or read back from it. Shared by the resident mode's rounds
(_dp_overlap.py) and the streamed mode's passes (_dp_pass_reductions.py)."""

from __future__ import annotations

from typing import Container, Tuple

import torch
import torch.distributed as dist

from ._chunking import Chunk

__all__ = ["ChunkAverage", "write_grads", "read_grads"]


class ChunkAverage:
    """One chunk's all-reduce over `group`: ``flat`` holds this rank's
    gradients as the chunk lays them out (zeros where a parameter has none),
    then one flag per segment, 1 where this rank has a gradient; gloo sums in
    fp32. Once ``finish``ed, ``flat`` is the average (the sum divided by the
    world size, as DDP averages) and ``missing`` the segments no rank has a
    gradient for (not updated, as torch leaves such a parameter)."""

    __slots__ = ("flat", "work", "missing", "finished")

    def __init__(self, c: Chunk, dp, group):
        dev = dp._device(c.segments[0].param)
        dtype = c.dtype if dev.type == "cuda" else torch.float32  # gloo: sums in fp32
        n = c.num_elements
        flat = torch.empty(n + len(c.segments), dtype=dtype, device=dev)
        read_grads(c, flat)
        flat[n:] = torch.tensor([0.0 if seg.param.grad is None else 1.0 for seg in c.segments],
                                dtype=dtype)
        self.flat = flat
        self.work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.missing: Tuple[int, ...] = ()
        self.finished = False

    def finish(self, c: Chunk, world_size: int, wait: bool) -> bool:
        """Whether the all-reduce is done (waits for it when `wait`; raises a
        failed collective's error); the first time, the sum becomes the average."""
        if self.finished:
            return True
        if not wait and not self.work.is_completed():
            return False
        self.work.wait()
        n = c.num_elements
        self.missing = tuple(i for i, v in enumerate(self.flat[n:].tolist()) if v <= 0)
        self.flat = self.flat[:n].div_(world_size)
        self.finished = True
        return True


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
