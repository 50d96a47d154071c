"""The fetched weights of an offload_params model on its devices: blocks (a
module's chunks in one buffer), their residency, the LRU cache within the
device budget, the fetches in flight, and the live-bytes count.

A block is resident (``buffer`` set) or not; resident with ``refs`` > 0 it is in
use (its parameters are views of the buffer), with 0 it is cached (its
parameters are empty placeholders again; evicted least recently used first when
the budget needs room, never one in use). A fetch allocates a fresh buffer:
buffers are never reused, so a view of an old one can only read the weights it
was fetched with. Live bytes are the resident blocks' bytes plus the gradients
held on the devices; before a block is fetched, cached ones are evicted until it
fits in the budget (for backward, its gradients too), so live bytes exceed the
budget only by what is in use at once.

Its parts: the live-bytes count (_live_bytes.py) and the fetches in flight
(_weight_fetches.py). Every method runs with the optimizer's lock held, except
``add_grad_bytes``, which the sender thread calls too.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk
from ._errors import FailedPrecondition
from ._fetched_edits import FetchedEdits
from ._live_bytes import LiveBytes
from ._placeholders import become_placeholder, become_weights
from ._weight_fetches import WeightFetches

__all__ = ["Block", "WeightCache", "make_block", "placeholder"]

_ALIGN = 64  # bytes: where a chunk of another dtype starts in a block's buffer


@dataclass
class _Member:
    """A parameter of a block: `numel` elements of `dtype` at `byte_offset`."""

    param: torch.nn.Parameter
    index: int  # param_index in the optimizer
    byte_offset: int
    numel: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Block:
    """One module's own trainable parameters and their chunks."""

    name: str
    chunks: List[Chunk]
    chunk_offsets: List[int]  # byte offset of each chunk in the buffer
    nbytes: int
    members: List[_Member] = field(default_factory=list)
    device: Optional[torch.device] = None  # where fetched weights go; set at registration
    registered: bool = False
    buffer: Optional[torch.Tensor] = None  # uint8 on `device` while resident
    refs: int = 0
    backward_held: bool = False
    last_use: int = 0

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {len(self.chunks)} chunks, {self.nbytes} bytes)"


