"""fuyou.AdamW: a torch.optim.Optimizer whose states live in fuyoud."""

from __future__ import annotations

import collections
import math
import os
import socket
import sys
import threading
import warnings
import weakref
from typing import Dict, List, Optional, Union

import torch

from . import _checkpoint
from ._chunking import Chunk, plan_chunks
from ._errors import FailedPrecondition, FuyouError, InvalidArgument
from ._loss_scale import make_loss_scaler
from .daemon import EmbeddedDaemon, resolve_address

__all__ = ["AdamW"]

MAX_SLOTS = 64
_STATE_VERSION = 1


def _open_session(job: str, num_slots: int, slot_bytes: int, client_info: str, address: str,
                  rpc_timeout: float, connect_timeout: float):
    """Opens a clientlib session (fuyou._fuyou.Session). Tests replace this with a fake."""
    from . import _native
    return _native.module().Session.open(
        job=job, num_slots=num_slots, slot_bytes=slot_bytes, client_info=client_info,
        address=address, rpc_timeout=rpc_timeout, connect_timeout=connect_timeout)


def _as_byte_buffer(t: torch.Tensor):
    """A writable buffer over a contiguous CPU tensor's bytes (works for bfloat16)."""
    return t.view(torch.uint8).numpy()


class AdamW(torch.optim.Optimizer):
    r"""AdamW whose fp32 master weights and moments live in fuyoud (DRAM and NVMe).

    Use it like ``torch.optim.AdamW``::

        opt = fuyou.AdamW(model.parameters(), lr=1e-4, job="gpt-ft")
        for batch in data:
            loss = model(batch).loss
            loss.backward()        # chunks are updated by the daemon during backward
            opt.step()             # waits for what has not arrived, then commits
            opt.zero_grad()

    **Chunks.** The trainable parameters (``requires_grad``; frozen ones are left
    alone, tied ones counted once) are packed into chunks of at most
    ``chunk_bytes`` bytes of weights, in reverse order of each parameter group;
    chunks never mix groups, dtypes or devices. Ids derive from the group index
    and position, so a job that is opened again (same ``job``, same model, same
    ``chunk_bytes``) resumes the same chunks: the daemon's weights then replace
    the model's (``resumed`` is True) and training continues after
    ``committed_step``.

    **Overlap.** With ``overlap=True`` a hook on each parameter's gradient
    accumulator notices when every gradient of a chunk is in; the chunk's
    gradients are then copied (one copy) into a shared-memory slot and the daemon
    updates it while backward goes on with earlier layers. When all ``num_slots``
    slots are busy the hook waits for the oldest chunk's new weights and keeps
    them in a per-chunk staging copy (extra host memory of that chunk's size);
    the model's parameters themselves only change in :meth:`step`, after
    backward. Each GradReady carries the group's *current* ``lr``, ``betas``,
    ``eps`` and ``weight_decay``, so LR schedulers work as with torch.

    **Gradient accumulation.** With ``accumulation_steps=k``, call
    :meth:`step` once every ``k`` backward passes; gradients go to the daemon
    only at the k-th backward of each chunk. A :meth:`step` that comes earlier
    sends what has accumulated.

    **Mixed precision.** bf16/fp16 parameters travel as such (weights and
    gradients in the parameter's dtype); the daemon keeps fp32 masters and
    returns weights rounded to the parameter's dtype. ``loss_scale`` (a number,
    or ``"dynamic"``: 2**16, x2 after 2000 good steps, x0.5 at an overflow) asks
    you to backpropagate ``opt.scale_loss(loss)``; gradients are unscaled in the
    daemon (``grad_scale = 1/scale``). Cost: every chunk's gradients are checked
    for inf/nan before they are sent (one extra pass over the gradients), and an
    overflow found in any chunk skips the whole step: an ``AbortStep`` rolls back
    the chunks the daemon already updated in that step (their updates were wasted
    work), no weights are installed, the scale is lowered and ``skipped_steps``
    grows.

    **Clipping.** ``max_grad_norm`` clips by the global gradient norm exactly as
    ``torch.nn.utils.clip_grad_norm_`` (then AdamW). Cost: the norm needs every
    gradient, so no chunk can be sent during backward: overlap is off, all
    updates happen in :meth:`step` after backward (the step takes
    backward + optimizer instead of about max of the two), plus one pass over the
    gradients for the norm. The coefficient is applied in the daemon
    (``grad_scale = clip_coef / loss_scale``), not by rewriting ``.grad``. A
    non-finite norm skips the step like an overflow.

    **Differences from torch.optim.AdamW.** A chunk in which no parameter has a
    gradient is not updated (like torch skipping ``grad is None``); in a chunk
    where only some have one, the missing gradients count as zeros (their weights
    get weight decay and moment decay). Put parameters that may get no gradient
    (unused heads, poolers) in a parameter group of their own: chunks never mix
    groups, so they are then skipped exactly as torch skips them. ``state_dict()`` holds the
    hyper-parameters, the loss-scale state and the step counters; the moments
    themselves stay in the daemon under ``job``.

    **Export and import.** :meth:`export_checkpoint` writes the job's weights and
    a ``torch.optim.AdamW``-compatible optimizer state (``step``, ``exp_avg``,
    ``exp_avg_sq`` per parameter) to a PyTorch checkpoint. ``init_from`` (a
    path, such a checkpoint dict, or a plain ``torch.optim.AdamW.state_dict()``
    of the same parameter groups) starts a *new* job from it: the master weights
    come from the model's parameters (load the checkpoint's weights into the
    model first, as with torch), or from an export whose ``model`` is keyed by
    parameter index; moments and step counts from the optimizer state; the
    groups' ``lr``, ``betas``, ``eps`` and ``weight_decay`` are taken over as
    ``load_state_dict`` does. The checkpoint is checked (group sizes, shapes)
    before anything is sent to the daemon, and the import commits atomically.

    Args:
        job: name of the job on the daemon (1-64 of ``[A-Za-z0-9._-]``).
        address: gRPC target of fuyoud (``unix:/path`` or a socket path). None:
            the default socket (``$FUYOU_SOCKET``, ``/run/fuyou/fuyoud.sock``, or
            the per-user one); when nothing answers there and ``embedded`` is not
            False (nor ``$FUYOU_EMBEDDED=0``) a private fuyoud is started for this
            process (see :class:`fuyou.EmbeddedDaemon`). ``embedded=True`` always
            starts a private one.
        chunk_bytes: most bytes of weights in one chunk (slot size).
        num_slots: shared-memory slots, i.e. chunks in flight at once (1-64).
        timeout: seconds any wait on the daemon may take before
            :class:`fuyou.FuyouError` is raised (a dead daemon never hangs a job).
        init_from: checkpoint to start a new job from (see above).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, job: str, address: Optional[str] = None,
                 chunk_bytes: int = 32 << 20, num_slots: int = 4, overlap: bool = True,
                 max_grad_norm: Optional[float] = None,
                 loss_scale: Union[None, float, str] = None, accumulation_steps: int = 1,
                 embedded: Optional[bool] = None, timeout: float = 60.0, init_from=None):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not isinstance(job, str) or not job:
            raise ValueError("job must be a non-empty string")
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{MAX_SLOTS}, got {num_slots}")
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._session = None  # set last; add_param_group checks it
        self._closed = True
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

        self.job = job
        self.chunk_bytes = int(chunk_bytes)
        self.overlap = bool(overlap)
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = int(accumulation_steps)
        self.timeout = float(timeout)
        self._scaler = make_loss_scaler(loss_scale)
        self._lock = threading.RLock()
        self._daemon: Optional[EmbeddedDaemon] = None
        self._failed: Optional[BaseException] = None
        self.skipped_steps = 0
        self.resumed = False

        self._chunks, self._params = plan_chunks([g["params"] for g in self.param_groups],
                                                 self.chunk_bytes)
        self._chunks_of_param: List[List[Chunk]] = [[] for _ in self._params]
        for c in self._chunks:
            for seg in c.segments:
                if not self._chunks_of_param[seg.param_index] or \
                        self._chunks_of_param[seg.param_index][-1] is not c:
                    self._chunks_of_param[seg.param_index].append(c)
        self._chunk_by_id = {c.chunk_id: c for c in self._chunks}
        self._chunk_params = {c.chunk_id: sorted({s.param_index for s in c.segments})
                              for c in self._chunks}
        self._staging: Dict[int, torch.Tensor] = {}
        self._views: Dict[tuple, torch.Tensor] = {}
        self._reset_step_state()

        plan = _checkpoint.plan_import(self, init_from) if init_from is not None else None
        self._address, self._daemon = resolve_address(address, embedded)
        try:
            self._open_and_register(num_slots)
            if plan is not None:
                _checkpoint.apply_import(self, plan)
        except BaseException:
            session, self._session = self._session, None
            if session is not None:
                try:
                    session.close()
                except Exception:
                    pass
            self._stop_daemon()
            raise
        self._closed = False
        self._install_hooks()

    # ------------------------------------------------------------------ public
    @property
    def committed_step(self) -> int:
        """Last step the daemon committed for this job (durable)."""
        return self._committed

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 when loss scaling is off)."""
        return self._scaler.scale

    @property
    def address(self) -> str:
        """gRPC target of the daemon this optimizer talks to."""
        return self._address

    @property
    def embedded_daemon(self) -> Optional[EmbeddedDaemon]:
        return self._daemon

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` to backpropagate (identity without loss scaling)."""
        if not self._scaler.enabled:
            return loss
        return loss * self._scaler.scale

    @torch.no_grad()
    def step(self, closure=None):
        """Sends the chunks not sent yet, installs every chunk's new weights into the
        parameters, and commits the step. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._lock:
            self._check_usable()
            try:
                self._finish_step()
            except BaseException as e:
                self._failed = e
                raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (to None by default, as torch 2 does)."""
        with self._lock:
            if not self._sent:
                self._reset_rounds()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def close(self) -> None:
        """Ends the session (a step in progress is abandoned, not committed) and
        stops the embedded daemon if this optimizer started one. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._remove_hooks()
            session, self._session = self._session, None
            try:
                if session is not None:
                    if self._failed is None:
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
                        if self._failed is None:
                            raise
            finally:
                self._views.clear()
                self._stop_daemon()

    def __enter__(self) -> "AdamW":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_session", None) is not None:
            raise InvalidArgument(
                "fuyou.AdamW cannot take parameter groups after construction: its chunks "
                "are registered with the daemon; pass every group to the constructor")
        super().add_param_group(param_group)

    def export_checkpoint(self, path=None, model: Optional[torch.nn.Module] = None) -> dict:
        """The job at its last committed step as a PyTorch checkpoint dict
        ``{"model", "optimizer", "fuyou"}``, also written with ``torch.save`` to
        ``path`` when given. ``optimizer`` loads into ``torch.optim.AdamW`` over
        the same parameter groups. ``model`` given: ``"model"`` is its state_dict
        with fp32 master weights for the trainable parameters; otherwise it maps
        each parameter's index (as in the optimizer state) to fp32 weights.
        Call it between steps."""
        with self._lock:
            self._check_usable()
            if self._sent:
                raise FailedPrecondition(
                    f"export_checkpoint of job {self.job!r} during a step: call it after step()")
            checkpoint = _checkpoint.export_state(self, model)
        if path is not None:
            torch.save(checkpoint, path)
        return checkpoint

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["fuyou"] = {
            "version": _STATE_VERSION,
            "job": self.job,
            "committed_step": self._committed,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self._scaler.state_dict(),
            "accumulation_steps": self.accumulation_steps,
            "max_grad_norm": self.max_grad_norm,
            "chunk_bytes": self.chunk_bytes,
            "chunks": [(c.chunk_id, c.num_elements, str(c.dtype)) for c in self._chunks],
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get("fuyou")
        super().load_state_dict(state_dict)
        if extra is None:
            return
        chunks = [tuple(c) for c in extra.get("chunks", [])]
        mine = [(c.chunk_id, c.num_elements, str(c.dtype)) for c in self._chunks]
        if chunks and chunks != mine:
            raise InvalidArgument(
                f"state_dict was saved with a different chunk layout ({len(chunks)} chunks, "
                f"chunk_bytes={extra.get('chunk_bytes')}) than this optimizer's ({len(mine)} "
                f"chunks, chunk_bytes={self.chunk_bytes}); build the optimizer with the same "
                "model, parameter groups and chunk_bytes")
        if extra.get("job") != self.job:
            warnings.warn(f"state_dict is from job {extra.get('job')!r}, this optimizer trains "
                          f"{self.job!r}; its moments stay those of {self.job!r}")
        if extra.get("committed_step") != self._committed:
            warnings.warn(
                f"state_dict is from step {extra.get('committed_step')}, but job {self.job!r} "
                f"is committed at step {self._committed} in the daemon, which holds the "
                "weights and moments; hyper-parameters and loss scale were loaded")
        self._scaler.load_state_dict(extra.get("loss_scaler", {}))
        self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))

    def __repr__(self) -> str:
        return (f"fuyou.AdamW(job={self.job!r}, {len(self._chunks)} chunks, "
                f"{len(self.param_groups)} groups, committed_step={self._committed}, "
                f"address={self._address!r})")

    # ------------------------------------------------------------------ setup
    def _open_and_register(self, num_slots: int) -> None:
        slot_bytes = max([c.nbytes for c in self._chunks], default=8)
        # At most 256 characters (1 KiB of UTF-8): fuyoud refuses a longer client_info.
        info = f"{socket.gethostname()} pid {os.getpid()} {' '.join(sys.argv[:1])}".strip()[:256]
        self._session = _open_session(self.job, num_slots, slot_bytes, info, self._address,
                                      self.timeout, min(self.timeout, 5.0))
        self._num_slots = int(self._session.num_slots)
        self._committed = int(self._session.committed_step)
        resumed_any = False
        with torch.no_grad():
            for c in self._chunks:
                buf = self._gather_weights(c)
                try:
                    resumed, _updates = self._session.register_chunk(
                        c.chunk_id, c.num_elements, c.dtype_code, c.dtype_code,
                        _as_byte_buffer(buf), layout_fingerprint=c.layout_fingerprint)
                except FailedPrecondition as e:
                    if "fingerprint" not in e.message:
                        raise
                    raise FailedPrecondition(
                        f"{e.message} (this model's chunk {c.chunk_id:#x} holds "
                        f"{c.layout_description()})", e.code) from None
                if resumed:
                    self._install(c, buf)
                    resumed_any = True
        self.resumed = resumed_any

    def _gather_weights(self, c: Chunk) -> torch.Tensor:
        buf = torch.empty(c.num_elements, dtype=c.dtype)
        for seg in c.segments:
            buf[seg.offset:seg.offset + seg.numel].copy_(
                seg.param.detach().reshape(-1)[seg.start:seg.end])
        return buf

    def _install_hooks(self) -> None:
        self._hook_nodes = []
        self._hook_handles = []
        if not self.overlap:
            return
        self_ref = weakref.ref(self)
        for index, p in enumerate(self._params):
            node = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad
            self._hook_nodes.append(node)  # the node must outlive the hook

            def hook(grad_inputs, grad_outputs, index=index):
                opt = self_ref()
                if opt is not None:
                    opt._on_grad_accumulated(index)

            self._hook_handles.append(node.register_hook(hook))

    def _remove_hooks(self) -> None:
        for handle in getattr(self, "_hook_handles", []):
            try:
                handle.remove()
            except Exception:
                pass
        self._hook_handles = []
        self._hook_nodes = []

    def _stop_daemon(self) -> None:
        daemon, self._daemon = self._daemon, None
        if daemon is not None:
            daemon.stop()

    # ------------------------------------------------------------------ per step
    def _reset_step_state(self) -> None:
        self._inflight: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self._sent: set = set()
        self._staged: set = set()
        self._overflow = False
        self._reset_rounds()

    def _reset_rounds(self) -> None:
        # Per chunk: backward passes completed, and per param the passes seen.
        self._rounds = {c.chunk_id: 0 for c in self._chunks}
        self._reached = {c.chunk_id: 0 for c in self._chunks}
        self._param_passes = [0] * len(self._params)

    def _check_usable(self) -> None:
        if self._closed or self._session is None:
            raise FailedPrecondition(f"fuyou.AdamW of job {self.job!r} is closed")
        if self._failed is not None:
            raise FailedPrecondition(
                f"fuyou.AdamW of job {self.job!r} failed earlier and cannot continue "
                f"({self._failed}); open a new optimizer on the job to resume from its last "
                f"committed step ({self._committed})") from self._failed

    def _hooks_send(self) -> bool:
        return self.overlap and self.max_grad_norm is None and not self._overflow

    def _on_grad_accumulated(self, index: int) -> None:
        with self._lock:
            if self._closed or self._failed is not None:
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
                        if self._rounds[cid] >= self.accumulation_steps and self._hooks_send():
                            try:
                                self._send_chunk(c, 1.0 / self._scaler.scale)
                            except BaseException as e:
                                self._failed = e
                                raise

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

    def _send_chunk(self, c: Chunk, grad_scale: float) -> None:
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
            if self._scaler.enabled and not bool(torch.isfinite(dst).all()):
                self._overflow = True
                session.release_slot(slot)
                return
            group = self.param_groups[c.group_index]
            beta1, beta2 = group["betas"]
            session.send_grad_ready(c.chunk_id, slot, self._committed + 1, float(group["lr"]),
                                    float(beta1), float(beta2), float(group["eps"]),
                                    float(group["weight_decay"]), float(grad_scale))
        except BaseException:
            if self._failed is None:
                try:
                    session.release_slot(slot)
                except Exception:
                    pass
            raise
        self._inflight[c.chunk_id] = slot
        self._sent.add(c.chunk_id)

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

    def _install(self, c: Chunk, src: torch.Tensor) -> None:
        for seg in c.segments:
            part = src[seg.offset:seg.offset + seg.numel]
            data = seg.param.data
            if data.is_contiguous():
                data.view(-1)[seg.start:seg.end].copy_(part, non_blocking=False)
            else:
                flat = data.reshape(-1).clone()
                flat[seg.start:seg.end].copy_(part)
                data.copy_(flat.view_as(data))

    def _clip_coefficient(self) -> float:
        """min(1, max_norm / (norm + 1e-6)) of the unscaled gradients, computed as
        torch.nn.utils.clip_grad_norm_ does (fp32, same reductions); nan or inf
        when the norm is not finite."""
        grads = [p.grad.detach() for p in self._params if p.grad is not None]
        if not grads:
            return 1.0
        device = grads[0].device
        norms = [(torch.norm(g, 2.0) if g.dtype == torch.float32 else
                  torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)).to(device)
                 for g in grads]
        total = torch.norm(torch.stack(norms), 2.0)
        if self._scaler.enabled:
            total = total / self._scaler.scale  # a power of two: exact
        if not bool(torch.isfinite(total)):
            return float("nan")
        clip_coef = self.max_grad_norm / (total + 1e-6)
        return float(torch.clamp(clip_coef, max=1.0))

    def _finish_step(self) -> None:
        session = self._session
        step = self._committed + 1
        inv_scale = 1.0 / self._scaler.scale
        grad_scale = inv_scale
        if self.max_grad_norm is not None and not self._overflow:
            clip_coef = self._clip_coefficient()
            if not math.isfinite(clip_coef):
                self._overflow = True
            else:
                grad_scale = clip_coef * inv_scale
        if not self._overflow:
            for c in self._chunks:
                if c.chunk_id not in self._sent:
                    self._send_chunk(c, grad_scale)
                    if self._overflow:
                        break
        if self._overflow:
            self._drain_all(session)
            if self._sent:
                session.abort_step(step)
            self._staged.clear()
            self._scaler.update(overflow=True)
            self.skipped_steps += 1
            self._reset_step_state()
            return
        for cid in list(self._staged):
            self._install(self._chunk_by_id[cid], self._staging[cid])
        while self._inflight:
            cid, _ = self._inflight.popitem(last=False)
            c = self._chunk_by_id[cid]
            slot = self._wait(session, cid)
            self._install(c, self._view(slot, "param", c.dtype)[:c.num_elements])
            session.release_slot(slot)
        sent_any = bool(self._sent)
        if sent_any:
            committed, _chunks = session.end_step(step)
            self._committed = int(committed)
        self._scaler.update(overflow=False)
        self._reset_step_state()
