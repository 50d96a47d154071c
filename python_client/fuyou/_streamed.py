"""StreamedMode: the weights live in the daemon (``fuyou.AdamW(...,
offload_params=True)`` with ``fuyou.stream_parameters``).

The session takes ``FETCH_SLOTS`` more slots for weight fetches; chunks are
planned from the model's modules when it is bound and registered module by
module (``offload``: :class:`~fuyou._offload.OffloadedParams`, which installs
each parameter's hooks as it registers it). The hooks hand a parameter's
gradient to ``offload.gradients`` (_offload_grads.py): a chunk a pass
completed is sent and freed (``.grad`` becomes a FreedGrad), or kept on the
host. At step() the gradients are in the daemon's journal: what the loop did
to them (FreedGrad ops) and the clip are replayed there; nothing is validated
by fingerprint, and new weights are never installed (the next forward
fetches them). A committed step drops the weight cache.
"""

from __future__ import annotations

from typing import List, Optional

from . import _checkpoint
from ._backward_hooks import BackwardHooks
from ._chunking import trainable_params
from ._errors import FailedPrecondition
from ._host_malloc import keep_large_buffers_mmapped
from ._mode import StepMode
from ._offload import FETCH_SLOTS, OffloadedParams
from ._protocol import MAX_SLOTS, REDO_CLIPPED, REDO_GRADIENTS_CHANGED

__all__ = ["StreamedMode"]



