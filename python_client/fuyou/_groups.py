"""What fuyou.AdamW accepts: its constructor's arguments, its parameter groups
when it is made, and the groups as the loop edits them between steps (an LR
scheduler, a hand-set ``lr``; torch.optim.AdamW would take or ignore what
fuyou refuses). Each check raises (or returns) an error naming what to change."""

from __future__ import annotations

from typing import List, Optional

import torch

from ._backward_hooks import SPARSE_GRADIENT
from ._errors import FailedPrecondition, InvalidArgument
from ._materialize import is_empty, job_of
from ._protocol import MAX_SLOTS

__all__ = ["check_arguments", "check_groups", "edited_group_error"]


# torch takes eps=0 (and gives nan where a gradient and its moments are 0).
EPS_ZERO = ("fuyou.AdamW: eps=0 is not supported: fuyoud's kernel divides by "
            "sqrt(exp_avg_sq) + eps, so a parameter whose gradients were all zero would become "
            "nan; pass a tiny eps (for example 1e-16) instead")


def check_arguments(*, lr, betas, eps, weight_decay, job, num_slots, accumulation_steps,
                    max_grad_norm, timeout, state_dict_max_bytes) -> None:
    """The constructor's ranges (torch's messages for torch's arguments)."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if eps == 0.0:
        raise ValueError(EPS_ZERO)
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


# state_dtype= spellings -> the DType code of the moments on the wire (ChunkSpec.moments_dtype).
# "8bit" (DTYPE_BLOCK8): 8-bit codes with a scale per block of 256, as bitsandbytes'
# and torchao's 8-bit optimizers name theirs; "int8", the name the issue asked for,
# is the same (the codes are small floats, not integers).
STATE_DTYPES = {"fp32": 1, "float32": 1, torch.float32: 1, "bf16": 2, "bfloat16": 2, torch.bfloat16: 2,
                "8bit": 4, "int8": 4}
# The DType code -> the name AdamW.state_dtype reports.
STATE_DTYPE_NAMES = {1: "fp32", 2: "bf16", 4: "8bit"}


def moments_dtype_code(state_dtype) -> int:
    """The wire code of `state_dtype` (``"fp32"``, ``"bf16"`` or ``"8bit"``, or
    the torch dtype); ValueError for anything else."""
    try:
        return STATE_DTYPES[state_dtype]
    except (KeyError, TypeError):
        raise ValueError(f'state_dtype must be "fp32", "bf16" or "8bit", got {state_dtype!r}') from None


def check_groups(param_groups, job: Optional[str], offload_params: bool) -> str:
    """The groups torch built from the constructor's arguments: no parameter
    without values unless streamed, no amsgrad. Returns the job: `job`, or the
    one fuyou.init_empty(job=) recorded on the parameters."""
    if job is None:
        job = job_of(param_groups)
        if job is None:
            raise ValueError("job must be a non-empty string (or the parameters built in "
                             "fuyou.init_empty(job=...), which records it)")
    if not offload_params and any(is_empty(p) for g in param_groups for p in g["params"]):
        raise InvalidArgument(
            f"fuyou.AdamW of job {job!r}: parameters built in fuyou.init_empty (or on meta) "
            "hold no values; fuyou.materialize(model) them first, or open the optimizer with "
            "offload_params=True and call fuyou.materialize(model, optimizer)")
    for i, group in enumerate(param_groups):
        why = unsupported_setting(group)
        if why is not None:
            raise NotImplementedError(f"fuyou.AdamW, parameter group {i}: {why}")
    return job


def unsupported_setting(group: dict) -> Optional[str]:
    """Why the daemon cannot run torch's update for `group` (a constructor's, an
    edited or a loaded one), or None. Only settings that change the result are
    here; foreach, fused and capturable choose torch's implementation of the same
    update and are ignored."""
    if group.get("amsgrad"):
        return ("amsgrad=True is not implemented: the daemon keeps three states per "
                "chunk (master weights, exp_avg, exp_avg_sq), not AMSGrad's running maximum "
                "of exp_avg_sq; use amsgrad=False or torch.optim.AdamW")
    if group.get("differentiable"):
        return ("differentiable=True is not implemented: the update runs in the daemon, "
                "outside autograd, so no gradient can flow through it; use "
                "torch.optim.AdamW for a differentiable step")
    if group.get("decoupled_weight_decay") is False and float(group.get("weight_decay", 0)):
        return ("decoupled_weight_decay=False (torch.optim.Adam's L2 penalty in the "
                "gradient) is not AdamW's update; fuyou.AdamW decays the weights "
                "(decoupled_weight_decay=True), or set weight_decay=0")
    return None


def edited_group_error(i: int, group: dict) -> Optional[Exception]:
    """What is wrong with parameter group `i` as the loop left it (amsgrad set,
    a hyper-parameter out of the constructor's ranges): an exception for step()
    to raise, or None."""
    why = unsupported_setting(group)
    if why is not None:
        return NotImplementedError(f"fuyou.AdamW: parameter group {i} (as set after "
                                   f"construction): {why}")
    try:
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
    except (KeyError, TypeError, ValueError) as e:
        return ValueError(f"fuyou.AdamW: parameter group {i} lacks a usable lr, betas, "
                          f"eps or weight_decay ({e!r})")
    if eps == 0.0:
        return ValueError(f"parameter group {i} (as set after construction): {EPS_ZERO}")
    if not (lr >= 0.0 and eps >= 0.0 and wd >= 0.0 and 0.0 <= beta1 < 1.0
            and 0.0 <= beta2 < 1.0):
        return ValueError(
            f"fuyou.AdamW: parameter group {i} was set to lr={lr}, betas=({beta1}, "
            f"{beta2}), eps={eps}, weight_decay={wd}; the constructor's ranges hold "
            "mid-run too (lr, eps, weight_decay >= 0, 0 <= beta < 1)")
    return None


def check_track_frozen(track_frozen: bool, offload_params: bool, data_parallel) -> None:
    """track_frozen registers frozen parameters in one process: the resident mode
    (they train once unfrozen) and the streamed one (their weights stream from
    fuyoud read-only: a LoRA's frozen base)."""
    if track_frozen and data_parallel is not None:
        raise NotImplementedError(
            "fuyou.AdamW(track_frozen=True) is for one process: with data parallel, build "
            "the optimizer with every parameter that will train requiring grad (freeze them "
            "after construction)")


def gradient_error(param_groups: List[dict], registered_params,
                   offload=None) -> Optional[Exception]:
    """At step(): a sparse gradient, or a parameter with a gradient that has no
    chunk (frozen when the optimizer was built, not tracked) or whose chunk is
    streamed read-only (frozen, track_frozen with `offload`, the streamed
    mode's OffloadedParams): torch would update it; fuyou cannot. An exception
    for step(), or None."""
    registered = {id(p) for p in registered_params}
    streamed_frozen = {id(p) for p in getattr(offload, "read_only", ())}
    for i, group in enumerate(param_groups):
        for k, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:  # overlap off: no hook saw it
                return TypeError(SPARSE_GRADIENT)
            if id(p) in streamed_frozen:
                return FailedPrecondition(
                    f"fuyou.AdamW: parameter {k} of group {i} has a gradient but "
                    "was frozen when the optimizer was built, and track_frozen=True streams "
                    "such parameters read-only (no master or moments are kept up to date for "
                    "them, nothing is written back): build the optimizer with it requiring "
                    "grad and freeze it after construction to train it later")
            if id(p) not in registered and offload is not None:
                return FailedPrecondition(
                    f"fuyou.AdamW(offload_params=True): parameter {k} of group {i} has a "
                    "gradient but was frozen (requires_grad=False) when the optimizer was "
                    "built, so it has no chunk (track_frozen=True would stream it read-only, "
                    "not train it): build the optimizer with it requiring grad and freeze it "
                    "after construction (a parameter whose .grad is None is left alone, as "
                    "torch does), then unfreeze it when it should train")
            if id(p) not in registered:
                shape = "x".join(str(d) for d in p.shape) or "scalar"
                return FailedPrecondition(
                    f"fuyou.AdamW: parameter {k} of group {i} ({shape}) has a gradient but "
                    "was frozen (requires_grad=False) when the optimizer was built, so it "
                    "has no chunk: pass track_frozen=True (the resident mode registers the "
                    "frozen parameters too: 12 bytes a parameter on the SSD), or build the "
                    "optimizer with it requiring grad and freeze it after construction (a "
                    "parameter whose .grad is None is left alone, as torch does)")
    return None