def make_block(name: str, chunks: List[Chunk]) -> Block:
    """The block of a module's chunks: packed one after another (a chunk of
    another dtype than the one before starts at a multiple of 64 bytes), its
    parameters contiguous (a split parameter's pieces follow each other)."""
    offsets, offset, prev = [], 0, None
    for c in chunks:
        if prev is not None and c.dtype != prev:
            offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(offset)
        offset += c.nbytes
        prev = c.dtype
    nbytes = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
    block = Block(name, chunks, offsets, nbytes)
    seen = set()
    for c, base in zip(chunks, offsets):
        for seg in c.segments:
            if seg.param_index in seen:
                continue  # its first piece gave the offset; the pieces are contiguous
            seen.add(seg.param_index)
            esize = c.element_size
            start = base + (seg.offset - seg.start) * esize
            block.members.append(_Member(seg.param, seg.param_index, start,
                                         seg.param.numel(), tuple(seg.param.shape), c.dtype))
    return block


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a parameter is between uses: no storage (its shape is the block's)."""
    return torch.empty(0, dtype=dtype, device=device)


class WeightCache:
    """The blocks' buffers of one offload job (see the module doc).

    Args:
        pipeline: the optimizer's ChunkPipeline (session, slot views, sender).
        layout: the offload's ModuleBlocks (filled by OffloadedParams.bind;
            shared, not copied).
        timeout: seconds a wait on the daemon may take.
    """

    def __init__(self, pipeline, layout, timeout: float):
        self._pipeline = pipeline
        self._layout = layout
        self.device_budget: Optional[int] = None  # None: no caching (released = evicted)
        self._cache: "collections.OrderedDict[int, Block]" = collections.OrderedDict()
        self._resident: Dict[int, Block] = {}  # id -> block with a buffer
        self._live = LiveBytes()
        self._fetches = WeightFetches(pipeline, timeout)
        self._tick = 0
        self.cache_hits = 0  # blocks acquired while still resident
        self.placeholder_class = None  # the offload's (_placeholders.py): set by OffloadedParams
        self.edits = FetchedEdits()  # edits of fetched weights while a module held them

    @property
    def live_bytes(self) -> int:
        """Bytes of fetched weights (in use and cached) plus gradients held on
        the modules' devices now."""
        return self._live.now

    @property
    def peak_live_bytes(self) -> int:
        """The most ``live_bytes`` seen (settable: a stream resets it)."""
        return self._live.peak

    @peak_live_bytes.setter
    def peak_live_bytes(self, value: int) -> None:
        self._live.peak = value

    @property
    def fetches(self) -> int:
        """Chunks fetched from the daemon (not served by the cache)."""
        return self._fetches.fetches

    @property
    def prefetches(self) -> int:
        """Chunk fetches started ahead of their use."""
        return self._fetches.prefetches

    def add_grad_bytes(self, n: int) -> None:
        """Gradients of `n` bytes (negative: freed) on the modules' devices; the
        sender thread calls it once it copied a chunk's gradients."""
        self._live.add_grads(n)

    def acquire(self, block: Block, backward: bool = False) -> None:
        """One more use of `block`: fetched (or taken from the cache) and its
        parameters' ``.data`` made views of its buffer. Before a fetch, cached
        blocks are evicted until the block fits in the budget, and for
        `backward` its gradients too (when what is in use leaves no room, the
        budget is exceeded by the block's own bytes)."""
        self._tick += 1
        block.last_use = self._tick
        if block.buffer is None:
            self._make_room(block.nbytes * (2 if backward else 1))
            self._load(block)
        elif block.refs == 0:
            self._cache.pop(id(block), None)
            self.cache_hits += 1
        if block.refs == 0:
            self._install_views(block)
        block.refs += 1

    def release(self, block: Block) -> None:
        """One use of `block` less; at none its parameters are placeholders again
        and the buffer stays cached (within the budget) or goes."""
        if block.refs <= 0:
            return
        block.refs -= 1
        if block.refs > 0:
            return
        for m in block.members:
            become_placeholder(m.param, placeholder(m.dtype, block.device), self.placeholder_class)
        self._cache[id(block)] = block
        self._cache.move_to_end(id(block))
        if not self.device_budget or self._live.now > self.device_budget:
            self._make_room(0)

    def hold_for_backward(self, block: Block) -> None:
        """Acquires `block` for the backward pass (once per pass): released when
        its chunks' gradients are complete or backward ends."""
        if not block.backward_held:
            self.acquire(block, backward=True)
            block.backward_held = True

    def release_backward(self, block: Block) -> None:
        if block.backward_held:
            block.backward_held = False
            self.release(block)

    def release_backward_holds(self) -> None:
        """End of a backward pass (or of a step): every backward hold goes."""
        for b in self._layout.blocks:
            self.release_backward(b)

    def reset_grad_bytes(self) -> None:
        """The step is over: no gradient is held any more."""
        self._live.reset_grads()

    def _make_room(self, need: int) -> None:
        """Evicts cached blocks, least recently used first, until `need` more
        bytes fit in the budget (no budget: every cached block goes); waits for
        the sender thread to copy the gradients it holds when that is not enough."""
        budget = self.device_budget or 0
        for attempt in range(2):
            while self._cache and self.live_bytes + need > budget:
                _key, victim = self._cache.popitem(last=False)
                self._evict(victim)
            if self.live_bytes + need <= budget or attempt or not self._live.grads:
                return
            self._pipeline.wait_sent()  # gradients copied to the slots are freed

    def _evict(self, block: Block) -> None:
        self.edits.evicted(block)
        block.buffer = None
        self._resident.pop(id(block), None)
        self._live.resident -= block.nbytes

    def drop_cache(self) -> None:
        """Forgets every cached block (their weights changed: a step committed)
        and the fetches in flight."""
        while self._cache:
            _key, victim = self._cache.popitem(last=False)
            self._evict(victim)
        self.drain_fetches()

    def drain_fetches(self) -> None:
        self._fetches.drain()

    def prefetch(self, chunk: Chunk) -> bool:
        """Starts fetching `chunk` (FetchWeights into a reserved slot) unless it
        is resident or in flight or every fetch slot is taken but one. Returns
        False when no slot was left."""
        if self._layout.of_chunk[chunk.chunk_id].buffer is not None:
            return True
        return self._fetches.prefetch(chunk)

    @property
    def fetches_in_flight(self) -> int:
        return len(self._fetches)

    def _load(self, block: Block) -> None:
        """Fetches the block's chunks into a fresh buffer on its device."""
        if not block.registered:
            raise FailedPrecondition(f"module {block.name!r} is not registered with the daemon: "
                                     "fuyou.stream_parameters or offload.register_module first")
        buf = torch.empty(block.nbytes, dtype=torch.uint8, device=block.device)
        for c, offset in zip(block.chunks, block.chunk_offsets):
            self._fetches.copy_into(c, buf[offset:offset + c.nbytes].view(c.dtype))
        block.buffer = buf
        self.edits.fetched(block)
        self._resident[id(block)] = block
        self._live.resident += block.nbytes
        self._live.note()

    def _install_views(self, block: Block) -> None:
        buf = block.buffer
        for m in block.members:
            nbytes = m.numel * torch.empty((), dtype=m.dtype).element_size()
            become_weights(m.param, buf[m.byte_offset:m.byte_offset + nbytes].view(m.dtype)
                           .view(m.shape))

    def edited_members(self):
        """(block, member) of the parameters whose fetched weights changed
        since their fetch (FetchedEdits.edited)."""
        return self.edits.edited(list(self._resident.values()))

    def block_holding(self, t: torch.Tensor) -> Optional[Tuple[Block, int]]:
        """The resident block whose buffer holds `t`'s first element, and the
        byte offset there (for saved tensors of backward)."""
        if t.numel() == 0 or t.device.type == "meta":
            return None
        ptr = t.data_ptr()
        for b in self._resident.values():
            buf = b.buffer
            if buf is not None and buf.device == t.device:
                start = buf.data_ptr()
                if start <= ptr < start + b.nbytes:
                    return b, ptr - start
        return None
