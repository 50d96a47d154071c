"""ResidentMode: the weights live in the model (``fuyou.AdamW`` without
``offload_params``).

- Chunks: planned from the parameter groups (``plan``), registered at once; a
  resumed chunk's committed weights are installed into the parameters.
- Backward (the hooks): a chunk complete after ``passes_per_step`` passes is
  sent speculatively with a fingerprint of its gradients (_fingerprints.py).
  A pass that reaches a chunk already sent finds its ``.grad`` zeroed (the
  loop skipped step(): AbortStep ``SKIPPED_STEP``) or not (it accumulates:
  step() redoes the chunk, commit learns the passes).
- step(): first the weights: chunks the loop edited since the last commit
  (``WeightEdits``, _weight_edits.py) go into their masters, after the
  step's updates sent in backward are abandoned (they began from the old
  masters); then the fingerprints again in one pass; changed chunks are redone
  (``GRADIENTS_CHANGED``), all of them with a clip coefficient below 1
  (``CLIPPED``); the unsent ones are sent; commit installs the new weights.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from . import _checkpoint
from ._backward_hooks import BackwardHooks
from ._chunking import plan_chunks
from ._errors import InvalidArgument
from ._fingerprints import changed_chunks, fingerprint
from ._mode import StepMode
from ._protocol import ABORT_SKIPPED_STEP, REDO_CLIPPED, REDO_GRADIENTS_CHANGED
from ._weight_edits import WeightEdits

__all__ = ["ResidentMode"]


class ResidentMode(StepMode):
    """The resident mode of one optimizer (see the module doc)."""

    EXTRA_SLOTS = 0  # session slots beyond num_slots
    INSTALL_WEIGHTS = True  # new weights go into the parameters at commit
    TAKES_WEIGHT_EDITS = True  # the loop's edits of the weights go into the masters

    @staticmethod
    def plan(param_groups, chunk_bytes: int, num_slots: int, init_from,
             track_frozen: bool = False):
        """(chunks, the parameters they pack, slot bytes) for the groups;
        `track_frozen`: the frozen parameters too, in chunks of their own
        (unfrozen later, they train as torch's)."""
        chunks, trainable = plan_chunks([g["params"] for g in param_groups], chunk_bytes,
                                        include_frozen=track_frozen)
        return chunks, trainable, max([c.nbytes for c in chunks], default=8)

    def __init__(self, opt, pipeline, session):
        """Registers every chunk with `session` (``opt.resumed`` says whether
        any was resumed). The hooks come with :meth:`start`."""
        super().__init__(pipeline)
        self.hooks = BackwardHooks(pipeline.params, pipeline.lock, self)
        self._overlap = opt.overlap
        self._group_param_ids = [[id(p) for p in g["params"]] for g in opt.param_groups]
        self._changed: List = []
        self.edits = WeightEdits(pipeline)
        opt.resumed = pipeline.attach(session)

    def start(self) -> None:
        """Installs the hooks (overlap on) once the optimizer is open; the
        weights now are the masters'."""
        if self._overlap:
            self.hooks.install(range(len(self.pipeline.params)))
        self._remember_weights()

    def reopen(self, session) -> bool:
        """Takes `session` on the same job after ``close`` (a fork in the daemon
        replaced the job): registers again; True when resumed."""
        resumed = self.pipeline.attach(session)
        self.start()
        return resumed

    def _remember_weights(self) -> None:
        if self.TAKES_WEIGHT_EDITS:
            self.edits.remember()

    # ------------------------------------------------------------ hooks
    def grad_arriving(self, index: int) -> None:
        """Before parameter `index` accumulates a gradient of a backward pass."""
        pipeline = self.pipeline
        if not pipeline.hooks_live():
            return
        sent = pipeline.step.first_reached_sent(index)
        if not sent:
            return
        try:
            if self._all_zeroed(sent):
                # zero_grad (the model's) and a new backward without step():
                # the loop skipped the step.
                pipeline.abort(ABORT_SKIPPED_STEP)
            else:
                # One more backward pass into gradients already sent: the loop
                # accumulates; step() redoes these chunks and learns the passes.
                pipeline.step.mark_accumulating()
        except BaseException as e:
            pipeline.failed = e
            raise

    def grad_accumulated(self, index: int) -> None:
        """After: sends the chunks this completed at their last pass of the step."""
        pipeline = self.pipeline
        if not pipeline.hooks_live():
            return
        for c in pipeline.count_pass(index):
            if pipeline.passes.rounds[c.chunk_id] < pipeline.passes.passes_per_step:
                continue
            grad_scale = pipeline.hook_grad_scale()
            if grad_scale is None:
                continue
            try:
                started = time.perf_counter()
                fp = fingerprint(c)
                pipeline.stats.fingerprint_seconds += time.perf_counter() - started
                pipeline.send(c, grad_scale, speculative=True, fingerprint=fp)
            except BaseException as e:
                pipeline.failed = e
                raise

    def _all_zeroed(self, chunks) -> bool:
        """Whether every gradient of the chunks' parameters is None or all zeros, as
        a zero_grad leaves them: then a backward pass reaching a chunk already sent
        means the loop skipped step(). One parameter whose gradient is legitimately
        zero (or None) beside others with gradients does not make it so (one check
        per chunk and step, one wait for the device)."""
        pipeline = self.pipeline
        grads = [pipeline.params[i].grad for c in chunks for i in pipeline.plan.params_of(c.chunk_id)]
        flags = [g.detach().ne(0).any() for g in grads if g is not None]
        return not flags or not bool(torch.stack(flags).any())

    # ------------------------------------------------------------ step
    def _step_starting(self) -> None:
        """The loop's edits of the weights since the last commit go into the
        masters before anything of this step is kept."""
        if not self.TAKES_WEIGHT_EDITS:
            return
        edited = self.edits.edited()
        if edited:
            self.pipeline.abort()  # the updates sent in backward began from the old masters
            self.edits.take_into_masters(edited)

    def _step_ended(self, committed: bool) -> None:
        if committed:
            self._remember_weights()
        if self._overlap:
            self.hooks.install_unfrozen()  # their chunks went at step() this time

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        """The sent chunks' fingerprints again (all chunks' sums of squares when
        clipping): the changed ones are kept for ``_redo_sent``."""
        pipeline = self.pipeline
        pipeline.wait_sent()
        started = time.perf_counter()
        sent = pipeline.step.sent
        chunks = pipeline.plan.chunks if clipping else [
            pipeline.plan.chunk(cid) for cid, s in sent.items() if s.fingerprint is not None]
        changed, squares = changed_chunks(chunks, sent, pipeline.hyper_now)
        pipeline.stats.fingerprint_seconds += time.perf_counter() - started
        self._changed = changed
        return list(squares.values()) if clipping else []

    def _redo_sent(self, grad_scale: float, clipped: bool) -> None:
        pipeline = self.pipeline
        changed_ids = {c.chunk_id for c in self._changed}
        self._changed = []
        for c in pipeline.step.sent_chunks():
            if c.chunk_id in changed_ids:
                pipeline.redo(c, grad_scale, REDO_GRADIENTS_CHANGED)
            elif clipped:
                pipeline.redo(c, grad_scale, REDO_CLIPPED)
            if pipeline.step.overflow:
                break

    def _send_unsent(self, grad_scale: float) -> None:
        """Sends every chunk not sent yet in this step (stops at an overflow)."""
        pipeline = self.pipeline
        for c in pipeline.plan.chunks:
            if c.chunk_id not in pipeline.step.sent:
                pipeline.send(c, grad_scale)
                if pipeline.step.overflow:
                    break
        pipeline.wait_sent()

    # ------------------------------------------------------------ between steps
    def import_moments(self, opt, state_dict: dict) -> None:
        """The state dict's moments and step counts into the daemon, in one
        import; the masters are the model's parameters (what torch steps from)."""
        plan = _checkpoint.plan_import(opt, self.pipeline, state_dict, masters_from_model=True)
        _checkpoint.apply_load(self.pipeline, plan)
        self._remember_weights()

    def group_error(self, index: int, group: dict) -> Optional[Exception]:
        if index < len(self._group_param_ids) and \
                [id(p) for p in group["params"]] != self._group_param_ids[index]:
            return InvalidArgument(
                f"fuyou.AdamW: the parameters of group {index} were changed after construction; "
                "its chunks are registered with the daemon: build a new optimizer (on a new "
                "job) over the new parameters")
        return None
