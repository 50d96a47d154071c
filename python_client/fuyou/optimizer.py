"""fuyou.AdamW: a torch.optim.Optimizer whose states live in fuyoud."""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import math
import os
import socket
import sys
import threading
import warnings
import weakref
from typing import Optional, Union

import torch

from . import _checkpoint
from ._chunking import plan_chunks, trainable_params
from ._errors import FailedPrecondition, FuyouError, InvalidArgument
from ._loss_scale import make_loss_scaler
from ._materialize import is_empty, job_of
from ._offload import FETCH_SLOTS, OffloadedParams
from ._state_view import StateView
from ._pipeline import (ABORT_OVERFLOW, ABORT_SKIPPED_STEP, REDO_CLIPPED,
                        REDO_GRADIENTS_CHANGED, ChunkPipeline, LoopStats)
from .daemon import EmbeddedDaemon, release_shared_embedded, resolve_address

__all__ = ["AdamW"]

MAX_SLOTS = 64
_STATE_VERSION = 2  # 2: "state" holds the moments when fuyou["state_included"]
DEFAULT_STATE_DICT_MAX_BYTES = 2 << 30  # moments (exp_avg + exp_avg_sq) state_dict() holds


def _torch_set_to_none_default() -> bool:
    """The default of the installed torch's Optimizer.zero_grad(set_to_none=...):
    False on torch 1.x, True on 2.x."""
    try:
        default = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
    except (KeyError, TypeError, ValueError):
        return True
    return bool(default) if isinstance(default, bool) else True


SET_TO_NONE_DEFAULT = _torch_set_to_none_default()


def _open_session(job: str, num_slots: int, slot_bytes: int, client_info: str, address: str,
                  rpc_timeout: float, connect_timeout: float):
    """Opens a clientlib session (fuyou._fuyou.Session). Tests replace this with a fake."""
    from . import _native
    return _native.module().Session.open(
        job=job, num_slots=num_slots, slot_bytes=slot_bytes, client_info=client_info,
        address=address, rpc_timeout=rpc_timeout, connect_timeout=connect_timeout)


_OPEN: "weakref.WeakSet[AdamW]" = weakref.WeakSet()  # this process's open optimizers


def _find_open(job: str, address: str) -> Optional["AdamW"]:
    """The open optimizer of this process on `job` of the daemon at `address`."""
    for opt in list(_OPEN):
        if opt.job == job and opt.address == address and not opt._closed:
            return opt
    return None


