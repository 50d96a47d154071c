"""fuyou.stream_parameters: the module hooks that bring a model's weights in
layer by layer from fuyoud (offload_params) and let them go again.

One forward and backward, seen from here::

    forward:  root pre-hook   saved-tensor hooks on (weights saved for backward
                              are kept as handles, not as tensors)
              module pre-hook acquire its blocks (fetch or cache hit), prefetch
                              the next chunks in the order of the first step
              module post-hook release them (placeholders again, buffer cached);
                              wrap the outputs in _FetchForBackward
              root post-hook  saved-tensor hooks off
    backward: _FetchForBackward.backward (before the module's own backward)
                              hold its blocks for backward, prefetch in the
                              backward order of the first step
              a saved handle  unpacked from the block's buffer (fetched on demand)
              chunk complete  (the pipeline's hooks) sent, gradients freed, the
                              block's backward hold released
              end of backward every remaining hold released

A parameter is a view of its block's buffer only while the block is in use;
buffers are never reused (a fetch allocates a fresh one), so a saved view can
never read another chunk's weights, and a handle unpacked after the step that
saved it committed raises.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Union

import torch

from ._errors import FailedPrecondition, InvalidArgument
from ._host_malloc import keep_large_buffers_mmapped
from ._offload import FETCH_SLOTS, Block, OffloadedParams
from ._prefetch_order import PrefetchOrder
from ._sizes import parse_size
from ._stream_state_dict import StreamedStateDict, default_state_dict_limit
from ._tensor_tree import pass_through

__all__ = ["stream_parameters", "ParameterStream", "stream_of"]

# The open ParameterStream of each model (held weakly on both sides).
_OPEN_STREAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def stream_of(model: torch.nn.Module) -> Optional["ParameterStream"]:
    """The open fuyou.stream_parameters handle of `model`, or None."""
    ref = _OPEN_STREAMS.get(model)
    stream = ref() if ref is not None else None
    return stream if stream is not None and not stream._closed else None


def stream_parameters(model: torch.nn.Module, optimizer, device_budget: Union[int, str] = "64MiB",
                      prefetch: int = 2,
                      state_dict_limit_bytes: Union[int, str, None] = None) -> "ParameterStream":
    """Streams `model`'s weights from fuyoud into its modules, one module at a
    time, for a model whose optimizer is ``fuyou.AdamW(..., offload_params=True)``.

    Plans the chunks from the model's modules (``optimizer.offload.bind``) and
    registers every module not registered yet (``register_module``: a new job
    takes the modules' current weights, a resumed one the daemon's), which
    releases the parameters' storage; then installs the hooks (see
    :class:`ParameterStream`). ``device_budget`` (bytes, or a size such as
    ``"64MiB"`` or ``"1.5GiB"`` as the daemon's flags take) bounds the weights and
    gradients held on the device: live bytes never exceed it plus the largest
    module's weights. ``prefetch``: chunks fetched ahead (0 to
    ``FETCH_SLOTS - 1``), in the order the first step used them.

    Use it like this (the loop itself does not change)::

        opt = fuyou.AdamW(model.parameters(), lr=1e-4, job="big", offload_params=True,
                          max_grad_norm=1.0)          # or clip_grad_norm_: see below
        handle = fuyou.stream_parameters(model, opt, device_budget="2GiB")
        for batch in data:
            opt.scale_loss(model(batch)).backward()
            opt.step()
            opt.zero_grad()
        handle.peak_live_bytes

    A chunk's gradients go to the daemon as soon as they are complete and are
    freed then; the daemon journals them for the step and ``.grad`` becomes a
    :class:`fuyou._freed_grad.FreedGrad`, so ``torch.nn.utils.clip_grad_norm_``,
    ``torch.cuda.amp.GradScaler``, a hand-written unscale, ``zero_grad`` and
    undeclared accumulation work as with torch (see _offload_grads.py).

    ``model.state_dict()`` (of the model or any of its modules) holds the
    streamed parameters' weights at the last committed step, fetched module by
    module, and ``model.load_state_dict(sd)`` writes new values into the daemon
    (fp32 masters and working weights; m, v and step counts stay), both between
    steps (see _stream_state_dict.py). ``state_dict_limit_bytes`` (bytes or a
    size; None: ``$FUYOU_STATE_DICT_LIMIT``, else 8 GiB or a quarter of the
    host's RAM when less) bounds the weights one ``state_dict()`` call may hold:
    beyond it, it raises and names ``fuyou.export_checkpoint(opt, path, model,
    shard_bytes=...)``, which writes a sharded checkpoint one chunk at a time.

    A module streamed on the CPU (and fuyou.AdamW(offload_params=True) of
    parameters not all on a GPU) sets glibc's mmap threshold to 128 KiB for the
    whole process, once, so the freed buffers of fetched weights go back to the
    system and the client's memory follows ``device_budget``, not the model
    (``FUYOU_MALLOC=glibc`` leaves glibc's defaults; see _host_malloc.py).
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise NotImplementedError(
            "fuyou.stream_parameters of a DistributedDataParallel model: DDP keeps views of "
            "every parameter's storage, which a streamed parameter does not have; stream the "
            "module itself (ddp.module) without DDP: in a data-parallel group fuyou.AdamW "
            "averages the gradients during backward, into .grad, as DDP would")
    offload: Optional[OffloadedParams] = getattr(optimizer, "offload", None)
    if offload is None:
        raise InvalidArgument("fuyou.stream_parameters needs the model's optimizer opened as "
                              "fuyou.AdamW(..., offload_params=True)")
    budget = parse_size(device_budget, "device_budget")
    limit = (default_state_dict_limit() if state_dict_limit_bytes is None
             else parse_size(state_dict_limit_bytes, "state_dict_limit_bytes"))
    if not isinstance(prefetch, int) or not 0 <= prefetch <= FETCH_SLOTS - 1:
        raise ValueError(f"prefetch must be an int in 0..{FETCH_SLOTS - 1}, got {prefetch!r}")
    with offload._lock:
        offload.bind(model)
        offload.register_all()
        for old in list(offload._streams):
            old.close()
        if offload.state_dict_hooks is None:
            offload.state_dict_hooks = StreamedStateDict(offload, limit)
        offload.state_dict_hooks.limit_bytes = limit
        if any(b.device is not None and b.device.type == "cpu" for b in offload.blocks):
            keep_large_buffers_mmapped()  # freed weight buffers go back (_host_malloc.py)
        return ParameterStream(offload, model, budget, prefetch)


class _SavedWeight:
    """What the pack hook keeps for a saved tensor that lives in a block's
    buffer: where it is, not the tensor (which would pin the buffer)."""

    __slots__ = ("block", "offset", "dtype", "shape", "stride", "step", "loaded")

    def __init__(self, block: Block, offset: int, t: torch.Tensor, step: int, loaded: int):
        self.block = block
        self.offset = offset
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.step = step
        self.loaded = loaded  # offload.weights_loaded then


class _SavedTensorHooks:
    """torch's default saved-tensor hooks of one stream, pushed for a forward
    and popped at its end (or at the next one, when it raised)."""

    def __init__(self):
        self._pushed = False

    def push(self, pack, unpack) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        self._pushed = True

    def pop(self) -> None:
        """Pops them if pushed (idempotent)."""
        if self._pushed:
            self._pushed = False
            torch._C._autograd._pop_saved_tensors_default_hooks()


class _FetchForBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward brings the module's weights
    in before the module's own backward runs (as ZeRO-3's PreBackwardFunction)."""

    @staticmethod
    def forward(ctx, stream_ref, module_ref, *tensors):
        ctx.stream_ref = stream_ref
        ctx.module_ref = module_ref
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        stream, module = ctx.stream_ref(), ctx.module_ref()
        if stream is not None and module is not None:
            stream._before_module_backward(module)
        return (None, None) + grads


class ParameterStream:
    """The hooks of :func:`stream_parameters` on one model (its handle).

    ``live_bytes`` / ``peak_live_bytes``: bytes of fetched weights and of
    gradients held on the device now / at most since the stream began (or
    :meth:`reset_peak`). ``fetches``, ``prefetches`` and ``cache_hits`` count
    chunks fetched from the daemon, those of them started ahead of their use,
    and blocks served from the cache. ``largest_module_bytes``: the largest
    block (a module's own weights). ``state_dict_limit_bytes``: see
    :func:`stream_parameters`. :meth:`close` removes the streaming hooks; the
    parameters stay empty placeholders (their weights are in the daemon:
    ``model.state_dict()``, whose hooks stay while the optimizer is open, or
    ``optimizer.export_checkpoint``).
    """

    def __init__(self, offload: OffloadedParams, model: torch.nn.Module, device_budget: int,
                 prefetch: int):
        self._offload = offload
        self.model = model
        self.device_budget = int(device_budget)
        offload.weights.device_budget = self.device_budget
        offload.weights.peak_live_bytes = offload.weights.live_bytes
        self.largest_module_bytes = max((b.nbytes for b in offload.blocks), default=0)
        self._order = PrefetchOrder(prefetch)
        self._forward_holds: List[List[Block]] = []  # per module in forward: its blocks
        self._saved_hooks = _SavedTensorHooks()
        self._in_backward = False
        self._handles = []
        self._closed = False
        ref = weakref.ref(self)

        def root_pre(module, inputs):
            stream = ref()
            if stream is not None:
                stream._root_pre()

        def root_post(module, inputs, output):
            stream = ref()
            if stream is not None:
                stream._root_post()

        def pre(module, inputs):
            stream = ref()
            if stream is not None:
                stream._module_pre(module)

        def post(module, inputs, output):
            stream = ref()
            if stream is not None:
                return stream._module_post(module, output)
            return None

        # Under torch.compile the hooks run eagerly (a graph break at each): they
        # swap weights in and out and hand out weak references, which dynamo must
        # not trace into the graph.
        root_pre, root_post, pre, post = (torch.compiler.disable(hook)
                                          for hook in (root_pre, root_post, pre, post))
        self._handles.append(model.register_forward_pre_hook(root_pre))
        for _name, module in model.named_modules():
            if offload.uses(module):
                self._handles.append(module.register_forward_pre_hook(pre))
                self._handles.append(module.register_forward_hook(post))
        self._handles.append(model.register_forward_hook(root_post))
        offload._streams.append(self)
        self._model_ref = weakref.ref(model)
        _OPEN_STREAMS[model] = ref

    # ------------------------------------------------------------ public
    @property
    def prefetch(self) -> int:
        """Chunks fetched ahead of their use (0 to ``FETCH_SLOTS - 1``)."""
        return self._order.prefetch

    @prefetch.setter
    def prefetch(self, value: int) -> None:
        self._order.prefetch = int(value)

    @property
    def _lock(self):
        return self._offload._lock

    @property
    def live_bytes(self) -> int:
        return self._offload.weights.live_bytes

    @property
    def peak_live_bytes(self) -> int:
        return self._offload.weights.peak_live_bytes

    @property
    def fetches(self) -> int:
        return self._offload.weights.fetches

    @property
    def cache_hits(self) -> int:
        return self._offload.weights.cache_hits

    @property
    def prefetches(self) -> int:
        """Chunk fetches started ahead of their use (``prefetch``)."""
        return self._offload.weights.prefetches

    @property
    def state_dict_limit_bytes(self) -> int:
        """The most bytes of streamed weights one ``model.state_dict()`` may hold."""
        return self._offload.state_dict_hooks.limit_bytes

    @state_dict_limit_bytes.setter
    def state_dict_limit_bytes(self, value) -> None:
        with self._lock:
            self._offload.state_dict_hooks.limit_bytes = parse_size(value, "state_dict_limit_bytes")

    def reset_peak(self) -> None:
        with self._lock:
            self._offload.weights.peak_live_bytes = self._offload.weights.live_bytes

    def close(self) -> None:
        """Removes the hooks and lets every fetched weight go (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for h in self._handles:
                h.remove()
            self._handles = []
            self._saved_hooks.pop()
            offload = self._offload
            for blocks in self._forward_holds:
                for b in blocks:
                    offload.weights.release(b)
            self._forward_holds = []
            offload.weights.release_backward_holds()
            try:
                offload.weights.drop_cache()
            except Exception:
                pass  # the session may be gone already
            if self in offload._streams:
                offload._streams.remove(self)
            model = self._model_ref()
            if model is not None and stream_of(model) is None:
                _OPEN_STREAMS.pop(model, None)

    # ------------------------------------------------------------ forward
    def _root_pre(self) -> None:
        with self._lock:
            self._saved_hooks.pop()  # left by a forward that raised
            if self._forward_holds:  # the same
                for blocks in self._forward_holds:
                    for b in blocks:
                        self._offload.weights.release(b)
                self._forward_holds = []
            self._order.restart("forward")
            if torch.is_grad_enabled():
                self._saved_hooks.push(self._pack, self._unpack)

    def _root_post(self) -> None:
        with self._lock:
            self._saved_hooks.pop()
            self._order.pass_ended("forward")

    def _module_pre(self, module) -> None:
        with self._lock:
            blocks = self._offload.uses(module)
            for b in blocks:
                self._offload.weights.acquire(b)
                self._order.advance("forward", b, self._offload.weights)
            self._forward_holds.append(blocks)

    def _module_post(self, module, output):
        with self._lock:
            blocks = self._offload.uses(module)
            for i in range(len(self._forward_holds) - 1, -1, -1):
                if self._forward_holds[i] is blocks:
                    del self._forward_holds[i]
                    break
            for b in blocks:
                self._offload.weights.release(b)
        if not torch.is_grad_enabled():
            return None
        return _wrap_outputs(output, weakref.ref(self), weakref.ref(module))

    # ------------------------------------------------------------ backward
    def _backward_started(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._order.restart("backward")
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:
            self._in_backward = False  # not in a backward pass (a handle unpacked by hand)

    def _backward_done(self) -> None:
        with self._lock:
            self._in_backward = False
            self._offload.weights.release_backward_holds()
            self._order.pass_ended("backward")

    def _before_module_backward(self, module) -> None:
        with self._lock:
            self._backward_started()
            for b in self._offload.uses(module):
                if not b.backward_held:
                    self._offload.weights.hold_for_backward(b)
                self._order.advance("backward", b, self._offload.weights)

    def hold_for_use(self, output, blocks: List[Block], step: int, loaded: int, what: str):
        """`output` of an operation that fetched `blocks` outside their modules'
        forward (at committed step `step`, `loaded` weights loaded), with its
        tensors that require grad passed through _HoldForUse."""
        use = (blocks, step, loaded, what)
        wrapped, _ = pass_through(
            output, lambda *tensors: _HoldForUse.apply(weakref.ref(self), use, *tensors))
        return wrapped

    def _before_use_backward(self, blocks: List[Block], step: int, loaded: int,
                             what: str) -> None:
        with self._lock:
            offload = self._offload
            if step != offload.committed_step or loaded != offload.weights_loaded:
                raise FailedPrecondition(
                    f"backward needs the weights of {what} as an operation outside its modules' "
                    "forward used them, but they changed since (optimizer.step() or "
                    "model.load_state_dict): run backward first")
            self._backward_started()
            for b in blocks:
                self._offload.weights.hold_for_backward(b)

    def _pack(self, t: torch.Tensor):
        with self._lock:
            found = self._offload.weights.block_holding(t)
            if found is None:
                return t
            block, offset = found
            return _SavedWeight(block, offset, t, self._offload.committed_step,
                                self._offload.weights_loaded)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        with self._lock:
            offload = self._offload
            if saved.step != offload.committed_step:
                raise FailedPrecondition(
                    f"backward needs the weights of module {saved.block.name!r} as saved in the "
                    f"forward of step {saved.step + 1}, but step {offload.committed_step} was "
                    "committed since: run backward before optimizer.step()")
            if saved.loaded != offload.weights_loaded:
                raise FailedPrecondition(
                    f"backward needs the weights of module {saved.block.name!r} as saved in its "
                    "forward, but model.load_state_dict replaced them since: run backward before "
                    "load_state_dict")
            self._backward_started()
            offload.weights.hold_for_backward(saved.block)
            typed = saved.block.buffer.view(saved.dtype)
            esize = typed.element_size()
            return torch.as_strided(typed, saved.shape, saved.stride, saved.offset // esize)


class _HoldForUse(torch.autograd.Function):
    """Identity on the result of an operation on a placeholder outside the
    forward of its modules (_placeholder_uses.py), whose backward holds the
    parameter's blocks before the operation's own backward runs."""

    @staticmethod
    def forward(ctx, stream_ref, use, *tensors):
        ctx.stream_ref = stream_ref
        ctx.use = use
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        stream = ctx.stream_ref()
        if stream is not None:
            stream._before_use_backward(*ctx.use)
        return (None, None) + grads


def _wrap_outputs(output, stream_ref, module_ref):
    """`output` with its tensors that require grad passed through
    _FetchForBackward (tensors, tuples, lists and dicts of them); None when
    nothing needs it (the output stays as it is)."""
    wrapped, any_tensor = pass_through(
        output, lambda *tensors: _FetchForBackward.apply(stream_ref, module_ref, *tensors))
    return wrapped if any_tensor else None
