"""WeightFetches: the FetchWeights requests of an offload_params model in
flight, each into one of the session's slots reserved for fetches, oldest
first, and the counts of chunks fetched and prefetched.

A fetch is started on demand (a block is loaded) or ahead of its use
(``prefetch``, which leaves one slot free for a demanded chunk); a chunk
whose fetch is in flight is waited for, copied out of its slot and the slot
released. Every method runs with the optimizer's lock held."""

from __future__ import annotations

import collections

import torch

from ._chunking import Chunk

__all__ = ["WeightFetches", "FETCH_SLOTS"]

# Session slots reserved for weight fetches, beside the gradient slots
# (num_slots): a demanded chunk and at most FETCH_SLOTS - 1 prefetched ones.
FETCH_SLOTS = 4


class WeightFetches:
    """The fetches through one pipeline's session (`timeout`: seconds a wait
    on the daemon may take)."""

    def __init__(self, pipeline, timeout: float):
        self._pipeline = pipeline
        self._timeout = float(timeout)
        self._fetching: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self.fetches = 0  # chunks fetched from the daemon and copied out
        self.prefetches = 0  # chunk fetches started ahead of their use

    def __len__(self) -> int:
        return len(self._fetching)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._fetching

    def prefetch(self, chunk: Chunk) -> bool:
        """Starts fetching `chunk` unless it is in flight or every fetch slot is
        taken but one. Returns False when no slot was left."""
        if chunk.chunk_id in self._fetching:
            return True
        if len(self._fetching) >= FETCH_SLOTS - 1:
            return False
        self.start(chunk)
        self.prefetches += 1
        return True

    def start(self, chunk: Chunk) -> None:
        """Sends FetchWeights for `chunk` into a slot (when all fetch slots are
        taken, the oldest fetch is waited for and dropped first)."""
        session = self._pipeline.session
        if len(self._fetching) >= FETCH_SLOTS:  # never with prefetch < FETCH_SLOTS
            cid, _slot = self._fetching.popitem(last=False)
            session.release_slot(session.wait_weights(cid, self._timeout))
        slot = session.acquire_slot(self._timeout)
        try:
            session.send_fetch_weights(chunk.chunk_id, slot)
        except BaseException:
            session.release_slot(slot)
            raise
        self._fetching[chunk.chunk_id] = slot

    def copy_into(self, chunk: Chunk, dst: torch.Tensor) -> None:
        """`chunk`'s weights into `dst` (its elements, of its dtype), fetched
        now unless a fetch is in flight; its slot is released."""
        session = self._pipeline.session
        if chunk.chunk_id not in self._fetching:
            self.start(chunk)
        slot = session.wait_weights(chunk.chunk_id, self._timeout)
        self._fetching.pop(chunk.chunk_id, None)
        try:
            src = self._pipeline.slots.view(slot, "param", chunk.dtype)[:chunk.num_elements]
            dst.copy_(src)
        finally:
            session.release_slot(slot)
        self.fetches += 1

    def drain(self) -> None:
        """Waits for every fetch in flight and releases its slot (unused)."""
        session = self._pipeline.session
        while self._fetching:
            cid, _slot = self._fetching.popitem(last=False)
            session.release_slot(session.wait_weights(cid, self._timeout))
