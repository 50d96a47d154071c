"""ChunkPlan: a pipeline's chunks and which parameters each one holds.

The plan is fixed once chunks are registered (offload_params plans it from the
model's modules after the optimizer was made, then ``ChunkPipeline.set_chunks``
replaces it). It answers the two questions every hook asks: which chunks hold
a parameter, and which parameters a chunk holds."""

from __future__ import annotations

from typing import Dict, List

from ._chunking import Chunk

__all__ = ["ChunkPlan"]


class ChunkPlan:
    """`chunks` in registration order over `num_params` parameters (indices as
    ``Segment.param_index``)."""

    def __init__(self, chunks: List[Chunk], num_params: int):
        self.chunks = chunks
        self._of_param: List[List[Chunk]] = [[] for _ in range(num_params)]
        for c in chunks:
            for seg in c.segments:
                holders = self._of_param[seg.param_index]
                if not holders or holders[-1] is not c:
                    holders.append(c)
        self._by_id: Dict[int, Chunk] = {c.chunk_id: c for c in chunks}
        self._params_of: Dict[int, List[int]] = {
            c.chunk_id: sorted({s.param_index for s in c.segments}) for c in chunks}

    def chunk(self, chunk_id: int) -> Chunk:
        return self._by_id[chunk_id]

    def of_param(self, index: int) -> List[Chunk]:
        """The chunks with a segment of parameter `index`, in plan order."""
        return self._of_param[index]

    def params_of(self, chunk_id: int) -> List[int]:
        """Indices of the parameters with a segment in the chunk, ascending."""
        return self._params_of[chunk_id]
