"""The values of fuyou.v1's enums that the client sends, as plain ints, in one
place: every module that names a state, a redo or an abort reason imports them
from here (none from the pipeline)."""

from __future__ import annotations

from typing import Tuple

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

# (lr, beta1, beta2, eps, weight_decay, maximize) of a chunk's parameter group, now.
Hyper = Tuple[float, float, float, float, float, bool]

# The most shared-memory slots of one session (the daemon refuses more).
MAX_SLOTS = 64
