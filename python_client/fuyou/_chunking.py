"""How fuyou.AdamW packs parameters into chunks (pure Python, no daemon).

A chunk is the unit the daemon updates: a run of elements of one dtype, from one
parameter group, on one device. Parameters are packed in reverse order of the
group (backward produces the last layers' gradients first), and a parameter
that appears twice (tied weights) is packed once. A parameter larger than a
chunk is split over several. Frozen parameters (requires_grad=False) are left
out, or, with ``include_frozen`` (the resident mode: torch keeps every
parameter of its groups and updates one once it has a gradient), packed into
chunks of their own, so that unfreezing one later finds its chunk.

Chunk ids are ``group_index << 24 | index_in_group``: the same model, groups and
``chunk_bytes`` give the same ids, so a resumed job maps the same chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Sequence

import torch

__all__ = ["Segment", "Chunk", "plan_chunks", "plan_module_chunks", "trainable_params",
           "SUPPORTED_DTYPES", "DTYPE_CODES", "chunk_id"]

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


def trainable_params(groups: Sequence[Iterable[torch.Tensor]], include_frozen: bool = False
                     ) -> List[List[tuple[int, torch.Tensor]]]:
    """Per group, its trainable parameters as (param_index, param): frozen ones
    left out (`include_frozen`: kept, unless no gradient can reach them: not a
    float dtype fuyou trains, or sparse), a parameter that appears twice (tied)
    kept at its first place."""
    seen: set[int] = set()
    count = 0
    out = []
    for params in groups:
        trainable = []
        for p in params:
            if id(p) in seen:
                continue  # tied to a parameter already packed
            if not p.requires_grad and not (include_frozen and p.dtype in DTYPE_CODES
                                            and not p.is_sparse):
                continue
            if p.dtype not in DTYPE_CODES:
                raise TypeError(f"fuyou.AdamW supports float32, bfloat16 and float16 "
                                f"parameters, not {p.dtype}")
            if p.is_sparse:
                raise TypeError("fuyou.AdamW does not support sparse parameters")
            seen.add(id(p))
            trainable.append((count, p))
            count += 1
        out.append(trainable)
    return out


def plan_chunks(groups: Sequence[Iterable[torch.Tensor]], chunk_bytes: int,
                include_frozen: bool = False) -> tuple[List[Chunk], List[torch.Tensor]]:
    """Packs the trainable parameters of `groups` (lists of tensors) into chunks of
    at most `chunk_bytes` bytes each (`include_frozen`: the frozen ones too, in
    chunks without trainable ones). Returns (chunks in registration order, the
    unique packed params in the order of their param_index)."""
    if chunk_bytes < 8:
        raise ValueError(f"chunk_bytes must be at least 8, got {chunk_bytes}")
    per_group = trainable_params(groups, include_frozen)
    unique: List[torch.Tensor] = [p for trainable in per_group for _, p in trainable]
    chunks: List[Chunk] = []
    for gi, trainable in enumerate(per_group):
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
            if current is not None and current.segments[0].param.requires_grad != p.requires_grad:
                current = None  # frozen and trainable parameters never share a chunk
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


def plan_module_chunks(modules: Sequence[tuple[str, torch.nn.Module]],
                       groups: Sequence[Iterable[torch.Tensor]], chunk_bytes: int,
                       include_frozen: bool = False
                       ) -> tuple[List[Chunk], List[torch.Tensor], Dict[str, List[Chunk]]]:
    """Packs the trainable parameters of `groups` into chunks aligned with the
    modules that own them (offload_params): a parameter belongs to the first
    module of `modules` (``model.named_modules()``) that holds it as its own
    (``recurse=False``; a tied parameter is owned once), a chunk never holds two
    modules' parameters, and a module's parameters take as many chunks of at
    most `chunk_bytes` as they need (a large one is split). Modules are packed
    in reverse order (backward's), each module's parameters in reverse, per
    parameter group, so that chunk ids (``group << 24 | index``) are those of the
    same model every time. `include_frozen`: the frozen parameters too (a
    streamed model's read-only base), never in a chunk with trainable ones.
    Returns (chunks, unique trainable params by param_index, owner module name
    -> its chunks in order). A trainable parameter that no module owns is
    InvalidArgument-worthy: ValueError."""
    if chunk_bytes < 8:
        raise ValueError(f"chunk_bytes must be at least 8, got {chunk_bytes}")
    per_group = trainable_params(groups, include_frozen)
    unique: List[torch.Tensor] = [p for trainable in per_group for _, p in trainable]
    where = {id(p): (gi, pidx) for gi, trainable in enumerate(per_group) for pidx, p in trainable}
    owned: Dict[str, List[torch.Tensor]] = {}
    owner: Dict[int, str] = {}
    for name, module in modules:
        for p in module.parameters(recurse=False):
            if id(p) in where and id(p) not in owner:
                owner[id(p)] = name
                owned.setdefault(name, []).append(p)
    orphans = [where[id(p)][1] for p in unique if id(p) not in owner]
    if orphans:
        raise ValueError(f"parameters {orphans[:8]} of the optimizer belong to no module of the "
                         "model: pass the model whose parameters the optimizer trains")
    next_index = [0] * len(per_group)
    chunks: List[Chunk] = []
    by_module: Dict[str, List[Chunk]] = {}
    for name, _module in reversed(list(modules)):
        params = owned.get(name)
        if not params:
            continue
        mine: List[Chunk] = []
        for gi in range(len(per_group)):
            current: Chunk | None = None
            for p in reversed([p for p in params if where[id(p)][0] == gi]):
                pidx = where[id(p)][1]
                n = p.numel()
                if n == 0:
                    continue
                capacity = max(1, chunk_bytes // p.element_size())
                if current is not None and (current.dtype != p.dtype
                                            or current.device != p.device
                                            or current.segments[0].param.requires_grad
                                            != p.requires_grad
                                            or current.num_elements + n > capacity):
                    current = None  # a parameter is split only over chunks of its own
                start = 0
                while start < n:
                    if current is None or current.num_elements >= capacity:
                        current = Chunk(chunk_id(gi, next_index[gi]), gi, p.dtype, p.device)
                        next_index[gi] += 1
                        chunks.append(current)
                        mine.append(current)
                    take = min(n - start, capacity - current.num_elements)
                    current.add(p, pidx, start, start + take)
                    start += take
        if mine:
            by_module[name] = mine
    return chunks, unique, by_module
