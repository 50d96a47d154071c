"""The values of fuyou.v1's enums that the client sends, as plain ints, in one
place: every module that names a state, a redo or an abort reason imports them
from here (none from the pipeline); and ``Hyper``, the AdamW hyper-parameters a
GradReady carries.

The values are literals so that ``import fuyou`` works before the binding is
built; tests/python/test_wire_values.py holds each equal to the binding's
(fuyou._fuyou), which takes them from offload.proto and
proto/include/fuyou/wire_limits.h."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATE_MASTER", "STATE_EXP_AVG", "STATE_EXP_AVG_SQ", "REDO_GRADIENTS_CHANGED",
           "REDO_CLIPPED", "ABORT_SKIPPED_STEP", "ABORT_OVERFLOW", "JOURNAL_NONE",
           "JOURNAL_KEEP", "JOURNAL_ADD", "JOURNAL_REPLAY", "GRAD_OP_MUL", "GRAD_OP_DIV",
           "MAX_CHUNK_SEGMENTS", "MAX_SLOTS", "Hyper"]

# fuyou.v1.StateKind values.
STATE_MASTER, STATE_EXP_AVG, STATE_EXP_AVG_SQ = 1, 2, 3
# fuyou.v1.RedoReason and fuyou.v1.AbortReason values.
REDO_GRADIENTS_CHANGED, REDO_CLIPPED = 1, 2
ABORT_SKIPPED_STEP, ABORT_OVERFLOW = 1, 2
# fuyou.v1.JournalUse and GradOp.Kind (the binding's JOURNAL_* and GRAD_OP_*).
JOURNAL_NONE, JOURNAL_KEEP, JOURNAL_ADD, JOURNAL_REPLAY = 0, 1, 2, 3
GRAD_OP_MUL, GRAD_OP_DIV = 1, 2
# ChunkSpec.segment_elements holds at most this many entries (kMaxChunkSegments);
# a chunk with more is registered as one segment (a missing gradient then counts
# as zeros in it).
MAX_CHUNK_SEGMENTS = 4096


@dataclass(frozen=True)
class Hyper:
    """A parameter group's AdamW hyper-parameters, as floats: the one Python form.
    The binding's send_grad_ready takes it as one object (it reads lr, beta1,
    beta2, eps and weight_decay into clientlib's AdamWHyper, with the update's
    grad_scale); ``maximize`` (torch's: Adam on -grad) is the caller's, which
    negates grad_scale. Two are equal when every field is (a chunk sent with
    other hyper-parameters than its group has now is redone)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool = False

    @staticmethod
    def of_group(group) -> "Hyper":
        """The hyper-parameters of a torch parameter group (a dict) now."""
        beta1, beta2 = group["betas"]
        return Hyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                     float(group["weight_decay"]), bool(group.get("maximize", False)))


# The most shared-memory slots of one session (the daemon refuses more).
MAX_SLOTS = 64
