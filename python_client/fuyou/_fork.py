"""Forking a job: ``load_state_dict`` of a state dict that another job's
fuyou.AdamW took makes this optimizer's job (one with nothing trained) a copy
of that job at its last commit.

- No session of this process has the other job open: the daemon copies it
  (admin CopyJob, as ``fuyouctl copy-job``) over this job, which is deleted
  and reopened (``fork_in_daemon``).
- An optimizer of this process has it open (its session holds the job, so the
  daemon cannot fork it): its committed states are read through its session
  and imported into this job, one chunk at a time (``copy_from``).
- The daemon has no such job, or keeps its moments in another dtype than this
  optimizer's state_dtype (a daemon copy keeps the dtype), but the state dict
  holds the moments: they are imported (``fork_or_import``; the daemon rounds
  fp32 moments into a bf16 job).

Called with the optimizer's lock held, between steps."""

from __future__ import annotations

import warnings

import torch

from ._admin import admin_client
from ._chunk_weights import install
from ._errors import FailedPrecondition, FuyouError, InvalidArgument
from ._lifetime import find_open
from ._protocol import STATE_EXP_AVG, STATE_EXP_AVG_SQ, STATE_MASTER

__all__ = ["fork_or_import", "fork_from"]


def has_trained(opt) -> bool:
    """Whether `opt`'s job holds trained states (resumed, committed, or any
    segment updated)."""
    pipeline = opt.pipeline
    return opt.resumed or opt.committed_step != 0 or any(
        any(pipeline.states.update_counts(c)) for c in pipeline.plan.chunks)


def fork_or_import(opt, state_dict: dict, extra: dict) -> None:
    """Another job's state dict: fork that job (see ``fork_from``); when the
    daemon has no such job and the state dict holds the moments, import them."""
    source = extra.get("job")
    moments = bool(extra.get("state_included"))
    source_dtype = extra.get("state_dtype", "fp32")
    if source_dtype != opt.state_dtype and not has_trained(opt) and find_open(source, opt.address) is None:
        if not moments:
            raise FailedPrecondition(
                f"load_state_dict: job {source!r} keeps its moments as {source_dtype}, this optimizer's "
                f"job {opt.job!r} as {opt.state_dtype} (state_dtype), and the state dict holds no "
                "moments (over state_dict_max_bytes), so the daemon cannot fork it; use "
                f"state_dtype={source_dtype!r}, or export_checkpoint and init_from")
        if opt.pipeline.step.in_step:
            raise FailedPrecondition(f"load_state_dict into job {opt.job!r} during a step: "
                                     "call it between steps")
        opt._mode.import_moments(opt, state_dict)
        return
    try:
        fork_from(opt, source)
    except FuyouError as e:
        missing = getattr(e, "code", None) == "NOT_FOUND" or "does not exist" in str(e)
        if not (moments and missing and not opt.pipeline.step.in_step):
            raise
        opt._mode.import_moments(opt, state_dict)


def fork_from(opt, source: str) -> None:
    """Makes `opt`'s job a copy of job `source` at its last commit. Only a job
    with nothing trained is replaced; one with trained states keeps them (a
    warning says so)."""
    if has_trained(opt):
        warnings.warn(
            f"state_dict is from job {source!r}, this optimizer trains {opt.job!r}, which "
            f"already has trained states (committed step {opt.committed_step}): its weights "
            f"and moments stay those of {opt.job!r}. Load the state_dict into an optimizer "
            f"on a new job to fork {source!r}")
        return
    if opt.pipeline.step.in_step:
        raise FailedPrecondition(f"load_state_dict into job {opt.job!r} during a step: "
                                 "call it between steps")
    opt._mode.check_fork(source, opt.job)
    other = find_open(source, opt.address)
    if other is not None:
        copy_from(opt, other)
    else:
        fork_in_daemon(opt, source)


def copy_from(opt, other) -> None:
    """`other` (an open optimizer of this process on the same daemon) holds the
    source job's session: its committed states are read through it and
    imported into `opt`'s job (through the sessions' shared memory)."""
    with other._lock:
        other._check_usable()
        if other.pipeline.step.in_step:
            raise FailedPrecondition(
                f"load_state_dict from job {other.job!r}, whose optimizer is in a step: "
                "take the state_dict between steps")
        theirs = {c.chunk_id: c for c in other.pipeline.plan.chunks}
        imports = []
        for c in opt.pipeline.plan.chunks:
            src = theirs.get(c.chunk_id)
            if src is None or src.num_elements != c.num_elements:
                raise InvalidArgument(
                    f"load_state_dict: job {other.job!r} has no chunk {c.chunk_id:#x} of "
                    f"{c.num_elements} elements; build the optimizer over the same model, "
                    "parameter groups and chunk_bytes")
            states, _t = other.pipeline.states.read(src)
            imports.append((c, states, other.pipeline.states.update_counts(src)))
    states = opt.pipeline.states
    for c, (master, m, v), counts in imports:
        states.write(c, STATE_MASTER, master)
        states.write(c, STATE_EXP_AVG, m)
        states.write(c, STATE_EXP_AVG_SQ, v)
        if any(counts):
            states.set_update_count(c, counts)
    states.commit_import()
    with torch.no_grad():
        for c, (master, _m, _v), _counts in imports:
            install(c, master.to(c.dtype))


def fork_in_daemon(opt, source: str) -> None:
    """The daemon copies job `source` (admin CopyJob) over `opt`'s job, which
    has nothing trained: the session is closed, the job deleted and copied
    again from `source`, and a new session resumes it."""
    admin = admin_client(opt.address, opt.timeout)
    mode = opt._mode
    mode.close()
    copy_error = None
    try:
        try:
            admin.delete_job(opt.job)
        except Exception as e:  # an empty job may already be gone with its session
            if "does not exist" not in str(e):
                raise
        try:
            admin.copy_job(source, opt.job)
        except Exception as e:
            copy_error = e
    finally:
        opt.resumed = mode.reopen(opt._connection.open())
    if copy_error is not None:
        raise copy_error
