"""How fuyou.AdamW packs parameters into chunks (pure Python, no daemon).

A chunk is the unit the daemon updates: a run of elements of one dtype, from one
parameter group, on one device. Parameters are packed in reverse order of the
group (backward produces the last layers' gradients first), frozen parameters
(requires_grad=False) are left out, and a parameter that appears twice (tied
weights) is packed once. A parameter larger than a chunk is split over several.

Chunk ids are ``group_index << 24 | index_in_group``: the same model, groups and
``chunk_bytes`` give the same ids, so a resumed job maps the same chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, List, Sequence

import torch

__all__ = ["Segment", "Chunk", "plan_chunks", "SUPPORTED_DTYPES", "DTYPE_CODES", "chunk_id"]

# dtype -> fuyou.v1.DType value.
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
SUPPORTED_DTYPES = tuple(DTYPE_CODES)
GROUP_SHIFT = 24
MAX_GROUPS = 256


def chunk_id(group_index: int, index_in_group: int) -> int:
    if not 0 <= group_index < MAX_GROUPS:
        raise ValueError(f"fuyou.AdamW supports at most {MAX_GROUPS} parameter groups")
    if not 0 <= index_in_group < (1 << GROUP_SHIFT):
        raise ValueError("too many chunks in one parameter group; raise chunk_bytes")
    return (group_index << GROUP_SHIFT) | index_in_group


@dataclass
class Segment:
    """Elements [start, end) of the flattened parameter `param`, stored at
    [offset, offset + end - start) of its chunk."""

    param: torch.nn.Parameter
    param_index: int  # index in the optimizer's list of unique trainable params
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class Chunk:
    chunk_id: int
    group_index: int
    dtype: torch.dtype
    device: torch.device
    segments: List[Segment] = field(default_factory=list)
    num_elements: int = 0

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.num_elements * self.element_size

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    @property
    def layout_fingerprint(self) -> int:
        """A stable 64-bit hash of what the chunk packs: for each segment in
        order, the parameter's shape and dtype and the piece [start, end) of it.
        The daemon stores it with the chunk and refuses a resume whose chunk has
        the same element count but another layout (ChunkSpec.layout_fingerprint
        in proto/fuyou/v1/offload.proto). Never 0 (0 means "none given")."""
        digest = hashlib.blake2b(digest_size=8, person=b"fuyou-layout-v1")
        for seg in self.segments:
            shape = ",".join(str(d) for d in seg.param.shape)
            digest.update(f"({shape}):{seg.param.dtype}:{seg.start}:{seg.end};".encode())
        return int.from_bytes(digest.digest(), "little") or 1

    def layout_description(self) -> str:
        """The chunk's parameter layout for error messages: shapes and dtypes."""
        parts = []
        for seg in self.segments:
            shape = "x".join(str(d) for d in seg.param.shape) or "scalar"
            piece = "" if seg.numel == seg.param.numel() else f"[{seg.start}:{seg.end}]"
            parts.append(f"{shape} {str(seg.param.dtype).replace('torch.', '')}{piece}")
        return "[" + ", ".join(parts) + "]"

    def add(self, param, param_index: int, start: int, end: int) -> None:
        self.segments.append(Segment(param, param_index, start, end, self.num_elements))
        self.num_elements += end - start

    def __repr__(self) -> str:
        return (f"Chunk(id={self.chunk_id:#x}, group={self.group_index}, {self.dtype}, "
                f"{self.num_elements} elements in {len(self.segments)} segments)")


def plan_chunks(groups: Sequence[Iterable[torch.Tensor]], chunk_bytes: int
                ) -> tuple[List[Chunk], List[torch.Tensor]]:
    """Packs the trainable parameters of `groups` (lists of tensors) into chunks of
    at most `chunk_bytes` bytes each. Returns (chunks in registration order, the
    unique trainable params in the order of their param_index)."""
    if chunk_bytes < 8:
        raise ValueError(f"chunk_bytes must be at least 8, got {chunk_bytes}")
    seen: set[int] = set()
    unique: List[torch.Tensor] = []
    chunks: List[Chunk] = []
    for gi, params in enumerate(groups):
        trainable = []
        for p in params:
            if not p.requires_grad or id(p) in seen:
                continue  # frozen, or tied to a parameter already packed
            if p.dtype not in DTYPE_CODES:
                raise TypeError(f"fuyou.AdamW supports float32, bfloat16 and float16 "
                                f"parameters, not {p.dtype}")
            if p.is_sparse:
                raise TypeError("fuyou.AdamW does not support sparse parameters")
            seen.add(id(p))
            trainable.append((len(unique), p))
            unique.append(p)
        current: Chunk | None = None
        index_in_group = 0

        def new_chunk(p) -> Chunk:
            nonlocal index_in_group
            c = Chunk(chunk_id(gi, index_in_group), gi, p.dtype, p.device)
            index_in_group += 1
            chunks.append(c)
            return c

        for pidx, p in reversed(trainable):
            n = p.numel()
            if n == 0:
                continue
            capacity = max(1, chunk_bytes // p.element_size())
            if current is not None and (current.dtype != p.dtype or current.device != p.device
                                        or current.num_elements + n > capacity):
                if n <= capacity or current.dtype != p.dtype or current.device != p.device:
                    current = None
            start = 0
            while start < n:
                if current is None or current.num_elements >= capacity:
                    current = new_chunk(p)
                take = min(n - start, capacity - current.num_elements)
                current.add(p, pidx, start, start + take)
                start += take
    return chunks, unique
