"""The chunk pipeline of fuyou.AdamW: moves one step's chunks between the
parameters and fuyoud.

It owns everything between a gradient and a new weight: the hooks that count
backward passes per chunk, the session's shared-memory slots, the chunks in
flight, the per-chunk staging copies of new weights that arrive while backward
still runs, and the install of new weights into the parameters. It knows
nothing of torch.optim: the optimizer tells it which hyper-parameters a chunk's
group has now (``hyper``), with which ``grad_scale`` a hook may send a chunk
(``hook_grad_scale``, None: hooks must not send), and when to commit or abandon
a step.

One step, seen from here::

    backward: hook per parameter -> chunk complete -> send(chunk)   (overlap)
              slots all busy      -> drain_oldest: new weights to staging
    step():   send_unsent(grad_scale) -> commit(): install staged and in-flight
              chunks' new weights, EndStep
    or        abort(): wait for what is in flight, AbortStep, nothing installed

Every method is called with ``lock`` held (the optimizer's lock, shared).
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk
from ._errors import FailedPrecondition, FuyouError

__all__ = ["ChunkPipeline", "Hyper", "STATE_MASTER", "STATE_EXP_AVG", "STATE_EXP_AVG_SQ"]

# fuyou.v1.StateKind values.
STATE_MASTER, STATE_EXP_AVG, STATE_EXP_AVG_SQ = 1, 2, 3

# (lr, beta1, beta2, eps, weight_decay) of a chunk's parameter group, now.
Hyper = Tuple[float, float, float, float, float]


def _as_byte_buffer(t: torch.Tensor):
    """A writable buffer over a contiguous CPU tensor's bytes (works for bfloat16)."""
    return t.view(torch.uint8).numpy()


