"""PassEnd: a function run once at the end of every backward pass, after every
other end-of-backward callback of that pass (DDP's, which writes its averages
into ``.grad``); and ``grad_stamp``, which says whether ``.grad`` was written.

A hook of the pass ``arm()``s it: autograd's ``queue_callback`` (how DDP
finishes its buckets) queues a first callback, which queues the function
itself, so it runs after the callbacks queued later in the pass (DDP queues
its own once its last bucket is ready). Used by the data-parallel modes
(_sharded_mode.py, _sharded_streamed.py) to write the ranks' average into
``.grad`` as DDP does.

With reentrant activation checkpointing (``torch.utils.checkpoint`` with
``use_reentrant=True``) each checkpointed block's backward is a backward pass
of its own, and ends as one."""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

__all__ = ["PassEnd", "grad_stamp"]

_ENGINE = torch.autograd.Variable._execution_engine


def grad_stamp(p: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(storage address, version) of ``p.grad``: it differs once ``.grad`` was
    written in place (``copy_``, ``mul_``: the version counts) or replaced; None
    without a gradient."""
    g = p.grad
    return None if g is None else (g.data_ptr(), g._version)


class PassEnd:
    """Runs `owner.<method>()` once at the end of each backward pass a hook
    armed it in. Holds `owner` weakly: nothing runs once it is gone."""

    def __init__(self, owner, method: str):
        self._owner = weakref.ref(owner)
        self._method = method
        self._armed = False

    def arm(self) -> None:
        """From a backward hook: the function runs at the end of this pass (once,
        however many hooks arm it)."""
        if self._armed:
            return
        self._armed = True
        _ENGINE.queue_callback(self._queue_last)

    def disarm(self) -> None:
        """Forgets an armed pass whose end never ran (its backward raised): the
        next pass arms again. Call between steps."""
        self._armed = False

    def _queue_last(self) -> None:
        _ENGINE.queue_callback(self._run)  # after the callbacks queued during the pass

    def _run(self) -> None:
        self._armed = False
        owner = self._owner()
        if owner is not None:
            getattr(owner, self._method)()


