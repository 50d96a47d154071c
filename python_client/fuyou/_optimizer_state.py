"""fuyou.AdamW's ``state_dict`` and ``load_state_dict`` on the daemon's side.

``build_state_dict``: torch's optimizer state dict (``param_groups`` as torch
packs them, ``state`` read from the daemon at the last commit when the moments
fit ``state_dict_max_bytes`` and no step is in progress) plus ``"fuyou"``: the
job, committed step, loss scaler and chunk layout.

``load_daemon_states``: what a loaded state dict does to the daemon's states,
after the groups and chunk layout were checked: nothing (this job at its
committed step, or a fresh job and no moments), an import of its moments (the
optimizer's mode decides the masters), a fork of another job (_fork.py), or
nothing with a warning (this job at another step, no moments in the state dict).
Both run with the optimizer's lock held; the optimizer loads the groups'
hyper-parameters and the loss scaler itself."""

from __future__ import annotations

import warnings
from typing import Optional

from . import _checkpoint, _fork
from ._errors import FailedPrecondition, InvalidArgument
from ._torch_format import torch_indices, torch_param_groups

__all__ = ["STATE_VERSION", "build_state_dict", "load_daemon_states"]

STATE_VERSION = 2  # 2: "state" holds the moments when fuyou["state_included"]


def build_state_dict(opt) -> dict:
    """`opt`'s state dict (see the module doc); warnings are attributed to the
    caller of ``opt.state_dict()``."""
    opt._check_usable()
    pipeline = opt.pipeline
    size = _checkpoint.moment_bytes(pipeline)
    limit = opt.state_dict_max_bytes
    included = (limit is None or size <= limit) and not pipeline.step.in_step
    state: dict = {}
    if pipeline.step.in_step:  # backward sent chunks, no step() yet: the slots are busy
        warnings.warn(
            f"fuyou.AdamW.state_dict of job {opt.job!r} during a step (backward "
            "without step()): the state dict holds a reference to the job in the "
            "daemon only, without the moments (torch.optim.AdamW would start from "
            "zero moments); call it after step() or zero_grad()", stacklevel=3)
    elif included:
        opt._mode.quiesce()
        state = _checkpoint.torch_state(opt, pipeline)
    else:
        warnings.warn(
            f"fuyou.AdamW.state_dict of job {opt.job!r}: the moments take "
            f"{size / 2**30:.2f} GiB, more than state_dict_max_bytes={limit}; the "
            "state dict holds a reference to the job in the daemon only (fuyou.AdamW "
            "loads it, torch.optim.AdamW would start from zero moments). For a "
            "portable checkpoint use opt.export_checkpoint(path), or raise "
            "opt.state_dict_max_bytes (None: no limit)", stacklevel=3)
    return assemble_state_dict(opt, state, included, opt.job, pipeline.plan.chunks)


def assemble_state_dict(opt, state: dict, included: bool, job: str, chunks,
                        **more_fuyou) -> dict:
    """The state dict of `opt`: torch's ``state`` (`state`) and
    ``param_groups`` (parameters as torch's indices), and the ``"fuyou"`` entry
    naming `job`, its step, settings and `chunks`' layout, with `more_fuyou`
    beside them (a data-parallel job's world size)."""
    groups = torch_param_groups(opt, torch_indices(opt.param_groups))
    return {"state": state, "param_groups": groups, "fuyou": {
        "version": STATE_VERSION,
        "job": job,
        **more_fuyou,
        "committed_step": opt.committed_step,
        "state_included": included,
        "skipped_steps": opt.skipped_steps,
        "loss_scaler": opt._scaler.state_dict(),
        "accumulation_steps": opt.accumulation_steps,
        "max_grad_norm": opt.max_grad_norm,
        "chunk_bytes": opt.chunk_bytes,
        "state_dtype": opt.state_dtype,
        "chunks": [(c.chunk_id, c.num_elements, str(c.dtype)) for c in chunks],
    }}


def load_daemon_states(opt, state_dict: dict, extra: Optional[dict]) -> None:
    """Checks `state_dict` against `opt` and applies it to the daemon's states
    (see the module doc). `extra`: its ``"fuyou"`` entry, None for torch's."""
    _check_layout(opt, state_dict, extra)
    action = _load_action(opt, state_dict, extra)
    if action == "import":
        if opt.pipeline.step.in_step:
            raise FailedPrecondition(f"load_state_dict into job {opt.job!r} during a "
                                     "step: call it between steps")
        opt._mode.import_moments(opt, state_dict)
    elif action == "fork":
        _fork.fork_or_import(opt, state_dict, extra)
    elif action == "keep":
        warnings.warn(
            f"state_dict is from step {extra.get('committed_step')}, but job "
            f"{opt.job!r} is committed at step {opt.committed_step} in the daemon, "
            "which holds the weights and moments, and the state dict holds no "
            "moments (over state_dict_max_bytes); hyper-parameters and loss scale "
            "were loaded. Use export_checkpoint / init_from to move moments")


def _check_layout(opt, state_dict: dict, extra: Optional[dict]) -> None:
    """Groups (count, sizes) and, for a fuyou state dict, the chunk layout of
    `state_dict` match `opt`'s; InvalidArgument otherwise."""
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise InvalidArgument(
            f"load_state_dict: the state dict has {len(saved)} parameter groups, the "
            f"optimizer of job {opt.job!r} {len(opt.param_groups)}")
    for i, (sg, g) in enumerate(zip(saved, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise InvalidArgument(
                f"load_state_dict: group {i} of the state dict has {len(sg['params'])} "
                f"parameters, the optimizer's {len(g['params'])}")
    if extra is None:
        return
    chunks = [tuple(c) for c in extra.get("chunks", [])]
    mine = [(c.chunk_id, c.num_elements, str(c.dtype)) for c in opt.pipeline.plan.chunks]
    if chunks and chunks != mine:
        raise InvalidArgument(
            f"state_dict was saved with a different chunk layout ({len(chunks)} chunks, "
            f"chunk_bytes={extra.get('chunk_bytes')}) than this optimizer's ({len(mine)} "
            f"chunks, chunk_bytes={opt.chunk_bytes}); build the optimizer with the same "
            "model, parameter groups and chunk_bytes")


def _load_action(opt, state_dict: dict, extra: Optional[dict]) -> str:
    """"none" (this job at its committed step, or nothing to import into a new
    job), "import" (the state dict's moments), "fork" (another fuyou job),
    "keep" (this job at another step, no moments in the state dict)."""
    moments = extra is None or bool(extra.get("state_included"))
    if extra is not None and extra.get("job") == opt.job:
        if extra.get("committed_step") == opt.committed_step:
            return "none"
        action = "import" if moments else "keep"
    elif extra is not None:
        return "fork"  # the mode's refusal is check_fork's
    else:
        fresh = not _fork.has_trained(opt)
        action = "none" if fresh and not state_dict.get("state") else "import"
    if action == "import":
        opt._mode.check_import(opt.job)
    return action