class ChunkPipeline:
    """The chunks of one optimizer and their way to the daemon and back.

    Args:
        chunks, params: from ``plan_chunks`` (chunks in registration order, the
            unique trainable parameters by ``param_index``).
        lock: the owner's lock; held around every call, taken by the hooks.
        hyper: group index -> the group's current hyper-parameters.
        hook_grad_scale: ``grad_scale`` for a chunk a hook completes, or None
            when hooks must not send (overlap off, clipping, an overflow).
        check_finite: refuse to send a chunk whose gradients hold inf or nan
            (loss scaling): ``overflow`` becomes True instead.
        accumulation_steps: backward passes per step; a chunk is sent by a hook
            at its k-th pass.
        timeout: seconds any wait on the daemon may take.
    """

    def __init__(self, chunks: List[Chunk], params: List[torch.Tensor], *,
                 lock: threading.RLock, hyper: Callable[[int], Hyper],
                 hook_grad_scale: Callable[[], Optional[float]], check_finite: bool,
                 accumulation_steps: int, timeout: float):
        self.chunks = chunks
        self.params = params
        self.lock = lock
        self.accumulation_steps = int(accumulation_steps)
        self.timeout = float(timeout)
        self.failed: Optional[BaseException] = None
        self._hyper = hyper
        self._hook_grad_scale = hook_grad_scale
        self._check_finite = check_finite
        self._session = None
        self._num_slots = 0
        self._committed = 0
        self._chunks_of_param: List[List[Chunk]] = [[] for _ in params]
        for c in chunks:
            for seg in c.segments:
                if not self._chunks_of_param[seg.param_index] or \
                        self._chunks_of_param[seg.param_index][-1] is not c:
                    self._chunks_of_param[seg.param_index].append(c)
        self._chunk_by_id = {c.chunk_id: c for c in chunks}
        self._chunk_params = {c.chunk_id: sorted({s.param_index for s in c.segments})
                              for c in chunks}
        self._staging: Dict[int, torch.Tensor] = {}
        self._views: Dict[tuple, torch.Tensor] = {}
        self._hook_nodes: list = []
        self._hook_handles: list = []
        self._reset_step()

    # ------------------------------------------------------------ session
    def attach(self, session, *, on_register_error=None) -> bool:
        """Registers every chunk with `session` (a fuyou._fuyou.Session or a fake).
        A chunk the job already has gets the daemon's weights installed into the
        parameters. Returns True when any chunk was resumed."""
        self._session = session
        self._num_slots = int(session.num_slots)
        self._committed = int(session.committed_step)
        resumed_any = False
        with torch.no_grad():
            for c in self.chunks:
                buf = self.gather_weights(c)
                try:
                    resumed, _updates = session.register_chunk(
                        c.chunk_id, c.num_elements, c.dtype_code, c.dtype_code,
                        _as_byte_buffer(buf), layout_fingerprint=c.layout_fingerprint)
                except FailedPrecondition as e:
                    if "fingerprint" not in e.message:
                        raise
                    raise FailedPrecondition(
                        f"{e.message} (this model's chunk {c.chunk_id:#x} holds "
                        f"{c.layout_description()})", e.code) from None
                if resumed:
                    self.install(c, buf)
                    resumed_any = True
        return resumed_any

    @property
    def attached(self) -> bool:
        return self._session is not None

    @property
    def committed_step(self) -> int:
        """Last step the daemon committed for the job."""
        return self._committed

    @property
    def in_step(self) -> bool:
        """True while the step has chunks sent and not yet committed or abandoned."""
        return bool(self._sent)

    def close(self) -> None:
        """Removes the hooks, abandons a step in progress (unless the pipeline
        failed) and closes the session. Errors closing the session are raised
        only when nothing failed before."""
        self.remove_hooks()
        session, self._session = self._session, None
        if session is None:
            return
        try:
            if self.failed is None:
                try:  # a step in progress is abandoned, not committed
                    self._drain_all(session)
                    if self._sent:
                        session.abort_step(self._committed + 1)
                except FuyouError:
                    pass
            self._views.clear()
            try:
                session.close()
            except FuyouError:
                if self.failed is None:
                    raise
        finally:
            self._views.clear()

    # ------------------------------------------------------------ states
    def read_states(self, c: Chunk) -> Tuple[List[torch.Tensor], int]:
        """The chunk's committed fp32 (master, exp_avg, exp_avg_sq) and its update
        count. Between steps only."""
        states = [torch.empty(c.num_elements, dtype=torch.float32) for _ in range(3)]
        t = 0
        for kind, buf in zip((STATE_MASTER, STATE_EXP_AVG, STATE_EXP_AVG_SQ), states):
            t = self._session.read_state(c.chunk_id, kind, 0, buf.numpy())
        return states, int(t)

    def write_state(self, c: Chunk, kind: int, values: torch.Tensor) -> None:
        """Replaces one fp32 state of the chunk, as part of the pending import."""
        self._session.write_state(c.chunk_id, kind, 0, values.numpy())

    def set_update_count(self, c: Chunk, count: int) -> None:
        """Sets the chunk's Adam step count, as part of the pending import."""
        self._session.set_update_count(c.chunk_id, count)

    def commit_import(self) -> None:
        """Makes the pending import durable (one atomic commit)."""
        self._session.commit_import()

    # ------------------------------------------------------------ weights
    def gather_weights(self, c: Chunk) -> torch.Tensor:
        """The chunk's current weights, packed, on the CPU."""
        buf = torch.empty(c.num_elements, dtype=c.dtype)
        for seg in c.segments:
            buf[seg.offset:seg.offset + seg.numel].copy_(
                seg.param.detach().reshape(-1)[seg.start:seg.end])
        return buf

    def install(self, c: Chunk, src: torch.Tensor) -> None:
        """Copies packed weights `src` of chunk `c` into its parameters."""
        for seg in c.segments:
            part = src[seg.offset:seg.offset + seg.numel]
            data = seg.param.data
            if data.is_contiguous():
                data.view(-1)[seg.start:seg.end].copy_(part, non_blocking=False)
            else:
                flat = data.reshape(-1).clone()
                flat[seg.start:seg.end].copy_(part)
                data.copy_(flat.view_as(data))

    # ------------------------------------------------------------ hooks
    def install_hooks(self) -> None:
        """A hook on each parameter's gradient accumulator: counts backward passes
        per chunk and sends a chunk when its last gradient of the step is in."""
        self_ref = weakref.ref(self)
        for index, p in enumerate(self.params):
            node = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad
            self._hook_nodes.append(node)  # the node must outlive the hook

            def hook(grad_inputs, grad_outputs, index=index):
                pipeline = self_ref()
                if pipeline is not None:
                    pipeline._on_grad_accumulated(index)

            self._hook_handles.append(node.register_hook(hook))

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._hook_handles = []
        self._hook_nodes = []

    def reset_passes(self) -> None:
        """Forgets the backward passes counted so far (zero_grad before any send)."""
        self._rounds = {c.chunk_id: 0 for c in self.chunks}
        self._reached = {c.chunk_id: 0 for c in self.chunks}
        self._param_passes = [0] * len(self.params)

    def _on_grad_accumulated(self, index: int) -> None:
        with self.lock:
            if self._session is None or self.failed is not None:
                return
            self._param_passes[index] += 1
            passes = self._param_passes[index]
            for c in self._chunks_of_param[index]:
                cid = c.chunk_id
                if cid in self._sent:
                    continue
                if passes == self._rounds[cid] + 1:
                    self._reached[cid] += 1
                    members = self._chunk_params[cid]
                    if self._reached[cid] == len(members):
                        self._rounds[cid] += 1
                        self._reached[cid] = sum(
                            1 for i in members if self._param_passes[i] >= self._rounds[cid] + 1)
                        if self._rounds[cid] < self.accumulation_steps:
                            continue
                        grad_scale = self._hook_grad_scale()
                        if grad_scale is None:
                            continue
                        try:
                            self.send(c, grad_scale)
                        except BaseException as e:
                            self.failed = e
                            raise

    # ------------------------------------------------------------ per step
    @property
    def overflow(self) -> bool:
        """True when a chunk's gradients held inf or nan (with check_finite)."""
        return self._overflow

    def mark_overflow(self) -> None:
        """The step cannot be committed (a non-finite gradient norm, say)."""
        self._overflow = True

    def send_unsent(self, grad_scale: float) -> None:
        """Sends every chunk not sent yet in this step (stops at an overflow)."""
        for c in self.chunks:
            if c.chunk_id not in self._sent:
                self.send(c, grad_scale)
                if self._overflow:
                    return

    def send(self, c: Chunk, grad_scale: float) -> None:
        """Copies the chunk's gradients into a slot and sends GradReady."""
        if all(seg.param.grad is None for seg in c.segments):
            return  # no gradient at all: the chunk is not updated this step
        session = self._session
        if len(self._inflight) >= self._num_slots:
            self._drain_oldest(session)
        slot = session.acquire_slot(self.timeout)
        try:
            dst = self._view(slot, "grad", c.dtype)[:c.num_elements]
            for seg in c.segments:
                part = dst[seg.offset:seg.offset + seg.numel]
                g = seg.param.grad
                if g is None:
                    part.zero_()
                else:
                    part.copy_(g.detach().reshape(-1)[seg.start:seg.end])
            if self._check_finite and not bool(torch.isfinite(dst).all()):
                self._overflow = True
                session.release_slot(slot)
                return
            lr, beta1, beta2, eps, weight_decay = self._hyper(c.group_index)
            session.send_grad_ready(c.chunk_id, slot, self._committed + 1, float(lr),
                                    float(beta1), float(beta2), float(eps),
                                    float(weight_decay), float(grad_scale))
        except BaseException:
            if self.failed is None:
                try:
                    session.release_slot(slot)
                except Exception:
                    pass
            raise
        self._inflight[c.chunk_id] = slot
        self._sent.add(c.chunk_id)

    def commit(self) -> None:
        """Installs every sent chunk's new weights into the parameters and commits
        the step (nothing to commit when nothing was sent)."""
        session = self._session
        for cid in list(self._staged):
            self.install(self._chunk_by_id[cid], self._staging[cid])
        while self._inflight:
            cid, _ = self._inflight.popitem(last=False)
            c = self._chunk_by_id[cid]
            slot = self._wait(session, cid)
            self.install(c, self._view(slot, "param", c.dtype)[:c.num_elements])
            session.release_slot(slot)
        if self._sent:
            committed, _chunks = session.end_step(self._committed + 1)
            self._committed = int(committed)
        self._reset_step()

    def abort(self) -> None:
        """Abandons the step: waits for the chunks in flight, rolls back what the
        daemon updated (AbortStep), installs nothing."""
        session = self._session
        self._drain_all(session)
        if self._sent:
            session.abort_step(self._committed + 1)
        self._reset_step()

    # ------------------------------------------------------------ internals
    def _reset_step(self) -> None:
        self._inflight: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self._sent: set = set()
        self._staged: set = set()
        self._overflow = False
        self.reset_passes()

    def _view(self, slot: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, kind, dtype)
        v = self._views.get(key)
        if v is None:
            region = (self._session.grad_region(slot) if kind == "grad"
                      else self._session.param_region(slot))
            esize = torch.empty((), dtype=dtype).element_size()
            v = torch.frombuffer(region, dtype=dtype, count=len(region) // esize)
            self._views[key] = v
        return v

    def _wait(self, session, chunk_id: int) -> int:
        return session.wait_params(chunk_id, self.timeout)

    def _drain_oldest(self, session) -> None:
        """Frees a slot during backward: the oldest chunk's new weights go to its
        staging copy (the parameters may still be needed by backward)."""
        cid, _ = self._inflight.popitem(last=False)
        c = self._chunk_by_id[cid]
        slot = self._wait(session, cid)
        staging = self._staging.get(cid)
        if staging is None:
            staging = torch.empty(c.num_elements, dtype=c.dtype,
                                  pin_memory=torch.cuda.is_available())
            self._staging[cid] = staging
        staging.copy_(self._view(slot, "param", c.dtype)[:c.num_elements])
        session.release_slot(slot)
        self._staged.add(cid)

    def _drain_all(self, session) -> None:
        while self._inflight:
            cid, _ = self._inflight.popitem(last=False)
            slot = self._wait(session, cid)
            session.release_slot(slot)
