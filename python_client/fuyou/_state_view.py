"""fuyou.AdamW.state: torch's ``optimizer.state[p]``, read from the daemon.

torch.optim.AdamW keeps ``state[p] = {"step", "exp_avg", "exp_avg_sq"}`` in
the process; fuyou.AdamW keeps them in fuyoud. ``opt.state[p]`` reads the
parameter's states at the last committed step (between steps only) into a
read-only mapping of fp32 copies: in-place changes to those tensors do not reach
the daemon, and assigning into ``opt.state`` or ``opt.state[p]`` raises
TypeError (load_state_dict is the way to set moments). A parameter of the
optimizer never updated has an empty mapping, as in torch. In a
data-parallel group it holds this rank's parameters only, and another rank's
raises (_sharded_states.py).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from . import _checkpoint, _sharded_states
from ._errors import FailedPrecondition

__all__ = ["StateView"]

_READ_ONLY = ("fuyou.AdamW keeps its moments in the daemon: opt.state is read-only; "
              "set them with load_state_dict (a torch.optim.AdamW state dict)")


class StateView(Mapping):
    """opt.state of a fuyou.AdamW `opt`: parameter -> its states (read-only)."""

    def __init__(self, opt):
        self._opt = opt

    def _index(self, p):
        """The parameter's index in the pipeline's trainable params, or None for a
        parameter of the optimizer that is not trained (frozen); KeyError else."""
        pipeline = self._opt._pipeline
        if pipeline is not None:
            for pidx, q in enumerate(pipeline.params):
                if q is p:
                    return pidx
        for group in self._opt.param_groups:
            if any(q is p for q in group["params"]):
                return None
        raise KeyError(p)

    def _local(self, pidx) -> bool:
        """Whether this rank holds the parameter's states (always, outside a
        data-parallel group)."""
        opt = self._opt
        return getattr(opt, "_data_parallel", None) is None or \
            _sharded_states.local_param(opt, pidx)

    def _count(self, pidx) -> int:
        pipeline = self._opt._pipeline
        counts = [t for c in pipeline.plan.of_param(pidx)
                  for seg, t in zip(c.segments, pipeline.states.update_counts(c))
                  if seg.param_index == pidx]
        return max(counts, default=0)

    def __getitem__(self, p):
        if not torch.is_tensor(p):
            raise KeyError(p)
        pidx = self._index(p)
        if pidx is not None and not self._local(pidx):
            raise _sharded_states.state_owner_error(self._opt, pidx)
        if pidx is None or self._count(pidx) == 0:
            return types.MappingProxyType({})
        opt = self._opt
        with opt._lock:
            opt._check_usable()
            if opt._pipeline.step.in_step:
                raise FailedPrecondition(
                    f"opt.state[p] of job {opt.job!r} during a step: the daemon has the "
                    "moments of the last committed step; read them after step()")
            opt._mode.quiesce()
            _master, m, v, t = _checkpoint.committed_states(opt, opt._pipeline, [pidx])[pidx]
        return types.MappingProxyType(
            {"step": torch.tensor(float(t)), "exp_avg": m, "exp_avg_sq": v})

    def __contains__(self, p) -> bool:
        try:
            pidx = self._index(p)
        except KeyError:
            return False
        return pidx is not None and self._local(pidx) and self._count(pidx) > 0

    def _updated(self):
        pipeline = self._opt._pipeline
        if pipeline is None:
            return []
        return [p for pidx, p in enumerate(pipeline.params)
                if self._local(pidx) and self._count(pidx) > 0]

    def __iter__(self):
        return iter(self._updated())

    def __len__(self) -> int:
        return len(self._updated())

    def __setitem__(self, p, value):
        raise TypeError(_READ_ONLY)

    def __delitem__(self, p):
        raise TypeError(_READ_ONLY)

    def setdefault(self, p, default=None):
        raise TypeError(_READ_ONLY)

    def update(self, *args, **kwargs):
        raise TypeError(_READ_ONLY)

    def clear(self):
        raise TypeError(_READ_ONLY)

    def __repr__(self) -> str:
        return f"<fuyou.AdamW state of job {self._opt.job!r}: {len(self)} parameters updated>"
