"""StepMode: the interface fuyou.AdamW drives, and what its two modes share.

``fuyou.AdamW`` holds one mode: :class:`~fuyou._resident.ResidentMode` (the
weights live in the model; chunks are validated by fingerprint and redone) or
:class:`~fuyou._streamed.StreamedMode` (``offload_params``: the weights live
in the daemon, the gradients are journaled there and replayed). The optimizer
never asks which one it holds. A mode owns the pipeline's backward hooks
(_backward_hooks.py calls ``grad_arriving`` / ``grad_accumulated``) and drives
the pipeline downward; the pipeline never calls back into it.

The step, as :meth:`StepMode.finish_step` runs it for both modes::

    settle(inv_scale, clipping) -> sums of squares -> clip coefficient
    non-finite norm: overflow   | else redo_sent(grad_scale, clipped)
    send_unsent(grad_scale)     -> commit (or abort at an overflow) -> step_ended

Every method runs with the optimizer's lock held.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from ._protocol import ABORT_OVERFLOW, ABORT_SKIPPED_STEP

__all__ = ["StepMode", "clip_coefficient"]


def clip_coefficient(squares: List[float], max_norm: float, scaler) -> float:
    """min(1, max_norm / (norm + 1e-6)) of the unscaled gradients as
    torch.nn.utils.clip_grad_norm_ computes it (fp32), from the chunks' sums of
    squares; nan or inf when the norm is not finite."""
    if not squares:
        return 1.0
    total = torch.tensor(list(squares), dtype=torch.float32).sum().sqrt()
    if scaler.enabled:
        total = total / scaler.scale  # a power of two: exact
    if not bool(torch.isfinite(total)):
        return float("nan")
    clip_coef = torch.tensor(max_norm, dtype=torch.float32) / (total + 1e-6)
    return float(torch.clamp(clip_coef, max=1.0))


class StepMode:
    """What both modes share; subclasses fill in the step's four phases
    (``_settle``, ``_redo_sent``, ``_send_unsent``, ``_step_ended``) and the
    hooks. ``offload`` is the OffloadedParams of the streamed mode, else None."""

    offload = None

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def finish_step(self, scaler, max_grad_norm: Optional[float]) -> bool:
        """step()'s work after the groups were checked: validates or replays,
        clips, sends the rest and commits; at an overflow (inf/nan gradients, a
        non-finite norm) abandons the step instead. Updates the loss scaler.
        Returns True when the step was committed."""
        pipeline = self.pipeline
        self._step_starting()
        inv_scale = 1.0 / scaler.scale
        grad_scale = inv_scale
        if not pipeline.step.overflow:
            clipping = max_grad_norm is not None
            squares = self._settle(inv_scale, clipping)
            clip_coef = clip_coefficient(squares, max_grad_norm, scaler) if clipping else 1.0
            if not math.isfinite(clip_coef):
                pipeline.step.mark_overflow()
            else:
                grad_scale = clip_coef * inv_scale
                self._redo_sent(grad_scale, clip_coef < 1.0)
        if not pipeline.step.overflow:
            self._send_unsent(grad_scale)
        if pipeline.step.overflow:
            pipeline.abort(ABORT_OVERFLOW)
            self._step_ended(committed=False)
            scaler.update(overflow=True)
            return False
        pipeline.commit()
        self._step_ended(committed=True)
        scaler.update(overflow=False)
        return True

    def zero_grad(self) -> None:
        """The pipeline's side of zero_grad(): a step with updates sent and no
        step() was skipped (rolled back); else the passes counted are forgotten."""
        pipeline = self.pipeline
        if not pipeline.attached or pipeline.failed is not None:
            return
        if pipeline.step.in_step:
            try:
                pipeline.abort(ABORT_SKIPPED_STEP)
            except BaseException as e:
                pipeline.failed = e
                raise
        else:
            pipeline.reset_passes()
        self._step_ended(committed=False)

    def quiesce(self) -> None:
        """Before the daemon's states are read or written between steps."""

    def check_import(self, job: str) -> None:
        """Raises when load_state_dict cannot import moments now."""

    def check_fork(self, source: str, job: str) -> None:
        """Raises when load_state_dict cannot fork job `source` into this one."""

    def group_error(self, index: int, group: dict) -> Optional[Exception]:
        """What is wrong with parameter group `index` as the loop edited it that
        only this mode refuses; None when nothing."""
        return None

    def weights_error(self) -> Optional[Exception]:
        """At step(), before anything of it: an edit of the weights since the
        last step that this mode cannot take (raised once), or None."""
        return None

    def close(self) -> None:
        """Removes the hooks and closes the pipeline's session."""
        self.hooks.remove()
        self.pipeline.close()

    # ------------------------------------------------------------ the step's phases
    def _step_starting(self) -> None:
        pass

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        raise NotImplementedError

    def _redo_sent(self, grad_scale: float, clipped: bool) -> None:
        raise NotImplementedError

    def _send_unsent(self, grad_scale: float) -> None:
        raise NotImplementedError

    def _step_ended(self, committed: bool) -> None:
        pass

    def reopen(self, session) -> bool:
        """Takes a new session on the same job after ``close`` (a fork in the
        daemon replaced the job); True when resumed. Only where ``check_fork``
        lets a fork happen."""
        raise NotImplementedError
