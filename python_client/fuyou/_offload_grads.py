"""The gradients of an offload_params model: what happens to a chunk once a
backward pass completed its gradients (the pipeline hands it over).

- The step's last pass (``accumulation_steps``), no clipping, overlap on: the
  chunk is sent as today (speculatively, from ``.grad``, or from its host copy
  when earlier passes made one) and its parameters' gradients are freed (a
  send still reading them keeps a reference until the sender copied them).
- An earlier pass, or ``max_grad_norm`` (the coefficient needs every chunk), or
  overlap off: the gradients are added to the chunk's host copy (on the CPU, in
  the parameters' dtype, in the order AccumulateGrad would add them) and freed;
  ``send_unsent`` sends the copies at step().
- A pass that reaches a chunk already complete for the step is refused
  (FailedPrecondition, the step abandoned): its gradients are gone, so the loop
  must declare ``accumulation_steps``.
- A block whose chunks are all complete is released for the rest of backward.

Every method runs with the optimizer's lock held.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, List, Tuple

import torch

from ._chunking import Chunk
from ._errors import FailedPrecondition
from ._weight_cache import Block, WeightCache

__all__ = ["OffloadedGradients"]


class OffloadedGradients:
    """The gradient side of one offload job (``optimizer.offload.gradients``)."""

    def __init__(self, optimizer, pipeline, weights: WeightCache,
                 block_of_chunk: Dict[int, Block], block_of_param: Dict[int, Block]):
        self._optimizer = weakref.ref(optimizer)
        self._pipeline = pipeline
        self._weights = weights
        self._block_of_chunk = block_of_chunk
        self._block_of_param = block_of_param
        # Gradients of this step kept on the host (clipping, accumulation):
        # chunk_id -> (packed gradients, segments without any).
        self._host: Dict[int, Tuple[torch.Tensor, set]] = {}

    def grad_arriving(self, index: int) -> None:
        """Before parameter `index` accumulates a gradient (the pipeline's hook):
        its weights are brought in when backward reaches it without them, and a
        pass that reaches a chunk whose gradients are complete for the step (sent,
        or kept for step()) is refused: the gradients are freed once complete."""
        pipeline = self._pipeline
        k = pipeline.accumulation_steps
        for c in pipeline.chunks_of_param(index):
            sent = c.chunk_id in pipeline.sent_ids()
            if sent or pipeline.chunk_rounds(c.chunk_id) >= k:
                opt = self._optimizer()
                self.abort_step()
                raise FailedPrecondition(
                    f"job {opt.job!r}: a backward pass reached chunk {c.chunk_id:#x} (module "
                    f"{self._block_of_chunk[c.chunk_id].name!r}) whose gradients of this step "
                    f"were complete after {k} pass(es) and {'sent' if sent else 'kept'}. With "
                    "offload_params the gradients are freed once complete: pass "
                    "accumulation_steps=<backward passes per step> to fuyou.AdamW. The step "
                    "was abandoned; call zero_grad() and go on")
        block = self._block_of_param.get(index)
        if block is not None and block.refs == 0 and not block.backward_held:
            self._weights.hold_for_backward(block)
        p = pipeline.params[index]
        if p.grad is None:
            self._weights.add_grad_bytes(math.prod(pipeline.param_shapes[index]) * p.element_size())

    def chunks_done(self, done: List[Chunk], rounds: Dict[int, int]) -> None:
        """Chunks whose gradients a backward pass completed: sent (the last pass
        of the step, no clipping), else added to their host copy; then the
        parameters whose every chunk is complete lose their gradients, and blocks
        whose chunks are all complete are released for the rest of backward."""
        pipeline = self._pipeline
        opt = self._optimizer()
        k = pipeline.accumulation_steps
        grad_scale = pipeline.hook_grad_scale()
        hold = opt.max_grad_norm is not None or grad_scale is None
        for c in done:
            if rounds[c.chunk_id] >= k and not hold:
                host = self._host.pop(c.chunk_id, None)
                if host is not None:
                    self._to_host(c, host)
                    pipeline.send(c, grad_scale, speculative=True,
                                  packed=(host[0], tuple(sorted(host[1]))))
                else:
                    nbytes = self._chunk_grad_bytes(c)
                    pipeline.send(c, grad_scale, speculative=True,
                                  on_copied=lambda n=nbytes: self._weights.add_grad_bytes(-n))
            else:
                self._to_host(c, self._host.get(c.chunk_id))
        passes = pipeline.param_passes
        for c in done:
            for seg in c.segments:
                if all(rounds[o.chunk_id] >= passes[seg.param_index]
                       for o in pipeline.chunks_of_param(seg.param_index)):
                    seg.param.grad = None  # a send still reading it holds a reference
        blocks = {id(b): b for b in (self._block_of_chunk[c.chunk_id] for c in done)}
        for block in blocks.values():
            r = max(rounds[c.chunk_id] for c in block.chunks)
            if all(rounds[c.chunk_id] == r and not self._partial(c, rounds)
                   for c in block.chunks):
                self._weights.release_backward(block)

    def _partial(self, c: Chunk, rounds: Dict[int, int]) -> bool:
        """A parameter of `c` accumulated a gradient of a pass that has not
        completed the chunk yet."""
        passes = self._pipeline.param_passes
        return any(passes[seg.param_index] > rounds[c.chunk_id] for seg in c.segments)

    def _chunk_grad_bytes(self, c: Chunk) -> int:
        return sum(seg.numel for seg in c.segments if seg.param.grad is not None) * c.element_size

    def _to_host(self, c: Chunk, host) -> None:
        """Adds the chunk's gradients (``.grad``) to its host copy (on the CPU;
        made when None), as AccumulateGrad adds to ``.grad`` (same dtype, same
        order); their device bytes no longer count."""
        if host is None:
            packed = torch.zeros(c.num_elements, dtype=c.dtype)
            host = self._host[c.chunk_id] = (packed, set(range(len(c.segments))))
        packed, missing = host
        for i, seg in enumerate(c.segments):
            g = seg.param.grad
            if g is None:
                continue
            piece = g.detach().reshape(-1)[seg.start:seg.end]
            dst = packed[seg.offset:seg.offset + seg.numel]
            if i in missing:
                dst.copy_(piece)
                missing.discard(i)
            else:
                dst.add_(piece.to(dst.device))
        self._weights.add_grad_bytes(-self._chunk_grad_bytes(c))

    def squares(self) -> Dict[int, float]:
        """At step() with max_grad_norm: each chunk's fp32 sum of squares of its
        gradients, from its host copy or its parameters' ``.grad``."""
        out = {}
        for c in self._pipeline.chunks:
            host = self._host.get(c.chunk_id)
            if host is not None:
                t = torch.linalg.vector_norm(host[0], dtype=torch.float32).square()
                out[c.chunk_id] = float(t)
            else:
                fp = self._pipeline.fingerprints([c])[0]
                if fp is not None:
                    out[c.chunk_id] = float(fp[1])
        return out

    def send_unsent(self, grad_scale: float) -> None:
        """At step(): sends the chunks kept on the host and those whose gradients
        are still in ``.grad`` (a pass that left some parameter without one)."""
        pipeline = self._pipeline
        sent = pipeline.sent_ids()
        for c in pipeline.chunks:
            if c.chunk_id in sent:
                continue
            host = self._host.pop(c.chunk_id, None)
            if host is not None:
                pipeline.send(c, grad_scale, packed=(host[0], tuple(sorted(host[1]))))
            else:
                nbytes = self._chunk_grad_bytes(c)
                if pipeline.send(c, grad_scale,
                                 on_copied=lambda n=nbytes: self._weights.add_grad_bytes(-n)):
                    for seg in c.segments:
                        seg.param.grad = None
            if pipeline.overflow:
                break
        pipeline.wait_sent()

    def reset_step(self) -> None:
        """The step is over (committed, abandoned or skipped): host copies and
        gradients go, backward holds are released."""
        self._host.clear()
        for p in self._pipeline.params:
            p.grad = None
        self._weights.reset_grad_bytes()
        self._weights.release_backward_holds()
        self._weights.drain_fetches()  # the daemon reads and writes states only without fetches in flight

    def abort_step(self) -> None:
        self._pipeline.abort(0)
        self.reset_step()
