"""ChunkStates (``pipeline.states``): the job's chunks as the daemon holds them
between steps: registration, the committed fp32 states (ReadState), an import
(WriteState, update counts, CommitImport), and each segment's Adam update count.

The states travel through the session's shared memory, never through gRPC
messages. Every method is called with the optimizer's lock held and no step in
flight (an import never advances the committed step)."""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from ._chunk_weights import as_byte_buffer
from ._chunking import Chunk
from ._errors import FailedPrecondition
from ._protocol import MAX_CHUNK_SEGMENTS, STATE_EXP_AVG, STATE_EXP_AVG_SQ, STATE_MASTER

__all__ = ["ChunkStates"]


class ChunkStates:
    """The registered chunks of one session and their committed states."""

    def __init__(self, chunks: List[Chunk], moments_dtype: int = 1):
        self.session = None  # set by ChunkPipeline.attach
        # The DType code of the chunks' moments (1 fp32, 2 bf16, 4 8-bit blocks: AdamW state_dtype).
        self.moments_dtype = moments_dtype
        # Per chunk, per segment: Adam updates committed (the daemon's count).
        self._counts: Dict[int, List[int]] = {}
        self.set_chunks(chunks)

    def set_chunks(self, chunks: List[Chunk]) -> None:
        """A new chunk plan (before any chunk is registered): no update counted."""
        self._counts = {c.chunk_id: [0] * len(c.segments) for c in chunks}

    def register(self, c: Chunk, buf: torch.Tensor, store_weights: bool = False) -> bool:
        """Registers chunk `c` with the session; `buf` (packed, on the CPU) holds
        a new chunk's initial weights, or receives a resumed chunk's committed
        ones. `store_weights`: the daemon keeps the chunk's working weights
        (offload_params). Returns True when the chunk was resumed."""
        segments = ([seg.numel for seg in c.segments]
                    if len(c.segments) <= MAX_CHUNK_SEGMENTS else [])
        extra = {"store_weights": True} if store_weights else {}
        if self.moments_dtype != 1:
            extra["moments_dtype"] = self.moments_dtype
        try:
            registered = self.session.register_chunk(
                c.chunk_id, c.num_elements, c.dtype_code, c.dtype_code,
                as_byte_buffer(buf), layout_fingerprint=c.layout_fingerprint,
                segment_elements=segments, **extra)
        except FailedPrecondition as e:
            if "fingerprint" not in e.message:
                raise
            raise FailedPrecondition(
                f"{e.message} (this model's chunk {c.chunk_id:#x} holds "
                f"{c.layout_description()})", e.code) from None
        resumed, count = bool(registered[0]), int(registered[1])
        per_segment = list(registered[2]) if len(registered) > 2 else []
        if len(per_segment) != len(c.segments):
            per_segment = [count] * len(c.segments)
        self._counts[c.chunk_id] = [int(t) for t in per_segment]
        return resumed

    def read(self, c: Chunk) -> Tuple[List[torch.Tensor], int]:
        """The chunk's committed fp32 (master, exp_avg, exp_avg_sq) and its update
        count. Between steps only."""
        states = [torch.empty(c.num_elements, dtype=torch.float32) for _ in range(3)]
        t = 0
        for kind, buf in zip((STATE_MASTER, STATE_EXP_AVG, STATE_EXP_AVG_SQ), states):
            t = self.session.read_state(c.chunk_id, kind, 0, buf.numpy())
        return states, int(t)

    def update_counts(self, c: Chunk) -> List[int]:
        """Committed Adam updates of each of the chunk's segments (a parameter
        without a gradient in a step is not updated, as in torch)."""
        return list(self._counts[c.chunk_id])

    def read_master(self, c: Chunk) -> torch.Tensor:
        """The chunk's committed fp32 master weights. Between steps only."""
        master = torch.empty(c.num_elements, dtype=torch.float32)
        self.session.read_state(c.chunk_id, STATE_MASTER, 0, master.numpy())
        return master

    def write(self, c: Chunk, kind: int, values: torch.Tensor) -> None:
        """Replaces one fp32 state of the chunk, as part of the pending import."""
        self.session.write_state(c.chunk_id, kind, 0, values.numpy())

    def set_update_count(self, c: Chunk, counts: List[int]) -> None:
        """Sets the Adam step count of each of the chunk's segments, as part of the
        pending import (a chunk registered as one segment takes the largest)."""
        counts = [int(t) for t in counts]
        largest = max(counts)
        if len(set(counts)) == 1 or len(c.segments) > MAX_CHUNK_SEGMENTS:
            self.session.set_update_count(c.chunk_id, largest)
            counts = [largest] * len(c.segments)
        else:
            self.session.set_update_count(c.chunk_id, largest, segment_update_counts=counts)
        self._counts[c.chunk_id] = counts

    def commit_import(self) -> None:
        """Makes the pending import durable (one atomic commit)."""
        self.session.commit_import()

    def count_committed(self, updated: Iterable[Tuple[int, Tuple[int, ...]]]) -> None:
        """A step committed: each (chunk id, segments not updated) of `updated`
        had its other segments updated once more."""
        for cid, not_updated in updated:
            counts = self._counts[cid]
            for i in range(len(counts)):
                if i not in not_updated:
                    counts[i] += 1