class _CloseAtExit:
    """atexit handler of one optimizer (weakly held): closes it if still open."""

    def __init__(self, opt: "AdamW"):
        self._ref = weakref.ref(opt)

    def __call__(self) -> None:
        opt = self._ref()
        if opt is not None:
            try:
                opt.close()
            except Exception as e:  # at exit: say it, never raise
                print(f"fuyou: closing job {opt.job!r} at exit failed: {e}", file=sys.stderr)


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
    accumulator notices when every gradient of a chunk is in and only enqueues
    the chunk; the optimizer's sender thread copies its gradients (one copy; on
    CUDA on a side stream into pinned memory) into a shared-memory slot and the
    daemon updates it while backward goes on with earlier layers. When all
    ``num_slots`` slots are busy the sender thread (never backward) waits for the
    oldest chunk's new weights and keeps them in a per-chunk staging copy (extra
    memory of that chunk's size, on the parameters' device); the model's
    parameters themselves only change in :meth:`step`, after
    backward. Each GradReady carries the group's *current* ``lr``, ``betas``,
    ``eps`` and ``weight_decay``, so LR schedulers work as with torch.

    **Speculate, validate, redo.** An update sent during backward is
    *speculative*: with it goes a fingerprint of the chunk's gradients (fp32 sum
    and sum of squares, computed on the gradients' device). :meth:`step` takes the
    fingerprints of the sent chunks again from the current ``.grad`` (one pass,
    one wait for the device) and redoes every chunk whose gradients changed
    (``clip_grad_norm_``, an in-place unscale, one more backward): the daemon
    drops its update of the step and updates again from the committed states.
    The result is what torch.optim.AdamW computes from ``.grad`` at step(). A
    step the loop skips (:meth:`zero_grad`, or the model's ``zero_grad`` and a new
    backward, without :meth:`step`) is rolled back (AbortStep): nothing of it is
    committed. ``loop_stats`` counts all of this.

    **Gradient accumulation.** Nothing to do: a backward pass that reaches a
    chunk already sent in the step (with a gradient that is not zero) tells
    fuyou that the loop accumulates. That step's early updates are redone at
    :meth:`step`; from then on a chunk is sent after as many passes as the loop
    made (``accumulation_steps=k`` says so from the start). A :meth:`step` that
    comes earlier sends what has accumulated.

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
    ``torch.nn.utils.clip_grad_norm_`` (then AdamW), with overlap on: chunks are
    updated speculatively during backward; at :meth:`step` the per-chunk sums of
    squares give the global norm, and when the coefficient
    ``max_norm / (norm + 1e-6)`` is below 1 every chunk is redone with
    ``grad_scale = clip_coef / loss_scale`` (``.grad`` is not rewritten). Cost:
    a step that clips takes backward plus one optimizer pass over all chunks (as
    without overlap), one that does not clips nothing. A non-finite norm skips
    the step like an overflow. ``clip_grad_norm_`` in the loop works as well
    (every chunk it scales is redone as changed).

    **Parameters without a gradient.** A parameter whose ``.grad`` is None in a
    step keeps its weights, moments and Adam step count, as in torch, even when
    its chunk holds parameters with gradients (the GradReady names the chunk's
    segments without one). A chunk in which no parameter has a gradient is not
    sent at all.

    **state_dict.** :meth:`state_dict` is torch's, with each parameter's ``step``,
    ``exp_avg`` and ``exp_avg_sq`` read from the daemon (up to
    ``state_dict_max_bytes`` of moments), so ``torch.optim.AdamW`` continues from
    it; :meth:`load_state_dict` imports torch's (or another step's) moments into
    the daemon. ``opt.state[p]`` reads the daemon's states of ``p`` (read-only).

    **load_state_dict from another job.** A state dict that :meth:`state_dict`
    took from an optimizer on another job *forks* that job into this one, as
    torch's copy of the moments does, when this optimizer's job has nothing
    trained yet (a new job): its weights, moments and step counts become those of
    the other job at its last commit, and the parameters get its weights. The
    states are copied inside the daemon (admin ``CopyJob``, as ``fuyouctl
    copy-job``) when no session has the other job open, or read through the two
    sessions when an optimizer of this process has it open. Both optimizers then
    train identically. The layouts must match (same model, groups and
    ``chunk_bytes``); a job that already has trained states keeps them (a warning
    says so).

    **Weights in the daemon (offload_params=True).** For a model larger than
    the GPU: the daemon keeps each chunk's working weights too (in the
    parameters' dtype, beside master, m and v, under the same DRAM budget and
    commits) and the model holds them only while a module runs. The
    constructor opens the session and registers nothing (the parameters may be
    on ``meta``); :func:`fuyou.stream_parameters` plans the chunks from the
    model's modules (``offload.bind``: a chunk never holds two modules'
    parameters), registers the modules not registered yet (their current
    values start a new job; a resumed job keeps the daemon's committed weights)
    and installs the hooks that fetch each module's weights for its forward and
    backward. ``offload`` is the :class:`fuyou._offload.OffloadedParams` of the
    model (``bind``, ``job_exists``, ``register_module``, ``registered``; None
    without offload_params); ``fuyou.materialize`` registers one module at a
    time through it. A chunk's gradients go to the daemon as soon as backward
    completes them and are freed then, and the new weights are not installed
    (the next forward fetches them). The daemon journals the step's gradients
    and ``.grad`` becomes a :class:`fuyou._freed_grad.FreedGrad`: norms, inf
    checks, ``mul_``/``div_``/``zero_`` work (``clip_grad_norm_``, GradScaler,
    ``zero_grad``) and are replayed on the journal at :meth:`step`; a pass into
    a chunk already sent (undeclared accumulation) adds into the journal.
    ``max_grad_norm=`` replays every chunk with the coefficient, keeping the
    overlap. ``accumulation_steps=k`` adds each pass's gradients into a host
    copy and sends at the k-th. Not with ``init_from`` nor ``load_state_dict``
    of another job. It takes
    ``FETCH_SLOTS`` (4) more slots of ``chunk_bytes`` for the fetches.

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
        job: name of the job on the daemon (1-64 of ``[A-Za-z0-9._-]``). May be
            left out for parameters built in ``fuyou.init_empty(job=...)``,
            which recorded it.
        address: gRPC target of fuyoud (``unix:/path`` or a socket path). None:
            the default socket (``$FUYOU_SOCKET``, ``/run/fuyou/fuyoud.sock``, or
            the per-user one); when nothing answers there and ``embedded`` is not
            False (nor ``$FUYOU_EMBEDDED=0``) a private fuyoud is started for this
            process (see :class:`fuyou.EmbeddedDaemon`); ``embedded=True`` uses
            it even when a fuyoud answers on the default socket. The optimizers of
            one process share that embedded fuyoud (reference-counted: the last
            one closed stops it), each on its own job.

    **Exit without close().** At interpreter exit every optimizer still open is
    closed as :meth:`close` does (the steps that :meth:`step` returned from are
    committed; a step in progress, i.e. backward done without :meth:`step`, is
    abandoned), before the embedded daemon is stopped, so the daemon stops at once
    (no drain of an open session). A job reopened later resumes at the last step
    that :meth:`step` returned from.
        chunk_bytes: most bytes of weights in one chunk (slot size).
        num_slots: shared-memory slots, i.e. chunks in flight at once (1-64).
        amsgrad: must be False (NotImplementedError otherwise: the daemon keeps
            no running maximum of ``exp_avg_sq``).
        maximize: as torch: maximizes the objective (Adam on ``-grad``; sent to the
            daemon as a negative ``grad_scale``). Per parameter group.
        foreach, capturable, differentiable, fused: accepted for compatibility
            with torch.optim.AdamW and kept in the parameter groups; they choose
            torch's implementation of the update and have no effect here (the
            daemon runs its own CPU kernel; gradients are not differentiated
            through the step).
        timeout: seconds any wait on the daemon may take before
            :class:`fuyou.FuyouError` is raised (a dead daemon never hangs a job).
        init_from: checkpoint to start a new job from (see above).
        offload_params: keep the working weights in the daemon and stream them
            into the model (see above and :func:`fuyou.stream_parameters`).
        state_dict_max_bytes: most bytes of moments (fp32 exp_avg + exp_avg_sq)
            :meth:`state_dict` puts in ``state`` (2 GiB; None: no limit); above
            it the state dict holds a job reference only and a warning names
            :meth:`export_checkpoint`. Also an attribute, settable.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 job: Optional[str] = None, address: Optional[str] = None,
                 chunk_bytes: int = 32 << 20, num_slots: int = 4, overlap: bool = True,
                 max_grad_norm: Optional[float] = None,
                 loss_scale: Union[None, float, str] = None, accumulation_steps: int = 1,
                 embedded: Optional[bool] = None, timeout: float = 60.0, init_from=None,
                 offload_params: bool = False,
                 state_dict_max_bytes: Optional[int] = DEFAULT_STATE_DICT_MAX_BYTES):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if job is not None and (not isinstance(job, str) or not job):
            raise ValueError("job must be a non-empty string")
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{MAX_SLOTS}, got {num_slots}")
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if state_dict_max_bytes is not None and state_dict_max_bytes < 0:
            raise ValueError(f"state_dict_max_bytes must be >= 0 or None, got {state_dict_max_bytes}")
        self._pipeline: Optional[ChunkPipeline] = None  # set last; add_param_group checks it
        self._closed = True
        # foreach, capturable, differentiable and fused choose torch's implementation
        # of the update; the daemon has one: they are kept in the groups (state_dict
        # round-trips) and have no effect.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad), maximize=bool(maximize), foreach=foreach,
                        capturable=bool(capturable), differentiable=bool(differentiable),
                        fused=fused)
        super().__init__(params, defaults)
        self.state = StateView(self)  # torch's state[p], read from the daemon
        self._group_param_ids = [[id(p) for p in g["params"]] for g in self.param_groups]
        #: most bytes of moments (exp_avg + exp_avg_sq, fp32) that state_dict()
        #: puts in its "state"; None: no limit, 0: never (a job reference only).
        self.state_dict_max_bytes = state_dict_max_bytes
        if job is None:  # the job fuyou.init_empty(job=) recorded on the parameters
            job = job_of(self.param_groups)
            if job is None:
                raise ValueError("job must be a non-empty string (or the parameters built in "
                                 "fuyou.init_empty(job=...), which records it)")
        if not offload_params and any(is_empty(p) for g in self.param_groups
                                      for p in g["params"]):
            raise InvalidArgument(
                f"fuyou.AdamW of job {job!r}: parameters built in fuyou.init_empty (or on meta) "
                "hold no values; fuyou.materialize(model) them first, or open the optimizer with "
                "offload_params=True and call fuyou.materialize(model, optimizer)")
        for i, group in enumerate(self.param_groups):
            if group["amsgrad"]:
                raise NotImplementedError(
                    f"fuyou.AdamW does not implement amsgrad=True (parameter group {i}): the "
                    "daemon keeps three states per chunk (master weights, exp_avg, exp_avg_sq), "
                    "not AMSGrad's running maximum of exp_avg_sq; use amsgrad=False or "
                    "torch.optim.AdamW")

        self.job = job
        self.chunk_bytes = int(chunk_bytes)
        self.overlap = bool(overlap)
        self.max_grad_norm = max_grad_norm
        self.timeout = float(timeout)
        self._scaler = make_loss_scaler(loss_scale)
        self._lock = threading.RLock()
        self._daemon: Optional[EmbeddedDaemon] = None
        self.skipped_steps = 0
        self.resumed = False

        self.offload: Optional[OffloadedParams] = None
        if offload_params:
            if init_from is not None:
                raise NotImplementedError(
                    "fuyou.AdamW(offload_params=True) does not take init_from: load the "
                    "checkpoint with fuyou.materialize (one module at a time)")
            if num_slots + FETCH_SLOTS > MAX_SLOTS:
                raise ValueError(f"num_slots must be in 1..{MAX_SLOTS - FETCH_SLOTS} with "
                                 f"offload_params ({FETCH_SLOTS} more slots fetch weights)")
            # Chunks follow the model's modules: planned when the model is bound.
            chunks = []
            trainable = [p for group in trainable_params([g["params"] for g in self.param_groups])
                         for _, p in group]
            largest = max((p.numel() * p.element_size() for p in trainable), default=8)
            total = sum(p.numel() * p.element_size() for p in trainable)
            slot_bytes = max(8, min(self.chunk_bytes, max(largest, total)))
        else:
            chunks, trainable = plan_chunks([g["params"] for g in self.param_groups],
                                            self.chunk_bytes)
            slot_bytes = max([c.nbytes for c in chunks], default=8)
        pipeline = ChunkPipeline(
            chunks, trainable, lock=self._lock, hyper=self._hyper,
            hook_grad_scale=self._hook_grad_scale, check_finite=self._scaler.enabled,
            accumulation_steps=accumulation_steps, timeout=self.timeout)

        plan = _checkpoint.plan_import(self, pipeline, init_from) if init_from is not None else None
        self._address, self._daemon = resolve_address(address, embedded)
        session = None
        try:
            self._num_slots = num_slots + (FETCH_SLOTS if offload_params else 0)
            self._slot_bytes = slot_bytes
            session = self._connect()
            if offload_params:
                pipeline.attach(session, register=False, reserved_slots=FETCH_SLOTS)
                self.offload = OffloadedParams(self, pipeline, self.chunk_bytes, self.timeout)
                pipeline.set_offload(self.offload.gradients)
            else:
                self.resumed = pipeline.attach(session)
            if plan is not None:
                _checkpoint.apply_import(self, pipeline, plan)
        except BaseException:
            pipeline.detach()  # its sender thread and pinned slots, before the mapping goes
            if session is not None:
                try:
                    session.close()
                except Exception:
                    pass
            self._stop_daemon()
            raise
        self._pipeline = pipeline
        self._closed = False
        if self.overlap and self.offload is None:  # offload: hooks come with registration
            pipeline.install_hooks()
        # Registered after the embedded daemon's own exit handler, so it runs first.
        self._exit_closer = _CloseAtExit(self)
        atexit.register(self._exit_closer)
        _OPEN.add(self)

    # ------------------------------------------------------------------ public
    @property
    def committed_step(self) -> int:
        """Last step the daemon committed for this job (durable)."""
        return self._pipeline.committed_step if self._pipeline is not None else 0

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
        return len(self._pipeline.chunks)

    @property
    def pipeline(self) -> ChunkPipeline:
        """The chunk pipeline: chunks, slots, hooks and the session to fuyoud."""
        return self._pipeline

    @property
    def accumulation_steps(self) -> int:
        """Backward passes per step given by ``accumulation_steps=``."""
        return self._pipeline.accumulation_steps

    @property
    def loop_stats(self) -> LoopStats:
        """What the training loop made this optimizer do (a copy): steps committed,
        chunk updates sent speculatively during backward, redone at step() (the
        gradients changed, or max_grad_norm clipped them), rolled back (skipped
        steps), and the seconds the redos took."""
        return dataclasses.replace(self._pipeline.stats)

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
            bad = self._groups_error()
            if bad is not None:  # nothing is changed: fix the group and step() again
                raise bad
            try:
                self._finish_step()
            except BaseException as e:
                self._pipeline.failed = e
                raise
        return loss

    def zero_grad(self, set_to_none: bool = SET_TO_NONE_DEFAULT) -> None:
        """Clears the gradients as torch.optim.Optimizer.zero_grad does; the default
        is the installed torch's (False on torch 1.x: zero tensors, which update
        the parameters in the next step, as in torch; True on 2.x: None, which
        leaves them alone)."""
        with self._lock:
            pipeline = self._pipeline
            if pipeline is not None and pipeline.attached and pipeline.failed is None:
                if pipeline.in_step:  # updates sent and no step(): the loop skipped it
                    try:
                        pipeline.abort(ABORT_SKIPPED_STEP)
                    except BaseException as e:
                        pipeline.failed = e
                        raise
                else:
                    pipeline.reset_passes()
                if self.offload is not None:
                    self.offload.gradients.reset_step()
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
            _OPEN.discard(self)
            closer = getattr(self, "_exit_closer", None)
            if closer is not None:
                atexit.unregister(closer)
            try:
                if self.offload is not None:
                    self.offload.close()
                if self._pipeline is not None:
                    self._pipeline.close()
            finally:
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
        if getattr(self, "_pipeline", None) is not None:
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
            if self._pipeline.in_step:
                raise FailedPrecondition(
                    f"export_checkpoint of job {self.job!r} during a step: call it after step()")
            if self.offload is not None:
                self.offload.weights.drain_fetches()
            checkpoint = _checkpoint.export_state(self, self._pipeline, model)
        if path is not None:
            torch.save(checkpoint, path)
        return checkpoint

    def state_dict(self) -> dict:
        """torch's optimizer state dict, which ``torch.optim.AdamW.load_state_dict``
        continues from exactly: ``param_groups`` as torch packs them and ``state``
        with each parameter's ``step``, ``exp_avg`` and ``exp_avg_sq`` read from the
        daemon at the last committed step, when the moments take at most
        ``state_dict_max_bytes`` (2 GiB by default). Above that, ``state`` is empty
        and a warning says to use :meth:`export_checkpoint`; so too (with a warning)
        during a step (backward without step()). ``"fuyou"`` holds the job,
        committed step, loss scaler and chunk layout, so that a fuyou.AdamW of the
        same job loads it without reading anything."""
        for hook in list(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            hook(self)  # torch 2.x's register_state_dict_pre_hook
        with self._lock:
            self._check_usable()
            pipeline = self._pipeline
            size = _checkpoint.moment_bytes(pipeline)
            limit = self.state_dict_max_bytes
            included = (limit is None or size <= limit) and not pipeline.in_step
            state: dict = {}
            if pipeline.in_step:  # backward sent chunks, no step() yet: the slots are busy
                warnings.warn(
                    f"fuyou.AdamW.state_dict of job {self.job!r} during a step (backward "
                    "without step()): the state dict holds a reference to the job in the "
                    "daemon only, without the moments (torch.optim.AdamW would start from "
                    "zero moments); call it after step() or zero_grad()", stacklevel=2)
            elif included:
                if self.offload is not None:
                    self.offload.weights.drain_fetches()
                state = _checkpoint.torch_state(self, pipeline)
            else:
                warnings.warn(
                    f"fuyou.AdamW.state_dict of job {self.job!r}: the moments take "
                    f"{size / 2**30:.2f} GiB, more than state_dict_max_bytes={limit}; the "
                    "state dict holds a reference to the job in the daemon only (fuyou.AdamW "
                    "loads it, torch.optim.AdamW would start from zero moments). For a "
                    "portable checkpoint use opt.export_checkpoint(path), or raise "
                    "opt.state_dict_max_bytes (None: no limit)", stacklevel=2)
            index = _checkpoint._torch_indices(self.param_groups)
            groups = [dict({k: v for k, v in g.items() if k != "params"},
                           params=[index[id(p)] for p in g["params"]])
                      for g in self.param_groups]
            sd = {"state": state, "param_groups": groups, "fuyou": {
                "version": _STATE_VERSION,
                "job": self.job,
                "committed_step": self.committed_step,
                "state_included": included,
                "skipped_steps": self.skipped_steps,
                "loss_scaler": self._scaler.state_dict(),
                "accumulation_steps": self.accumulation_steps,
                "max_grad_norm": self.max_grad_norm,
                "chunk_bytes": self.chunk_bytes,
                "chunks": [(c.chunk_id, c.num_elements, str(c.dtype)) for c in pipeline.chunks],
            }}
        for hook in list(getattr(self, "_optimizer_state_dict_post_hooks", {}).values()):
            result = hook(self, sd)  # torch 2.x's register_state_dict_post_hook
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of :meth:`state_dict` or of ``torch.optim.AdamW``
        (over the same parameter groups), as torch does: the groups'
        hyper-parameters, and the moments and per-parameter step counts, which are
        imported into the daemon (one atomic commit) with the model's current
        parameters as master weights (load the model's weights first, as with
        torch). A state dict of this job at its committed step imports nothing; one
        of another job forks it (see the class doc); one without moments (over
        ``state_dict_max_bytes``) of this job at another step keeps the daemon's
        states (a warning says so). Groups or shapes that do not match raise
        InvalidArgument before anything is written. Between steps only. With
        offload_params the daemon's weights stay (they are the model's: load the
        model's state dict into the streamed model first) and only the moments
        and step counts are imported; the model must be registered
        (``fuyou.stream_parameters``) first."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise InvalidArgument("load_state_dict takes an optimizer state dict "
                                  "(param_groups, state)")
        extra = state_dict.get("fuyou")
        with self._lock:
            self._check_usable()
            self._check_layout(state_dict, extra)
            action = self._load_action(state_dict, extra)
            if action == "import":
                if self._pipeline.in_step:
                    raise FailedPrecondition(f"load_state_dict into job {self.job!r} during a "
                                             "step: call it between steps")
                self._import_moments(state_dict)
            elif action == "fork":
                self._fork_or_import(state_dict, extra)
            elif action == "keep":
                warnings.warn(
                    f"state_dict is from step {extra.get('committed_step')}, but job "
                    f"{self.job!r} is committed at step {self.committed_step} in the daemon, "
                    "which holds the weights and moments, and the state dict holds no "
                    "moments (over state_dict_max_bytes); hyper-parameters and loss scale "
                    "were loaded. Use export_checkpoint / init_from to move moments")
            stateless = {"state": {}, "param_groups": state_dict["param_groups"]}
            super().load_state_dict(stateless)
            for group in self.param_groups:  # a torch state dict lacks fuyou's group keys
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
            if extra is not None:
                self._scaler.load_state_dict(extra.get("loss_scaler", {}))
                self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # torch's load_state_dict ends here with a new dict
        self.state = StateView(self)

    def __getstate__(self):
        raise TypeError(
            f"fuyou.AdamW of job {getattr(self, 'job', None)!r} cannot be pickled or "
            "deep-copied: its states live in the daemon under its session; save "
            "opt.state_dict() (or export_checkpoint) and load it into a new optimizer")

    def __repr__(self) -> str:
        """The job, then each parameter group's settings as torch prints them."""
        chunks = len(self._pipeline.chunks) if self._pipeline is not None else 0
        head = (f"fuyou.AdamW(job={self.job!r}, {chunks} chunks, "
                f"{len(self.param_groups)} groups, committed_step={self.committed_step}, "
                f"address={getattr(self, '_address', None)!r})")
        groups = super().__repr__().split("\n", 1)  # "AdamW (" then torch's group lines
        return head + (" (\n" + groups[1] if len(groups) > 1 else "")

    # ------------------------------------------------------------------ internals
    def _check_layout(self, state_dict: dict, extra: Optional[dict]) -> None:
        """Groups (count, sizes) and, for a fuyou state dict, the chunk layout of
        `state_dict` match this optimizer's; InvalidArgument otherwise."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise InvalidArgument(
                f"load_state_dict: the state dict has {len(saved)} parameter groups, the "
                f"optimizer of job {self.job!r} {len(self.param_groups)}")
        for i, (sg, g) in enumerate(zip(saved, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise InvalidArgument(
                    f"load_state_dict: group {i} of the state dict has {len(sg['params'])} "
                    f"parameters, the optimizer's {len(g['params'])}")
        if extra is None:
            return
        chunks = [tuple(c) for c in extra.get("chunks", [])]
        mine = [(c.chunk_id, c.num_elements, str(c.dtype)) for c in self._pipeline.chunks]
        if chunks and chunks != mine:
            raise InvalidArgument(
                f"state_dict was saved with a different chunk layout ({len(chunks)} chunks, "
                f"chunk_bytes={extra.get('chunk_bytes')}) than this optimizer's ({len(mine)} "
                f"chunks, chunk_bytes={self.chunk_bytes}); build the optimizer with the same "
                "model, parameter groups and chunk_bytes")

    def _load_action(self, state_dict: dict, extra: Optional[dict]) -> str:
        """What load_state_dict does with the daemon's states: "none" (this job at
        its committed step, or nothing to import into a new job), "import" (the
        state dict's moments), "fork" (another fuyou job), "keep" (this job at
        another step, no moments in the state dict: a warning)."""
        moments = extra is None or bool(extra.get("state_included"))
        if extra is not None and extra.get("job") == self.job:
            if extra.get("committed_step") == self.committed_step:
                return "none"
            action = "import" if moments else "keep"
        elif extra is not None:
            return "fork"  # the offload refusal is _fork_from's
        else:
            fresh = not self.resumed and self.committed_step == 0 and not any(
                any(self._pipeline.segment_update_counts(c)) for c in self._pipeline.chunks)
            action = "none" if fresh and not state_dict.get("state") else "import"
        if action == "import" and self.offload is not None and not self.offload.registered:
            raise FailedPrecondition(
                f"load_state_dict into fuyou.AdamW(offload_params=True) of job {self.job!r} "
                "before its model is registered: call fuyou.stream_parameters(model, opt) (or "
                "fuyou.materialize) first, then load the optimizer's state dict")
        return action

    def _fork_or_import(self, state_dict: dict, extra: dict) -> None:
        """Another job's state dict: fork that job (see _fork_from); when the daemon
        has no such job and the state dict holds the moments, import them."""
        source = extra.get("job")
        moments = bool(extra.get("state_included"))
        try:
            self._fork_from(source)
        except FuyouError as e:
            missing = getattr(e, "code", None) == "NOT_FOUND" or "does not exist" in str(e)
            if not (moments and missing and not self._pipeline.in_step):
                raise
            self._import_moments(state_dict)

    def _import_moments(self, state_dict: dict) -> None:
        """The state dict's moments and step counts into the daemon, in one
        import. Resident: the masters are the model's parameters (what torch
        steps from). offload_params: the daemon's weights stay (they are the
        model's; model.load_state_dict writes them), only the moments change."""
        streamed = self.offload is not None
        plan = _checkpoint.plan_import(self, self._pipeline, state_dict,
                                       masters_from_model=not streamed)
        _checkpoint.apply_load(self._pipeline, plan)
        if streamed:
            self.offload.weights.drop_cache()

    def _connect(self):
        """A new session on this optimizer's job."""
        # At most 256 characters (1 KiB of UTF-8): fuyoud refuses a longer client_info.
        info = f"{socket.gethostname()} pid {os.getpid()} {' '.join(sys.argv[:1])}".strip()[:256]
        return _open_session(self.job, self._num_slots, self._slot_bytes, info, self._address,
                             self.timeout, min(self.timeout, 5.0))

    def _fork_from(self, source: str) -> None:
        """Makes this optimizer's job a copy of job `source` at its last commit
        (load_state_dict of another job's state dict). Only a job with nothing
        trained is replaced; one with trained states keeps them (a warning says so)."""
        pipeline = self._pipeline
        trained = self.resumed or self.committed_step != 0 or any(
            any(pipeline.segment_update_counts(c)) for c in pipeline.chunks)
        if trained:
            warnings.warn(
                f"state_dict is from job {source!r}, this optimizer trains {self.job!r}, which "
                f"already has trained states (committed step {self.committed_step}): its weights "
                f"and moments stay those of {self.job!r}. Load the state_dict into an optimizer "
                f"on a new job to fork {source!r}")
            return
        if pipeline.in_step:
            raise FailedPrecondition(f"load_state_dict into job {self.job!r} during a step: "
                                     "call it between steps")
        if self.offload is not None:
            raise NotImplementedError(
                f"load_state_dict of job {source!r} into job {self.job!r} with offload_params: "
                "fork the job with fuyouctl copy-job and open the copy instead")
        other = _find_open(source, self._address)
        if other is not None:
            self._copy_from(other)
        else:
            self._fork_in_daemon(source)

    def _copy_from(self, other: "AdamW") -> None:
        """`other` (an open optimizer of this process on the same daemon) holds
        the source job's session, so the daemon cannot fork the job: its committed
        states are read through its session and imported into this job (through
        the sessions' shared memory, one chunk at a time)."""
        with other._lock:
            other._check_usable()
            if other._pipeline.in_step:
                raise FailedPrecondition(
                    f"load_state_dict from job {other.job!r}, whose optimizer is in a step: "
                    "take the state_dict between steps")
            theirs = {c.chunk_id: c for c in other._pipeline.chunks}
            imports = []
            for c in self._pipeline.chunks:
                src = theirs.get(c.chunk_id)
                if src is None or src.num_elements != c.num_elements:
                    raise InvalidArgument(
                        f"load_state_dict: job {other.job!r} has no chunk {c.chunk_id:#x} of "
                        f"{c.num_elements} elements; build the optimizer over the same model, "
                        "parameter groups and chunk_bytes")
                states, _t = other._pipeline.read_states(src)
                imports.append((c, states, other._pipeline.segment_update_counts(src)))
        pipeline = self._pipeline
        for c, (master, m, v), counts in imports:
            pipeline.write_state(c, _checkpoint.STATE_MASTER, master)
            pipeline.write_state(c, _checkpoint.STATE_EXP_AVG, m)
            pipeline.write_state(c, _checkpoint.STATE_EXP_AVG_SQ, v)
            if any(counts):
                pipeline.set_update_count(c, counts)
        pipeline.commit_import()
        with torch.no_grad():
            for c, (master, _m, _v), _counts in imports:
                pipeline.install(c, master.to(c.dtype))

    def _fork_in_daemon(self, source: str) -> None:
        """The daemon copies job `source` (admin CopyJob) over this optimizer's
        job, which has nothing trained: the session is closed, the job deleted and
        copied again from `source`, and a new session resumes it."""
        from . import admin_client
        pipeline = self._pipeline
        admin = admin_client(self._address, self.timeout)
        pipeline.close()
        copy_error = None
        try:
            try:
                admin.delete_job(self.job)
            except Exception as e:  # an empty job may already be gone with its session
                if "does not exist" not in str(e):
                    raise
            try:
                admin.copy_job(source, self.job)
            except Exception as e:
                copy_error = e
        finally:
            self.resumed = pipeline.attach(self._connect())
            if self.overlap:
                pipeline.install_hooks()
        if copy_error is not None:
            raise copy_error

    def _stop_daemon(self) -> None:
        daemon, self._daemon = self._daemon, None
        if daemon is not None:
            release_shared_embedded(daemon)

    def _check_usable(self) -> None:
        if self._closed or self._pipeline is None or not self._pipeline.attached:
            raise FailedPrecondition(f"fuyou.AdamW of job {self.job!r} is closed")
        failed = self._pipeline.failed
        if failed is not None:
            raise FailedPrecondition(
                f"fuyou.AdamW of job {self.job!r} failed earlier and cannot continue "
                f"({failed}); open a new optimizer on the job to resume from its last "
                f"committed step ({self.committed_step})") from failed

    def _groups_error(self) -> Optional[Exception]:
        """What is wrong with the parameter groups as the loop edited them since the
        constructor checked them (torch.optim.AdamW would take or ignore it): an
        exception for step() to raise, or None."""
        for i, group in enumerate(self.param_groups):
            if group.get("amsgrad"):
                return NotImplementedError(
                    f"fuyou.AdamW: parameter group {i} has amsgrad=True (set after "
                    "construction); the daemon keeps no running maximum of exp_avg_sq: set it "
                    "back to False or use torch.optim.AdamW")
            try:
                lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
                beta1, beta2 = (float(b) for b in group["betas"])
            except (KeyError, TypeError, ValueError) as e:
                return ValueError(f"fuyou.AdamW: parameter group {i} lacks a usable lr, betas, "
                                  f"eps or weight_decay ({e!r})")
            if not (lr >= 0.0 and eps >= 0.0 and wd >= 0.0 and 0.0 <= beta1 < 1.0
                    and 0.0 <= beta2 < 1.0):
                return ValueError(
                    f"fuyou.AdamW: parameter group {i} was set to lr={lr}, betas=({beta1}, "
                    f"{beta2}), eps={eps}, weight_decay={wd}; the constructor's ranges hold "
                    "mid-run too (lr, eps, weight_decay >= 0, 0 <= beta < 1)")
            if self.offload is None and i < len(self._group_param_ids) and \
                    [id(p) for p in group["params"]] != self._group_param_ids[i]:
                return InvalidArgument(
                    f"fuyou.AdamW: the parameters of group {i} were changed after construction; "
                    "its chunks are registered with the daemon: build a new optimizer (on a new "
                    "job) over the new parameters")
        return None

    def _hyper(self, group_index: int):
        """The group's hyper-parameters now (an LR scheduler may have changed them)."""
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                bool(group.get("maximize", False)))

    def _hook_grad_scale(self) -> Optional[float]:
        """grad_scale for a chunk sent during backward; None: hooks must not send."""
        if not self.overlap or self._pipeline.overflow or self._groups_error() is not None:
            return None  # step() raises for a bad group
        return 1.0 / self._scaler.scale

    def _clip_coefficient(self, squares) -> float:
        """min(1, max_norm / (norm + 1e-6)) of the unscaled gradients as
        torch.nn.utils.clip_grad_norm_ computes it (fp32), from the chunks' sums of
        squares; nan or inf when the norm is not finite."""
        if not squares:
            return 1.0
        total = torch.tensor(list(squares), dtype=torch.float32).sum().sqrt()
        if self._scaler.enabled:
            total = total / self._scaler.scale  # a power of two: exact
        if not bool(torch.isfinite(total)):
            return float("nan")
        clip_coef = torch.tensor(self.max_grad_norm, dtype=torch.float32) / (total + 1e-6)
        return float(torch.clamp(clip_coef, max=1.0))

    def _finish_step(self) -> None:
        pipeline = self._pipeline
        offload = self.offload
        if offload is not None:
            offload.weights.release_backward_holds()
        inv_scale = 1.0 / self._scaler.scale
        grad_scale = inv_scale
        if not pipeline.overflow:
            clipping = self.max_grad_norm is not None
            if offload is not None:
                # The gradients sent are in the daemon's journal: what the loop
                # did to them (FreedGrad ops) and the clip are replayed there.
                offload.gradients.finish_adding(inv_scale)
                pipeline.wait_sent()
                changed, squares = [], (offload.gradients.squares() if clipping else [])
            else:
                changed, squares = pipeline.validate(squares=clipping)
                squares = list(squares.values())
            clip_coef = self._clip_coefficient(squares) if clipping else 1.0
            if not math.isfinite(clip_coef):
                pipeline.mark_overflow()
            elif offload is not None:
                grad_scale = clip_coef * inv_scale
                offload.gradients.replay(grad_scale, clip_coef < 1.0,
                                         (REDO_GRADIENTS_CHANGED, REDO_CLIPPED))
            else:
                grad_scale = clip_coef * inv_scale
                changed_ids = {c.chunk_id for c in changed}
                for c in pipeline.sent_chunks():
                    if c.chunk_id in changed_ids:
                        pipeline.redo(c, grad_scale, REDO_GRADIENTS_CHANGED)
                    elif clip_coef < 1.0:
                        pipeline.redo(c, grad_scale, REDO_CLIPPED)
                    if pipeline.overflow:
                        break
        if not pipeline.overflow:
            if offload is not None:
                offload.gradients.send_unsent(grad_scale)
            else:
                pipeline.send_unsent(grad_scale)
        if pipeline.overflow:
            pipeline.abort(ABORT_OVERFLOW)
            if offload is not None:
                offload.gradients.reset_step()
            self._scaler.update(overflow=True)
            self.skipped_steps += 1
            return
        pipeline.commit()
        if offload is not None:  # fetched weights are the previous step's now
            offload.gradients.reset_step()
            offload.weights.drop_cache()
        self._scaler.update(overflow=False)