class StreamedMode(StepMode):
    """The streamed mode of one optimizer (see the module doc)."""

    EXTRA_SLOTS = FETCH_SLOTS  # session slots beyond num_slots
    INSTALL_WEIGHTS = False  # the daemon keeps them; the next forward fetches them

    @staticmethod
    def plan(param_groups, chunk_bytes: int, num_slots: int, init_from,
             track_frozen: bool = False):
        """(no chunks yet, trainable parameters, slot bytes): the chunks follow
        the model's modules and are planned when it is bound."""
        if init_from is not None:
            raise NotImplementedError(
                "fuyou.AdamW(offload_params=True) does not take init_from: load the "
                "checkpoint with fuyou.materialize (one module at a time)")
        if num_slots + FETCH_SLOTS > MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{MAX_SLOTS - FETCH_SLOTS} with "
                             f"offload_params ({FETCH_SLOTS} more slots fetch weights)")
        # track_frozen: the frozen parameters are streamed too, read-only
        trainable = [p for group in trainable_params([g["params"] for g in param_groups],
                                                     include_frozen=track_frozen)
                     for _, p in group]
        largest = max((p.numel() * p.element_size() for p in trainable), default=8)
        total = sum(p.numel() * p.element_size() for p in trainable)
        return [], trainable, max(8, min(chunk_bytes, max(largest, total)))

    def __init__(self, opt, pipeline, session):
        """Attaches `session` without registering anything."""
        super().__init__(pipeline)
        self.hooks = BackwardHooks(pipeline.params, pipeline.lock, self)
        pipeline.attach(session, register=False, reserved_slots=FETCH_SLOTS)
        self.offload = OffloadedParams(opt, pipeline, self.hooks)
        if any(p.device.type != "cuda" for g in opt.param_groups for p in g["params"]):
            keep_large_buffers_mmapped()  # before materialize (_host_malloc.py)
        self._gradients = self.offload.gradients
        self._job = opt.job
        self._versions: Optional[List[int]] = None  # the placeholders' at the last step's end

    def start(self) -> None:
        """Nothing: the hooks come with each module's registration."""

    # ------------------------------------------------------------ hooks
    def grad_arriving(self, index: int) -> None:
        if self.pipeline.hooks_live():
            self._gradients.grad_arriving(index)

    def grad_accumulated(self, index: int) -> None:
        pipeline = self.pipeline
        if not pipeline.hooks_live():
            return
        done = pipeline.count_pass(index)
        if done:
            try:
                self._gradients.chunks_done(done, pipeline.passes.rounds)
            except BaseException as e:
                if not isinstance(e, FailedPrecondition):
                    pipeline.failed = e
                raise

    # ------------------------------------------------------------ step
    def _step_starting(self) -> None:
        self.offload.weights.release_backward_holds()

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        # The gradients sent are in the daemon's journal: what the loop did to
        # them (FreedGrad ops) and the clip are replayed there.
        self._gradients.finish_adding(inv_scale)
        self.pipeline.wait_sent()
        return self._gradients.squares() if clipping else []

    def _redo_sent(self, grad_scale: float, clipped: bool) -> None:
        self._gradients.replay(grad_scale, clipped, (REDO_GRADIENTS_CHANGED, REDO_CLIPPED))

    def _send_unsent(self, grad_scale: float) -> None:
        self._gradients.send_unsent(grad_scale)

    def _step_ended(self, committed: bool) -> None:
        self._gradients.reset_step()
        if committed:  # fetched weights are the previous step's now
            self.offload.weights.drop_cache()
        self._versions = [p._version for p in self.pipeline.params]
        self.offload.weights.edits.forget()

    def weights_error(self) -> Optional[Exception]:
        """A parameter changed in place since the last step where fuyou could
        not take it (``edited_in_forward``). Said once; the next step() goes on."""
        edited = self.edited_in_forward()
        return self.edit_error(edited[0]) if edited else None

    def edited_in_forward(self) -> List[int]:
        """The param indexes changed in place since the last step while their
        module held its fetched weights (an edit inside a forward,
        ``self.weight.mul_`` or ``self.weight.data.mul_``), so only the fetched
        copy changed. The version counters catch the first, the fetched
        weights' looks (``offload.weights.edits``) the second. Edits of a
        placeholder between steps are taken into the masters
        (``offload.placeholders``) and do not count."""
        versions = [p._version for p in self.pipeline.params]
        before, self._versions = self._versions, versions
        looked = [m.index for _b, m in self.offload.weights.edited_members()]
        taken = self.offload.placeholders.edit_versions  # edits written into the masters
        return [i for i, (a, b) in enumerate(zip(before or versions, versions))
                if a != b and taken.get(i) != b] + looked

    def edit_error(self, index: int, where: str = "") -> FailedPrecondition:
        name = self.offload.placeholders.describe(self.pipeline.params[index])
        return FailedPrecondition(
            f"{name} was changed in place outside step() while its module held its fetched "
            f"weights{where} (inside a forward, e.g. self.weight.data.mul_(...)): with "
            "offload_params its weights live in fuyoud, so the change reached only the fetched "
            "copy. Change it between steps (with torch.no_grad(): p.mul_(...), "
            "p.data.clamp_(...), model.load_state_dict: fuyou writes those into its masters); "
            "this step() was not taken, call it again")

    # ------------------------------------------------------------ between steps
    def import_moments(self, opt, state_dict: dict) -> None:
        """The state dict's moments and step counts into the daemon, in one
        import; the daemon's weights stay (they are the model's:
        model.load_state_dict writes them)."""
        plan = _checkpoint.plan_import(opt, self.pipeline, state_dict, masters_from_model=False)
        _checkpoint.apply_load(self.pipeline, plan)
        self.offload.weights.drop_cache()

    def quiesce(self) -> None:
        """The daemon reads states only with no weight fetch in flight."""
        self.offload.weights.drain_fetches()

    def check_import(self, job: str) -> None:
        if not self.offload.registered:
            raise FailedPrecondition(
                f"load_state_dict into fuyou.AdamW(offload_params=True) of job {job!r} "
                "before its model is registered: call fuyou.stream_parameters(model, opt) (or "
                "fuyou.materialize) first, then load the optimizer's state dict")

    def check_fork(self, source: str, job: str) -> None:
        raise NotImplementedError(
            f"load_state_dict of job {source!r} into job {job!r} with offload_params: "
            "fork the job with fuyouctl copy-job and open the copy instead")

    def close(self) -> None:
        """Closes the streams on the model, then the hooks and the session."""
        try:
            self.offload.close()
        finally:
            super().close()
