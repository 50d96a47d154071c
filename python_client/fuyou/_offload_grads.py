"""The gradients of an offload_params model: what happens to a chunk once a
backward pass completed its gradients (the streamed mode, _streamed.py, hands
it over), and what the loop sees in ``.grad`` afterwards.

- The step's last pass (``passes_per_step``: declared or learned), overlap on:
  the chunk is sent speculatively (from ``.grad``, or from its host copy when
  earlier passes made one) with ``JOURNAL_KEEP``: fuyoud keeps the step's
  gradients (its gradient journal), so whatever the loop does to ``.grad``
  before :meth:`step` is replayed there and a redo needs nothing from here.
- An earlier pass, or overlap off (or an overflow seen): the gradients are added
  to the chunk's host copy (on the CPU, in the parameters' dtype, in the order
  AccumulateGrad would add them); ``send_unsent`` sends the copies at step().
- Either way the parameter's gradients are freed, and ``.grad`` becomes a
  :class:`~fuyou._freed_grad.FreedGrad`: it answers norms and inf checks and
  takes ``mul_``/``div_``/``zero_``. For a journaled chunk the ops are sent at
  step() (``JOURNAL_REPLAY`` with ``grad_ops``); for a host copy they apply to
  the copy at once.
- A pass that reaches a journaled chunk again is an undeclared accumulation
  pass: its gradients are sent with ``JOURNAL_ADD`` when the pass completes
  the chunk (the daemon adds them to the journal as AccumulateGrad would and
  redoes the update); the pipeline learns the passes per step, so the next
  steps keep the first passes on the host. Its gradient norms then come from
  the daemon (ParamsReady's journal statistics). If the loop zeroed ``.grad``
  in between (``model.zero_grad()`` without ``step()``) the step was skipped:
  it is rolled back and the pass starts a new one, as in the resident mode.
- A block whose chunks are all complete is released for the rest of backward.

Every method runs with the optimizer's lock held.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk
from ._errors import FailedPrecondition, InvalidArgument
from ._freed_grad import OP_MUL, FreedGrad, GradRecord
from ._placeholders import assign_grad
from ._protocol import ABORT_SKIPPED_STEP, MAX_CHUNK_SEGMENTS
from ._weight_cache import WeightCache

__all__ = ["OffloadedGradients"]


class OffloadedGradients:
    """The gradient side of one offload job (``optimizer.offload.gradients``)."""

    def __init__(self, optimizer, pipeline, weights: WeightCache, layout):
        """`layout`: the offload's ModuleBlocks (filled at bind, not copied)."""
        self._optimizer = weakref.ref(optimizer)
        self._pipeline = pipeline
        self._weights = weights
        self._layout = layout
        # Gradients of this step kept on the host (accumulation, overlap off):
        # chunk_id -> (packed gradients, segments without any).
        self._host: Dict[int, Tuple[torch.Tensor, set]] = {}
        # Chunks sent from their host copy in this step: chunk_id -> the copy.
        self._sent_host: Dict[int, torch.Tensor] = {}
        # Per journaled chunk: how many of each member's record ops the daemon has.
        self._ops_sent: Dict[int, Dict[int, int]] = {}
        # Journaled chunks that an undeclared pass is accumulating into:
        # chunk_id -> (the _Sent of its last update, pending ops per member).
        self._adding: Dict[int, Tuple[object, Dict[int, List[Tuple[int, float]]]]] = {}

    # ------------------------------------------------------------ backward
    def grad_arriving(self, index: int) -> None:
        """Before parameter `index` accumulates a gradient (the pipeline's hook):
        its weights are brought in when backward reaches it without them; a
        FreedGrad makes way for the new gradient (see the module's rules)."""
        pipeline = self._pipeline
        p = pipeline.params[index]
        g = p.grad
        if isinstance(g, FreedGrad):
            record = g.record
            if record.stale and not record.zeroed:
                opt = self._optimizer()
                raise FailedPrecondition(
                    f"job {opt.job!r}: backward into {record.name}, whose .grad still holds "
                    "the gradients of the last step (fuyou freed them when step() committed "
                    "it); call zero_grad() after step(), as torch would otherwise add this "
                    "step's gradients to the last step's")
            sent = pipeline.step.sent
            journaled = [c for c in pipeline.plan.of_param(index)
                         if c.chunk_id in sent and c.chunk_id not in self._adding]
            if journaled and record.zeroed:
                # model.zero_grad() and a new backward without step(): skipped.
                self._abandon_skipped_step()
                journaled = []
            for c in journaled:
                earlier = pipeline.step.take(c.chunk_id)
                pending = {i: self._pending_ops(c, i) for i in pipeline.plan.params_of(c.chunk_id)}
                self._adding[c.chunk_id] = (earlier, pending)
                pipeline.step.mark_accumulating()
            p.grad = None  # a zero, or kept by the host copy or the daemon's journal
        block = self._layout.of_param.get(index)
        if block is not None and block.refs == 0 and not block.backward_held:
            self._weights.hold_for_backward(block)
        if p.grad is None:
            self._weights.add_grad_bytes(math.prod(pipeline.param_shapes[index]) * p.element_size())

    def chunks_done(self, done: List[Chunk], rounds: Dict[int, int]) -> None:
        """Chunks whose gradients a backward pass completed: sent (the last pass
        of the step), added into the journal (an undeclared pass), else added to
        their host copy; then the parameters whose every chunk is complete get a
        FreedGrad, and blocks whose chunks are all complete are released."""
        pipeline = self._pipeline
        k = pipeline.passes.passes_per_step
        grad_scale = pipeline.hook_grad_scale()
        hold = grad_scale is None
        for c in done:
            cid = c.chunk_id
            if cid in self._adding and not hold:
                self._send_add(c, grad_scale)
            elif cid in self._adding:  # an overflow since: the step is lost anyway
                self._adding.pop(cid)
                self._to_host(c, self._host.get(cid))
            elif rounds[cid] >= k and not hold:
                host = self._host.pop(cid, None)
                if host is not None:
                    self._to_host(c, host)
                    self._sent_host[cid] = host[0]
                    pipeline.send(c, grad_scale, speculative=True, journal=True,
                                  packed=(host[0], tuple(sorted(host[1]))))
                else:
                    nbytes = self._chunk_grad_bytes(c)
                    pipeline.send(c, grad_scale, speculative=True, journal=True,
                                  on_copied=lambda n=nbytes: self._weights.add_grad_bytes(-n))
                self._ops_sent[cid] = {}
            else:
                self._to_host(c, self._host.get(cid))
        passes = pipeline.passes.param_passes
        for c in done:
            for seg in c.segments:
                i = seg.param_index
                if seg.param.grad is None or isinstance(seg.param.grad, FreedGrad):
                    continue
                if all(rounds[o.chunk_id] >= passes[i] for o in pipeline.plan.of_param(i)):
                    self._free(i)
        blocks = {id(b): b for b in (self._layout.of_chunk[c.chunk_id] for c in done)}
        for block in blocks.values():
            r = max(rounds[c.chunk_id] for c in block.chunks)
            if all(rounds[c.chunk_id] == r and not self._partial(c, rounds)
                   for c in block.chunks):
                self._weights.release_backward(block)

    def _free(self, index: int) -> None:
        """Parameter `index`'s gradients are all sent or on the host: its .grad
        becomes a FreedGrad (a send still reading it holds a reference)."""
        pipeline = self._pipeline
        p = pipeline.params[index]
        chunks = pipeline.plan.of_param(index)
        name = self.name_of(index)
        if any(c.chunk_id in self._host for c in chunks):
            slices = [self._host_slice(self._host[c.chunk_id][0], c, index) for c in chunks]
            record = GradRecord(name, stats=None, host=slices)
        elif any(self._was_added(c) for c in chunks):
            record = GradRecord(name, stats=lambda: self._daemon_stats(index))
        elif any(c.chunk_id in self._sent_host for c in chunks):
            flat = torch.cat([self._host_slice(self._sent_host[c.chunk_id], c, index)
                              for c in chunks])
            norm2, max_abs = torch.norm(flat, 2.0), flat.abs().max()
            record = GradRecord(name, stats=lambda: (norm2, max_abs))
        else:
            # Exactly what clip_grad_norm_ computes from the real .grad.
            g = p.grad.detach()
            norm2, max_abs = torch.norm(g, 2.0), g.abs().max()
            record = GradRecord(name, stats=lambda: (norm2, max_abs))
        shape = pipeline.param_shapes[index]
        assign_grad(p, shape, FreedGrad(shape, p.dtype, p.device, record))

    # ------------------------------------------------------------ step()
    def squares(self) -> List[float]:
        """At step() with max_grad_norm: fp32 sums of squares of every gradient
        of the step as the loop left it (journaled: per parameter, from its
        FreedGrad; host copies: per chunk; still in .grad: per chunk)."""
        out = []
        pipeline = self._pipeline
        for index in range(len(pipeline.params)):
            record = self._record(index)
            if record is not None and record.host is None and not record.zeroed \
                    and not record.stale:
                norm2, _ = record.stats()
                out.append(float(norm2.float()) ** 2 * record.scale ** 2)
        for c in pipeline.plan.chunks:
            host = self._host.get(c.chunk_id)
            if host is not None:
                self._drop_cleared(c, host)
                t = torch.linalg.vector_norm(host[0], dtype=torch.float32).square()
                out.append(float(t))
            elif c.chunk_id not in pipeline.step.sent:
                pieces = [seg.param.grad.detach().reshape(-1)[seg.start:seg.end]
                          for seg in c.segments
                          if seg.param.grad is not None and not isinstance(seg.param.grad, FreedGrad)]
                for piece in pieces:
                    out.append(float(torch.linalg.vector_norm(piece, dtype=torch.float32).square()))
        return out

    def replay(self, grad_scale: float, clipping: bool, reasons) -> None:
        """At step(): every journaled chunk whose gradients the loop changed
        (ops on its FreedGrads, a ``.grad`` set to None) or whose group's
        hyper-parameters changed since it was sent is updated again from the
        daemon's journal with those ops; with `clipping` (a coefficient below 1)
        every journaled chunk is, with ``grad_scale``."""
        changed, clipped = reasons
        pipeline = self._pipeline
        for c in pipeline.step.sent_chunks():
            cid = c.chunk_id
            ops = self._one_op_list(c, {i: self._pending_ops(c, i)
                                        for i in pipeline.plan.params_of(cid)})
            earlier = pipeline.step.sent[cid]
            dropped = tuple(i for i, seg in enumerate(c.segments)
                            if seg.param.grad is None and i not in earlier.missing)
            if dropped and len(c.segments) > MAX_CHUNK_SEGMENTS:  # updated as one segment
                name = self.name_of(c.segments[dropped[0]].param_index)
                raise FailedPrecondition(
                    f"job {self._optimizer().job!r}: {name}.grad was set to None after "
                    f"backward in a chunk of more than {MAX_CHUNK_SEGMENTS} parameters, which "
                    "fuyoud updates as one: set it to None before backward instead")
            edited = bool(ops or dropped) or earlier.hyper != pipeline.hyper_now(c.group_index)
            if edited or clipping:
                pipeline.replay(c, grad_scale, ops, changed if edited else clipped, dropped)
                self._mark_ops_sent(cid)
            if pipeline.step.overflow:
                break

    def finish_adding(self, grad_scale: float) -> None:
        """At step(): the chunks an undeclared pass reached but did not complete
        (a parameter without a gradient in that pass) are added into the journal
        with what the pass gave them."""
        pipeline = self._pipeline
        for cid in list(self._adding):
            c = pipeline.plan.chunk(cid)
            self._send_add(c, grad_scale)
            for i in pipeline.plan.params_of(cid):
                g = pipeline.params[i].grad
                if g is not None and not isinstance(g, FreedGrad):
                    self._free(i)

    def _send_add(self, c: Chunk, grad_scale: float) -> None:
        earlier, pending = self._adding.pop(c.chunk_id)
        ops = self._one_op_list(c, pending)
        self._pipeline.journal_add(c, grad_scale, ops, earlier)
        # Members the pass did not reach keep their FreedGrad, whose ops are sent now.
        self._mark_ops_sent(c.chunk_id)

    def _mark_ops_sent(self, chunk_id: int) -> None:
        """The daemon's journal of the chunk now has every op of its members'
        FreedGrads."""
        self._ops_sent[chunk_id] = {
            i: len(r.ops) for i, r in ((i, self._record(i))
                                       for i in self._pipeline.plan.params_of(chunk_id))
            if r is not None}

    def send_unsent(self, grad_scale: float) -> None:
        """At step(): sends the chunks kept on the host and those whose gradients
        are still in ``.grad`` (a pass that left some parameter without one, or
        a parameter whose .grad was zeroed: it updates with zeros, as in torch)."""
        pipeline = self._pipeline
        sent = pipeline.step.sent
        for c in pipeline.plan.chunks:
            if c.chunk_id in sent:
                continue
            host = self._host.pop(c.chunk_id, None)
            if host is None and any(isinstance(seg.param.grad, FreedGrad) for seg in c.segments):
                self._to_host(c, None)
                host = self._host.pop(c.chunk_id)
            if host is not None:
                self._drop_cleared(c, host)
                pipeline.send(c, grad_scale, packed=(host[0], tuple(sorted(host[1]))))
            else:
                nbytes = self._chunk_grad_bytes(c)
                if pipeline.send(c, grad_scale,
                                 on_copied=lambda n=nbytes: self._weights.add_grad_bytes(-n)):
                    for seg in c.segments:
                        if seg.param.grad is not None:
                            self._free(seg.param_index)
            if pipeline.step.overflow:
                break
        pipeline.wait_sent()

    def reset_step(self) -> None:
        """The step is over (committed, abandoned or skipped): host copies go,
        the FreedGrads turn stale (the daemon dropped the journal; a zero stays a
        zero), real gradients left in .grad are freed, backward holds released."""
        for index, p in enumerate(self._pipeline.params):
            if isinstance(p.grad, FreedGrad):
                p.grad.record.settle()
            elif p.grad is not None:
                p.grad = None  # only a step that failed half-way leaves these
        self._host.clear()
        self._sent_host.clear()
        self._ops_sent.clear()
        self._adding.clear()
        self._weights.reset_grad_bytes()
        self._weights.release_backward_holds()
        self._weights.drain_fetches()  # the daemon reads and writes states only without fetches in flight

    # ------------------------------------------------------------ internals
    def _abandon_skipped_step(self) -> None:
        self._pipeline.abort(ABORT_SKIPPED_STEP)
        self._pipeline.reset_passes()
        self.reset_step()

    def _record(self, index: int) -> Optional[GradRecord]:
        g = self._pipeline.params[index].grad
        return g.record if isinstance(g, FreedGrad) else None

    def _pending_ops(self, c: Chunk, index: int) -> Optional[List[Tuple[int, float]]]:
        """Ops on parameter `index`'s FreedGrad that chunk `c`'s journal lacks
        (None: it has no gradient in the journal)."""
        record = self._record(index)
        if record is None or record.stale or record.host is not None:
            return None
        if record.zeroed:
            return [(OP_MUL, 0.0)]
        done = self._ops_sent.get(c.chunk_id, {}).get(index, 0)
        return list(record.ops[done:])

    def _one_op_list(self, c: Chunk, pending: Dict[int, List[Tuple[int, float]]]):
        """The one op list the chunk's journal replays: its members' must agree."""
        lists = {tuple(ops) for ops in pending.values() if ops is not None}
        if len(lists) > 1:
            names = ", ".join(self.name_of(i) for i, ops in pending.items() if ops is not None)
            raise InvalidArgument(
                f"the gradients of one chunk ({names}: module "
                f"{self._layout.of_chunk[c.chunk_id].name!r}) were scaled differently "
                "in place: fuyou replays one sequence of mul_/div_ per chunk on the daemon's "
                "copy; scale every parameter of a module alike (clip_grad_norm_ and "
                "GradScaler do), or use max_grad_norm= / loss_scale= on fuyou.AdamW")
        return list(lists.pop()) if lists else []

    def _was_added(self, c: Chunk) -> bool:
        sent = self._pipeline.step.sent.get(c.chunk_id)
        return sent is not None and sent.journal_added

    def _daemon_stats(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Parameter `index`'s gradient norm and largest magnitude as the daemon's
        journal holds them after an accumulating pass (waits for its reply)."""
        pipeline = self._pipeline
        squares, largest = 0.0, 0.0
        for c in pipeline.plan.of_param(index):
            sums, maxes = pipeline.journal_stats(c)
            for i, seg in enumerate(c.segments):
                if seg.param_index == index:
                    squares += sums[i]
                    largest = max(largest, maxes[i]) if maxes[i] == maxes[i] else math.nan
        p = pipeline.params[index]
        return (torch.tensor(math.sqrt(squares), dtype=torch.float32).to(p.dtype),
                torch.tensor(largest, dtype=torch.float32).to(p.dtype))

    @staticmethod
    def _host_slice(packed: torch.Tensor, c: Chunk, index: int) -> torch.Tensor:
        parts = [packed[seg.offset:seg.offset + seg.numel]
                 for seg in c.segments if seg.param_index == index]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def name_of(self, index: int) -> str:
        block = self._layout.of_param.get(index)
        for m in (block.members if block is not None else ()):
            if m.index == index:
                return f"parameter {index} of module {block.name!r}"
        return f"parameter {index}"

    def _partial(self, c: Chunk, rounds: Dict[int, int]) -> bool:
        """A parameter of `c` accumulated a gradient of a pass that has not
        completed the chunk yet."""
        passes = self._pipeline.passes.param_passes
        return any(passes[seg.param_index] > rounds[c.chunk_id] for seg in c.segments)

    def _chunk_grad_bytes(self, c: Chunk) -> int:
        return sum(seg.numel for seg in c.segments
                   if seg.param.grad is not None and not isinstance(seg.param.grad, FreedGrad)
                   ) * c.element_size

    @staticmethod
    def _drop_cleared(c: Chunk, host) -> None:
        """Segments of a host copy whose ``.grad`` the loop set to None after
        backward leave it (zeros, counted missing): torch skips them."""
        packed, missing = host
        for i, seg in enumerate(c.segments):
            if seg.param.grad is None and i not in missing:
                packed[seg.offset:seg.offset + seg.numel].zero_()
                missing.add(i)

    def _to_host(self, c: Chunk, host) -> None:
        """Adds the chunk's gradients (``.grad``) to its host copy (on the CPU;
        made when None), as AccumulateGrad adds to ``.grad`` (same dtype, same
        order); a zeroed FreedGrad counts as zeros; their device bytes no
        longer count."""
        if host is None:
            packed = torch.zeros(c.num_elements, dtype=c.dtype)
            host = self._host[c.chunk_id] = (packed, set(range(len(c.segments))))
        packed, missing = host
        for i, seg in enumerate(c.segments):
            g = seg.param.grad
            if g is None:
                continue
            if isinstance(g, FreedGrad):
                if g.record.zeroed and i in missing:
                    missing.discard(i)  # packed holds zeros there
                elif not g.record.zeroed and g.record.host is None:
                    raise FailedPrecondition(
                        f"{g.record.name} still holds the gradients of the last step (no "
                        "zero_grad() since step()): fuyou freed them; call zero_grad() after "
                        "step()")
                continue
            piece = g.detach().reshape(-1)[seg.start:seg.end]
            dst = packed[seg.offset:seg.offset + seg.numel]
            if i in missing:
                dst.copy_(piece)
                missing.discard(i)
            else:
                dst.add_(piece.to(dst.device))
        self._weights.add_grad_bytes(-self._chunk_grad_bytes(c))
