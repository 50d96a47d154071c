"""fuyou.AdamW: a torch.optim.Optimizer whose states live in fuyoud."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import threading
from typing import Optional, Union

import torch

from . import (_checkpoint, _data_parallel, _dp_alike, _lifetime, _optimizer_state,
               _reshard_one, _sharded_states)
from ._adamw_doc import ADAMW_REFERENCE
from ._connection import DaemonConnection
from ._errors import FailedPrecondition, InvalidArgument
from ._groups import (check_arguments, check_groups, check_track_frozen, edited_group_error,
                      gradient_error, moments_dtype_code, unsupported_setting,
                      STATE_DTYPE_NAMES)
from ._loss_scale import make_loss_scaler
from ._mode import StepMode
from ._pipeline import ChunkPipeline, LoopStats
from ._protocol import Hyper
from ._resident import ResidentMode
from ._settings import OptimizerSettings, Setting
from ._sharded_mode import ShardedResidentMode
from ._sharded_streamed import ShardedStreamedMode
from ._state_view import StateView
from ._streamed import StreamedMode
from ._torch_format import torch_indices
from .daemon import EmbeddedDaemon, threads_beside_cpu_training

__all__ = ["AdamW"]

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


def _mode_class(offload_params: bool, data_parallel) -> type:
    """The step mode for the constructor's arguments: the one place that chooses
    (for_optimizer refuses what a data-parallel group cannot do)."""
    if data_parallel is not None:
        return ShardedStreamedMode if offload_params else ShardedResidentMode
    return StreamedMode if offload_params else ResidentMode


@contextlib.contextmanager
def _torch_load_hooks_held_back(opt):
    """torch.optim.Optimizer.load_state_dict without its load hooks (torch 2.x):
    AdamW.load_state_dict runs them itself, on the whole state dict, not on the
    groups-only dict it hands torch."""
    names = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
    held = {name: opt.__dict__[name] for name in names if name in opt.__dict__}
    for name in held:
        opt.__dict__[name] = collections.OrderedDict()
    try:
        yield
    finally:
        opt.__dict__.update(held)


class AdamW(torch.optim.Optimizer):
    __doc__ = ADAMW_REFERENCE  # _adamw_doc.py: chunking, overlap, redo, modes, export

    # The constructor's knobs, kept in self._settings (_settings.py).
    chunk_bytes = Setting("Most bytes of weights per chunk.")
    overlap = Setting("Whether the hooks send chunks during backward.")
    max_grad_norm = Setting("Clip by the global norm at step(); None: no clipping.")
    timeout = Setting("Seconds any wait on the daemon may take.")
    state_dtype = Setting('"fp32", "bf16" or "8bit": the dtype the daemon keeps exp_avg '
                          'and exp_avg_sq in.')
    state_dict_max_bytes = Setting(
        "Most bytes of moments (exp_avg + exp_avg_sq, fp32) that state_dict() puts in "
        'its "state"; None: no limit, 0: never (a job reference only).')

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 job: Optional[str] = None, address: Optional[str] = None,
                 chunk_bytes: int = 32 << 20, num_slots: int = 4, overlap: bool = True,
                 max_grad_norm: Optional[float] = None,
                 loss_scale: Union[None, float, str] = None, accumulation_steps: int = 1,
                 embedded: Optional[bool] = None, timeout: float = 60.0, init_from=None,
                 offload_params: bool = False, state_dtype: str = "fp32",
                 state_dict_max_bytes: Optional[int] = DEFAULT_STATE_DICT_MAX_BYTES,
                 process_group=None, track_frozen: bool = False):
        check_arguments(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, job=job,
                        num_slots=num_slots, accumulation_steps=accumulation_steps,
                        max_grad_norm=max_grad_norm, timeout=timeout,
                        state_dict_max_bytes=state_dict_max_bytes)
        moments_dtype = moments_dtype_code(state_dtype)
        self._settings = OptimizerSettings(
            chunk_bytes=int(chunk_bytes), overlap=bool(overlap), max_grad_norm=max_grad_norm,
            timeout=float(timeout), state_dtype=STATE_DTYPE_NAMES[moments_dtype],
            state_dict_max_bytes=state_dict_max_bytes)
        self._pipeline: Optional[ChunkPipeline] = None  # set last; add_param_group checks it
        self._mode: Optional[StepMode] = None
        self._exit_token = None  # _lifetime's while open; None: closed
        # foreach, capturable, differentiable and fused choose torch's implementation
        # of the update; the daemon has one: they are kept in the groups (state_dict
        # round-trips) and have no effect.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad), maximize=bool(maximize), foreach=foreach,
                        capturable=bool(capturable), differentiable=bool(differentiable),
                        fused=fused)
        super().__init__(params, defaults)
        self.state = StateView(self)  # torch's state[p], read from the daemon
        job = check_groups(self.param_groups, job, offload_params)
        # In a torch.distributed group of several ranks: this rank's share
        # (_data_parallel.py); the session's job is <job>.rank<r>-of<w>.
        self._data_parallel = _data_parallel.for_optimizer(process_group, job, offload_params,
                                                           init_from)
        if self._data_parallel is not None:  # a collective: the ranks' optimizers alike
            _dp_alike.check_alike(self._data_parallel, _dp_alike.describe(
                job, self.param_groups, offload_params=bool(offload_params),
                chunk_bytes=int(chunk_bytes), state_dtype=self._settings.state_dtype,
                max_grad_norm=max_grad_norm))
        check_track_frozen(track_frozen, offload_params, self._data_parallel)
        self._connection = DaemonConnection(
            job if self._data_parallel is None else self._data_parallel.rank_job,
            self.timeout, self._data_parallel)
        self._scaler = make_loss_scaler(loss_scale)
        self._lock = threading.RLock()
        self.skipped_steps = 0
        self.resumed = False
        self._reshard_plan = None  # a single process's reshard from ranks (_reshard_one.py)

        mode_class = _mode_class(offload_params, self._data_parallel)
        chunks, trainable, slot_bytes = mode_class.plan(self.param_groups, self.chunk_bytes,
                                                        num_slots, init_from, track_frozen)
        if self._data_parallel is not None and not offload_params:  # streamed: at bind
            chunks = self._data_parallel.take_shard(chunks)
        pipeline = ChunkPipeline(
            chunks, trainable, lock=self._lock, hyper=self._hyper,
            hook_grad_scale=self._hook_grad_scale, check_finite=self._scaler.enabled,
            accumulation_steps=accumulation_steps, timeout=self.timeout,
            install_weights=mode_class.INSTALL_WEIGHTS, moments_dtype=moments_dtype,
            commit_empty_steps=self._data_parallel is not None)

        plan = _checkpoint.plan_import(self, pipeline, init_from) if init_from is not None else None
        # An embedded fuyoud beside a training on the CPU gets the cores torch leaves.
        on_cpu = any(p.device.type == "cpu" for g in self.param_groups for p in g["params"])
        self._connection.resolve(address, embedded,  # one fuyoud per node in a group
                                 threads_beside_cpu_training(torch.get_num_threads()) if on_cpu else None)
        session = None
        try:
            session = self._connection.open_first(num_slots + mode_class.EXTRA_SLOTS, slot_bytes)
            self._mode = mode_class(self, pipeline, session)
            self._reshard_into_one_process(pipeline, session, offload_params)
            if plan is not None and self._data_parallel is not None:
                _sharded_states.import_together(self, pipeline, plan)  # then broadcast
            elif plan is not None:
                _checkpoint.apply_import(self, pipeline, plan)
        except BaseException:
            pipeline.detach()  # its sender thread and pinned slots, before the mapping goes
            if session is not None:
                try:
                    session.close()
                except Exception:
                    pass
            self._connection.release()
            raise
        self._pipeline = pipeline
        self._exit_token = _lifetime.enter(self)
        self._mode.start()

    # ------------------------------------------------------------------ public
    @property
    def committed_step(self) -> int:
        """Last step the daemon applied for this job: its updates are in the
        weights and in what the next step reads."""
        return self._pipeline.committed_step if self._pipeline is not None else 0

    @property
    def durable_step(self) -> int:
        """Last step known durable, where the job resumes after a crash of the
        daemon or the machine: ``committed_step``, or one less while that step's
        commit still runs in fuyoud (it overlaps the next step's forward). It is
        read from each EndStep's answer, so it may lag the daemon by one step."""
        return self._pipeline.durable_step if self._pipeline is not None else 0

    @property
    def job(self) -> str:
        """The job this optimizer's session trains (a rank's own in a
        data-parallel group)."""
        return self._connection.job

    @property
    def offload(self):
        """The OffloadedParams of the model (offload_params), else None."""
        return self._mode.offload if self._mode is not None else None

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 when loss scaling is off)."""
        return self._scaler.scale

    @property
    def address(self) -> str:
        """gRPC target of the daemon this optimizer talks to."""
        return self._connection.address

    @property
    def _address(self) -> Optional[str]:
        """``address`` as the activation SSD tier reads it (_activation_ssd.py)."""
        return self._connection.address

    @property
    def embedded_daemon(self) -> Optional[EmbeddedDaemon]:
        return self._connection.daemon

    @property
    def num_chunks(self) -> int:
        return len(self._pipeline.plan.chunks)

    @property
    def pipeline(self) -> ChunkPipeline:
        """The chunk pipeline: chunks, slots, hooks and the session to fuyoud."""
        return self._pipeline

    @property
    def accumulation_steps(self) -> int:
        """Backward passes per step given by ``accumulation_steps=``."""
        return self._pipeline.passes.accumulation_steps

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
            bad = (self._groups_error()
                   or gradient_error(self.param_groups, self._pipeline.params,
                                     getattr(self._mode, "offload", None))
                   or self._mode.weights_error())
            if bad is not None:  # nothing is changed: fix the group and step() again
                raise bad
            try:
                if not self._mode.finish_step(self._scaler, self.max_grad_norm):
                    self.skipped_steps += 1
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
            if self._pipeline is not None:
                self._mode.zero_grad()
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
            if self._exit_token is None:
                return
            token, self._exit_token = self._exit_token, None
            _lifetime.leave(self, token)
            try:
                if self._pipeline is not None:
                    self._mode.close()
            finally:
                self._connection.release()

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
        Call it between steps. In a data-parallel group: the whole job's, on every
        rank, a collective; ``path`` is written by rank 0 (_sharded_states.py)."""
        dp = self._data_parallel
        with self._lock:
            self._check_usable()
            if self._pipeline.step.in_step:
                raise FailedPrecondition(
                    f"export_checkpoint of job {self.job!r} during a step: call it after step()")
            self._mode.quiesce()
            if dp is not None:
                checkpoint = _sharded_states.export_state(self, model)
            else:
                checkpoint = _checkpoint.export_state(self, self._pipeline, model)
        if path is not None and (dp is None or dp.rank == 0):
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
        same job loads it without reading anything. In a data-parallel group: the
        whole job's state dict on every rank, a collective (_sharded_states.py)."""
        for hook in list(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            hook(self)  # torch 2.x's register_state_dict_pre_hook
        with self._lock:
            sd = (_optimizer_state if self._data_parallel is None
                  else _sharded_states).build_state_dict(self)
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
        (``fuyou.stream_parameters``) first. In a data-parallel group: on every
        rank, each importing its chunks' share, a collective (_sharded_states.py)."""
        # torch 2.x's register_load_state_dict_pre_hook: on the whole dict, before
        # anything is read (torch's own load below runs with its hooks held back).
        for hook in list(getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise InvalidArgument("load_state_dict takes an optimizer state dict "
                                  "(param_groups, state)")
        for i, group in enumerate(state_dict["param_groups"]):
            why = unsupported_setting(group)
            if why is not None:
                raise NotImplementedError(f"fuyou.AdamW of job {self.job!r}: the state dict's "
                                          f"parameter group {i}: {why}; nothing was loaded")
        extra = state_dict.get("fuyou")
        with self._lock:
            self._check_usable()
            (_optimizer_state if self._data_parallel is None
             else _sharded_states).load_daemon_states(self, state_dict, extra)
            stateless = {"state": {}, "param_groups": state_dict["param_groups"]}
            with _torch_load_hooks_held_back(self):
                super().load_state_dict(stateless)
            for group in self.param_groups:  # a torch state dict lacks fuyou's group keys
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
            if extra is not None:
                self._scaler.load_state_dict(extra.get("loss_scaler", {}))
                self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))
        for hook in list(getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values()):
            hook(self)  # torch 2.x's register_load_state_dict_post_hook

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
        chunks = len(self._pipeline.plan.chunks) if self._pipeline is not None else 0
        head = (f"fuyou.AdamW(job={self.job!r}, {chunks} chunks, "
                f"{len(self.param_groups)} groups, committed_step={self.committed_step}, "
                f"address={self.address if hasattr(self, '_connection') else None!r})")
        groups = super().__repr__().split("\n", 1)  # "AdamW (" then torch's group lines
        return head + (" (\n" + groups[1] if len(groups) > 1 else "")

    # ------------------------------------------------------------------ internals
    @property
    def _closed(self) -> bool:
        """Closed, or not open yet (the constructor has not finished)."""
        return self._exit_token is None

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
            error = edited_group_error(i, group) or self._mode.group_error(i, group)
            if error is not None:
                return error
        return None


    def _reshard_into_one_process(self, pipeline, session, offload_params: bool) -> None:
        """A single process on a new job whose name has data-parallel ranks' jobs
        on the daemon: their states are imported into it (_reshard_one.py); on
        a job such an import left unfinished, it is finished."""
        if self._data_parallel is not None:
            return
        plan = _reshard_one.plan_one_process(self._connection, session)
        self._reshard_plan = plan
        if plan is None:
            return
        if offload_params:
            _reshard_one.refuse_streamed(self.job, plan)
        _reshard_one.reshard_into_one_process(self, pipeline, self._connection, plan)

    def _hyper(self, group_index: int) -> Hyper:
        """The group's hyper-parameters now (an LR scheduler may have changed them)."""
        return Hyper.of_group(self.param_groups[group_index])

    def _hook_grad_scale(self) -> Optional[float]:
        """grad_scale for a chunk sent during backward; None: hooks must not send."""
        if not self.overlap or self._pipeline.step.overflow or self._groups_error() is not None:
            return None  # step() raises for a bad group
        return 1.0 / self._scaler.scale
