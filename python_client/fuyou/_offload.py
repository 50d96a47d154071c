"""offload_params: a model's working weights live in fuyoud, not in the model.

``fuyou.AdamW(..., offload_params=True)`` keeps every trainable parameter's
weights in the daemon (ChunkSpec.store_weights: a fourth chunk state beside the
fp32 master, m and v). Between uses a parameter is an empty placeholder (no
storage; shape, dtype and device remembered here); :class:`OffloadedParams`
brings a module's weights in on demand (FetchWeights into a slot, then one copy
into a freshly allocated tensor on the module's device whose views become the
parameters' ``.data``), keeps released ones in an LRU cache within a byte
budget, and handles the gradients of a chunk once they are complete (send and
free, or keep on the host for clipping and accumulation).

Units::

    module ----- owns ----> Block (its own trainable parameters, recurse=False,
                             packed in its chunks one after another in one buffer)
    module --- uses ---> Blocks of its own parameters' owners (a tied parameter is
                          owned by one module and used by several)

A block is resident (``buffer`` set) or not; resident with ``refs`` > 0 it is in
use, with 0 it is cached (evicted least recently used first when the budget
needs room; never one in use). Live bytes are the resident blocks' bytes plus
the gradients the model holds on the device; they never exceed the budget plus
the block demanded (the budget is exceeded only by what is in use at once).

Every method runs with the optimizer's lock held (hooks take it), except the
gradient-bytes count, which the sender thread lowers once it copied a chunk.
``fuyou.stream_parameters`` (_stream.py) installs the module hooks that call
``acquire``/``release`` and the backward holds.
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk, plan_module_chunks
from ._errors import FailedPrecondition, InvalidArgument
from ._materialize import is_empty

__all__ = ["OffloadedParams", "Block", "FETCH_SLOTS"]

# Session slots reserved for weight fetches, beside the gradient slots
# (num_slots): a demanded chunk and at most FETCH_SLOTS - 1 prefetched ones.
FETCH_SLOTS = 4
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


def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


class OffloadedParams:
    """The trainable parameters of one model whose working weights live in the
    optimizer's job (``optimizer.offload`` of a ``fuyou.AdamW`` opened with
    ``offload_params=True``).

    Life cycle: :meth:`bind` (plans the chunks from the model, once), then
    :meth:`register_module` for every module (``fuyou.stream_parameters`` does
    it for the modules not registered yet; ``fuyou.materialize`` one module at a
    time), then streaming.
    """

    def __init__(self, optimizer, pipeline, chunk_bytes: int, timeout: float):
        self._optimizer = weakref.ref(optimizer)
        self._pipeline = pipeline
        self._chunk_bytes = int(chunk_bytes)
        self._timeout = float(timeout)
        self._lock = pipeline.lock
        self.model: Optional[torch.nn.Module] = None
        self.blocks: List[Block] = []
        self._block_of_module: Dict[int, Block] = {}  # id(module) -> its own block
        self._uses: Dict[int, List[Block]] = {}  # id(module) -> blocks its forward needs
        self._block_of_param: Dict[int, Block] = {}  # param_index -> owner block
        self._block_of_chunk: Dict[int, Block] = {}
        self._modules: List[Tuple[str, torch.nn.Module]] = []
        self.resumed = False
        # Residency.
        self.device_budget: Optional[int] = None  # None: no caching (released = evicted)
        self._cache: "collections.OrderedDict[int, Block]" = collections.OrderedDict()
        self._resident: Dict[int, Block] = {}  # id -> block with a buffer
        self._resident_bytes = 0
        self._count_lock = threading.Lock()
        self._grad_bytes = 0
        self.peak_live_bytes = 0
        self._tick = 0
        self._fetching: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self.fetches = 0  # chunks fetched from the daemon (not served by the cache)
        self.cache_hits = 0  # blocks acquired while still resident
        # Gradients of this step kept on the host (clipping, accumulation):
        # chunk_id -> (packed gradients, segments without any).
        self._host: Dict[int, Tuple[torch.Tensor, set]] = {}
        self._streams: list = []

    # ------------------------------------------------------------ planning
    @property
    def bound(self) -> bool:
        return self.model is not None

    def bind(self, model: torch.nn.Module) -> None:
        """Plans the chunks from `model`'s modules (once, before any
        registration): chunks follow modules (never two modules' own parameters
        in one; a module's parameters may need several), in backward order, ids
        stable for the same model and ``chunk_bytes``. The optimizer's trainable
        parameters must all be owned by modules of `model`."""
        with self._lock:
            if self.model is not None:
                if self.model is model:
                    return
                raise InvalidArgument("this optimizer's offload is bound to another model; "
                                      "open one fuyou.AdamW per model")
            opt = self._optimizer()
            modules = list(model.named_modules())
            try:
                chunks, unique, by_module = plan_module_chunks(
                    modules, [g["params"] for g in opt.param_groups], self._chunk_bytes)
            except ValueError as e:
                raise InvalidArgument(f"offload_params for job {opt.job!r}: {e}") from None
            if [id(p) for p in unique] != [id(p) for p in self._pipeline.params]:
                raise InvalidArgument("the optimizer's parameters changed since it was made")
            self._pipeline.set_chunks(chunks)
            by_name = dict(modules)
            for name, mine in by_module.items():
                block = self._make_block(name, mine)
                self.blocks.append(block)
                self._block_of_module[id(by_name[name])] = block
                for c in mine:
                    self._block_of_chunk[c.chunk_id] = block
                for m in block.members:
                    self._block_of_param[m.index] = block
            index_of = {id(p): i for i, p in enumerate(self._pipeline.params)}
            for name, module in modules:
                uses: List[Block] = []
                for p in module.parameters(recurse=False):
                    i = index_of.get(id(p))
                    b = self._block_of_param.get(i) if i is not None else None
                    if b is not None and b not in uses:
                        uses.append(b)
                if uses:
                    self._uses[id(module)] = uses
            self._modules = modules
            self.model = model

    def _make_block(self, name: str, chunks: List[Chunk]) -> Block:
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

    def uses(self, module: torch.nn.Module) -> List[Block]:
        """The blocks `module`'s forward needs (its own parameters' owners)."""
        return self._uses.get(id(module), [])

    # ------------------------------------------------------------ registration
    @property
    def job_exists(self) -> bool:
        """True when the job already has chunks in the daemon (a resume: the
        daemon's committed weights replace the modules' values, which need not
        be initialised)."""
        session = self._pipeline.session
        existing = getattr(session, "existing_chunks", None)
        if existing is not None:
            return int(existing) > 0
        return int(session.committed_step) > 0

    @property
    def registered(self) -> bool:
        """Every module's parameters are registered with the daemon."""
        return self.model is not None and all(b.registered for b in self.blocks)

    def register_module(self, module: torch.nn.Module,
                        device: Optional[torch.device] = None) -> bool:
        """Registers the chunks of `module`'s own parameters (``recurse=False``;
        a tied parameter owned by another module is left to it) with
        ``store_weights``. A new chunk takes the parameters' current values; a
        chunk the job already has keeps the daemon's committed weights (the
        current values are ignored, and may be uninitialised or on ``meta``).
        Then each parameter's storage is released: it becomes an empty
        placeholder on `device` (default: its own device, the CPU for ``meta``),
        where its weights are fetched to. Returns True when the module's chunks
        were resumed. Registering a module twice does nothing."""
        with self._lock:
            if self.model is None:
                raise FailedPrecondition("offload: bind(model) before register_module")
            block = self._block_of_module.get(id(module))
            if block is None or block.registered:
                return False
            opt = self._optimizer()
            pipeline = self._pipeline
            # Parameters without values: on meta, or fuyou.init_empty's empty ones.
            on_meta = any(is_empty(m.param) for m in block.members)
            exists = self.job_exists
            if on_meta and not exists:
                raise FailedPrecondition(
                    f"module {block.name!r} has parameters without values (on the meta device "
                    f"or built in fuyou.init_empty) and job "
                    f"{opt.job!r} is new: initialise them (fuyou.materialize) before they are "
                    "registered")
            resumed_any = False
            with torch.no_grad():
                for c in block.chunks:
                    if on_meta:
                        buf = torch.zeros(c.num_elements, dtype=c.dtype)
                    else:
                        buf = pipeline.gather_weights(c)
                    resumed = pipeline.register_chunk(c, buf, store_weights=True)
                    if on_meta and not resumed:
                        raise FailedPrecondition(
                            f"job {opt.job!r} has no chunk {c.chunk_id:#x} for module "
                            f"{block.name!r} (a new chunk got zeros): the model differs from "
                            "the job's; initialise the module and register it again in a new job")
                    resumed_any |= resumed
            if device is None:
                devices = {m.param.device for m in block.members if not m.param.is_meta}
                device = devices.pop() if len(devices) == 1 else torch.device("cpu")
            block.device = torch.device(device)
            for m in block.members:
                if m.param.is_meta:  # set_data cannot leave meta: a new Parameter object
                    self._replace_param(m.param, torch.nn.Parameter(
                        _placeholder(m.dtype, block.device), requires_grad=m.param.requires_grad))
                p = m.param
                # The AccumulateGrad node takes its shape, dtype and device from the
                # parameter: made while it looks like itself, kept across set_data.
                p.data = torch.empty(1, dtype=m.dtype, device=block.device).expand(m.shape)
                pipeline.install_hooks([m.index])
                p.data = _placeholder(m.dtype, block.device)
            block.registered = True
            if resumed_any:
                self.resumed = True
                opt.resumed = True
            if self.registered:
                pipeline.set_device()
                pipeline.pin_slots()
            return resumed_any

    def _replace_param(self, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
        """Puts `new` wherever `old` is: every module holding it, the optimizer's
        groups, the pipeline's parameters and chunks, this offload's blocks."""
        for _name, module in self._modules:
            for key, value in list(module._parameters.items()):
                if value is old:
                    module._parameters[key] = new
        opt = self._optimizer()
        for group in opt.param_groups:
            group["params"] = [new if q is old else q for q in group["params"]]
        params = self._pipeline.params
        for i, q in enumerate(params):
            if q is old:
                params[i] = new
        for c in self._pipeline.chunks:
            for seg in c.segments:
                if seg.param is old:
                    seg.param = new
        for b in self.blocks:
            for m in b.members:
                if m.param is old:
                    m.param = new

    def register_all(self) -> None:
        """Registers every module not registered yet (a model built normally)."""
        for _name, module in self._modules:
            self.register_module(module)

    @property
    def committed_step(self) -> int:
        return self._pipeline.committed_step

    # ------------------------------------------------------------ residency
    @property
    def live_bytes(self) -> int:
        """Bytes of fetched weights (in use and cached) plus gradients held on
        the modules' devices now."""
        return self._resident_bytes + self._grad_bytes

    def _note_live(self) -> None:
        live = self._resident_bytes + self._grad_bytes
        if live > self.peak_live_bytes:
            self.peak_live_bytes = live

    def _add_grad_bytes(self, n: int) -> None:
        with self._count_lock:
            self._grad_bytes += n
        self._note_live()

    def block_of_param(self, index: int) -> Optional[Block]:
        return self._block_of_param.get(index)

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
            m.param.data = _placeholder(m.dtype, block.device)
        self._cache[id(block)] = block
        self._cache.move_to_end(id(block))
        if not self.device_budget or self._resident_bytes + self._grad_bytes > self.device_budget:
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
        for b in self.blocks:
            self.release_backward(b)

    def _make_room(self, need: int) -> None:
        """Evicts cached blocks, least recently used first, until `need` more
        bytes fit in the budget (no budget: every cached block goes); waits for
        the sender thread to copy the gradients it holds when that is not enough."""
        budget = self.device_budget or 0
        for attempt in range(2):
            while self._cache and self.live_bytes + need > budget:
                _key, victim = self._cache.popitem(last=False)
                self._evict(victim)
            if self.live_bytes + need <= budget or attempt or not self._grad_bytes:
                return
            self._pipeline.wait_sent()  # gradients copied to the slots are freed

    def _evict(self, block: Block) -> None:
        block.buffer = None
        self._resident.pop(id(block), None)
        self._resident_bytes -= block.nbytes

    def drop_cache(self) -> None:
        """Forgets every cached block (their weights changed: a step committed)
        and the fetches in flight."""
        while self._cache:
            _key, victim = self._cache.popitem(last=False)
            self._evict(victim)
        self.drain_fetches()

    def drain_fetches(self) -> None:
        session = self._pipeline.session
        while self._fetching:
            cid, _slot = self._fetching.popitem(last=False)
            session.release_slot(session.wait_weights(cid, self._timeout))

    def prefetch(self, chunk: Chunk) -> bool:
        """Starts fetching `chunk` (FetchWeights into a reserved slot) unless it
        is resident or in flight or every fetch slot is taken but one. Returns
        False when no slot was left."""
        block = self._block_of_chunk[chunk.chunk_id]
        if block.buffer is not None or chunk.chunk_id in self._fetching:
            return True
        if len(self._fetching) >= FETCH_SLOTS - 1:
            return False
        self._start_fetch(chunk)
        return True

    @property
    def fetches_in_flight(self) -> int:
        return len(self._fetching)

    def _start_fetch(self, chunk: Chunk) -> None:
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

    def _load(self, block: Block) -> None:
        """Fetches the block's chunks into a fresh buffer on its device."""
        if not block.registered:
            raise FailedPrecondition(f"module {block.name!r} is not registered with the daemon: "
                                     "fuyou.stream_parameters or offload.register_module first")
        session = self._pipeline.session
        buf = torch.empty(block.nbytes, dtype=torch.uint8, device=block.device)
        for c, offset in zip(block.chunks, block.chunk_offsets):
            if c.chunk_id not in self._fetching:
                self._start_fetch(c)
            slot = session.wait_weights(c.chunk_id, self._timeout)
            self._fetching.pop(c.chunk_id, None)
            try:
                src = self._pipeline.slot_view(slot, "param", c.dtype)[:c.num_elements]
                buf[offset:offset + c.nbytes].view(c.dtype).copy_(src)
            finally:
                session.release_slot(slot)
            self.fetches += 1
        block.buffer = buf
        self._resident[id(block)] = block
        self._resident_bytes += block.nbytes
        self._note_live()

    def _install_views(self, block: Block) -> None:
        buf = block.buffer
        for m in block.members:
            nbytes = m.numel * torch.empty((), dtype=m.dtype).element_size()
            m.param.data = buf[m.byte_offset:m.byte_offset + nbytes].view(m.dtype).view(m.shape)

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

    # ------------------------------------------------------------ gradients
    def grad_arriving(self, index: int) -> None:
        """Before parameter `index` accumulates a gradient (the pipeline's hook):
        its weights are brought in when backward reaches it without them, and a
        pass that reaches a chunk whose gradients are complete for the step (sent,
        or kept for step()) is refused: the gradients are freed once complete."""
        pipeline = self._pipeline
        k = pipeline.accumulation_steps
        for c in pipeline.chunks_of_param(index):
            sent = c.chunk_id in pipeline.sent_ids()
            if sent or pipeline.chunk_rounds(c.chunk_id) >= k:
                opt = self._optimizer()
                self.abort_step()
                raise FailedPrecondition(
                    f"job {opt.job!r}: a backward pass reached chunk {c.chunk_id:#x} (module "
                    f"{self._block_of_chunk[c.chunk_id].name!r}) whose gradients of this step "
                    f"were complete after {k} pass(es) and {'sent' if sent else 'kept'}. With "
                    "offload_params the gradients are freed once complete: pass "
                    "accumulation_steps=<backward passes per step> to fuyou.AdamW. The step "
                    "was abandoned; call zero_grad() and go on")
        block = self._block_of_param.get(index)
        if block is not None and block.refs == 0 and not block.backward_held:
            self.hold_for_backward(block)
        p = pipeline.params[index]
        if p.grad is None:
            self._add_grad_bytes(p.numel() * p.element_size())

    def chunks_done(self, done: List[Chunk], rounds: Dict[int, int]) -> None:
        """Chunks whose gradients a backward pass completed: sent (the last pass
        of the step, no clipping), else added to their host copy; then the
        parameters whose every chunk is complete lose their gradients, and blocks
        whose chunks are all complete are released for the rest of backward."""
        pipeline = self._pipeline
        opt = self._optimizer()
        k = pipeline.accumulation_steps
        grad_scale = pipeline.hook_grad_scale()
        hold = opt.max_grad_norm is not None or grad_scale is None
        for c in done:
            if rounds[c.chunk_id] >= k and not hold:
                host = self._host.pop(c.chunk_id, None)
                if host is not None:
                    self._to_host(c, host)
                    pipeline.send(c, grad_scale, speculative=True,
                                  packed=(host[0], tuple(sorted(host[1]))))
                else:
                    nbytes = self._chunk_grad_bytes(c)
                    pipeline.send(c, grad_scale, speculative=True,
                                  on_copied=lambda n=nbytes: self._add_grad_bytes(-n))
            else:
                self._to_host(c, self._host.get(c.chunk_id))
        passes = pipeline.param_passes
        for c in done:
            for seg in c.segments:
                if all(rounds[o.chunk_id] >= passes[seg.param_index]
                       for o in pipeline.chunks_of_param(seg.param_index)):
                    seg.param.grad = None  # a send still reading it holds a reference
        blocks = {id(b): b for b in (self._block_of_chunk[c.chunk_id] for c in done)}
        for block in blocks.values():
            r = max(rounds[c.chunk_id] for c in block.chunks)
            if all(rounds[c.chunk_id] == r and not self._partial(c, rounds)
                   for c in block.chunks):
                self.release_backward(block)

    def _partial(self, c: Chunk, rounds: Dict[int, int]) -> bool:
        """A parameter of `c` accumulated a gradient of a pass that has not
        completed the chunk yet."""
        passes = self._pipeline.param_passes
        return any(passes[seg.param_index] > rounds[c.chunk_id] for seg in c.segments)

    def _chunk_grad_bytes(self, c: Chunk) -> int:
        return sum(seg.numel for seg in c.segments if seg.param.grad is not None) * c.element_size

    def _to_host(self, c: Chunk, host) -> None:
        """Adds the chunk's gradients (``.grad``) to its host copy (on the CPU;
        made when None), as AccumulateGrad adds to ``.grad`` (same dtype, same
        order); their device bytes no longer count."""
        if host is None:
            packed = torch.zeros(c.num_elements, dtype=c.dtype)
            host = self._host[c.chunk_id] = (packed, set(range(len(c.segments))))
        packed, missing = host
        for i, seg in enumerate(c.segments):
            g = seg.param.grad
            if g is None:
                continue
            piece = g.detach().reshape(-1)[seg.start:seg.end]
            dst = packed[seg.offset:seg.offset + seg.numel]
            if i in missing:
                dst.copy_(piece)
                missing.discard(i)
            else:
                dst.add_(piece.to(dst.device))
        self._add_grad_bytes(-self._chunk_grad_bytes(c))

    def squares(self) -> Dict[int, float]:
        """At step() with max_grad_norm: each chunk's fp32 sum of squares of its
        gradients, from its host copy or its parameters' ``.grad``."""
        out = {}
        for c in self._pipeline.chunks:
            host = self._host.get(c.chunk_id)
            if host is not None:
                t = torch.linalg.vector_norm(host[0], dtype=torch.float32).square()
                out[c.chunk_id] = float(t)
            else:
                fp = self._pipeline.fingerprints([c])[0]
                if fp is not None:
                    out[c.chunk_id] = float(fp[1])
        return out

    def send_unsent(self, grad_scale: float) -> None:
        """At step(): sends the chunks kept on the host and those whose gradients
        are still in ``.grad`` (a pass that left some parameter without one)."""
        pipeline = self._pipeline
        sent = pipeline.sent_ids()
        for c in pipeline.chunks:
            if c.chunk_id in sent:
                continue
            host = self._host.pop(c.chunk_id, None)
            if host is not None:
                pipeline.send(c, grad_scale, packed=(host[0], tuple(sorted(host[1]))))
            else:
                nbytes = self._chunk_grad_bytes(c)
                if pipeline.send(c, grad_scale,
                                 on_copied=lambda n=nbytes: self._add_grad_bytes(-n)):
                    for seg in c.segments:
                        seg.param.grad = None
            if pipeline.overflow:
                break
        pipeline.wait_sent()

    def reset_step(self) -> None:
        """The step is over (committed, abandoned or skipped): host copies and
        gradients go, backward holds are released."""
        self._host.clear()
        for p in self._pipeline.params:
            p.grad = None
        with self._count_lock:
            self._grad_bytes = 0
        self.release_backward_holds()
        self.drain_fetches()  # the daemon reads and writes states only without fetches in flight

    def abort_step(self) -> None:
        self._pipeline.abort(0)
        self.reset_step()

    def close(self) -> None:
        for stream in list(self._streams):
            stream.close()
