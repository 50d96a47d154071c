"""LoopStats: what the training loop made fuyou do (``opt.loop_stats``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoopStats"]


@dataclass
class LoopStats:
    """What the training loop made fuyou do, counted by the client.

    steps: steps committed. speculative_updates: chunk updates sent while
    backward ran. redone_changed / redone_clipped: chunk updates done again at
    step() because the gradients changed after they were sent, or because
    max_grad_norm clipped them. steps_with_redo: steps with at least one redo.
    rolled_back_skipped: chunk updates rolled back because the step was skipped
    (zero_grad or the next backward without step(), or an inf/nan with loss
    scaling). redo_seconds: wall time step() spent on redos (from the first redo
    sent to the last redone chunk's weights back). fingerprint_seconds: wall time
    spent taking the gradients' fingerprints (at send time and at step(); on a
    GPU, launching the reductions and the one wait for their results).
    journaled_bytes: gradient bytes fuyoud kept in its per-step journal
    (offload_params: every chunk sent during backward, and each undeclared
    accumulation pass into one). replayed: chunk updates redone from the
    journal (also counted in redone_changed / redone_clipped).
    durable_gates: data-parallel steps after which this rank waited for its
    last step to be durable and agreed with every rank that theirs were
    (_dp_durable.py) before writing again; durable_wait_seconds: the time it
    spent there (its own wait and the agreement's all-reduce).
    """

    steps: int = 0
    speculative_updates: int = 0
    redone_changed: int = 0
    redone_clipped: int = 0
    steps_with_redo: int = 0
    rolled_back_skipped: int = 0
    redo_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    journaled_bytes: int = 0
    replayed: int = 0
    durable_gates: int = 0
    durable_wait_seconds: float = 0.0
