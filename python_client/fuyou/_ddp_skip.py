"""``fuyou.skip_ddp_allreduce(ddp_model)``: DDP's all-reduce replaced by
fuyou's reductions (_dp_overlap.py), and the parameters it was done for.

A DDP comm hook that reduces nothing leaves each rank's own gradients in
DDP's buckets; DDP still copies them back into ``.grad`` at the end of
backward, which the data-parallel resident mode must not take for DDP's
averages (``reduces_nothing``)."""

from __future__ import annotations

import torch

__all__ = ["skip_ddp_allreduce", "reduces_nothing"]

_MARK = "_fuyou_ddp_reduces_nothing"  # an attribute of the parameter (it lives as long)


def reduces_nothing(p: torch.Tensor) -> bool:
    """Whether `p` is a parameter of a DDP model given to ``skip_ddp_allreduce``."""
    return getattr(p, _MARK, False)


def _reduce_nothing(state, bucket):
    """A DDP comm hook: the bucket as it is (this rank's gradients, undivided)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def skip_ddp_allreduce(model) -> None:
    """Makes DistributedDataParallel `model` all-reduce nothing: ``fuyou.AdamW``
    (of the same group, over all of the model's trainable parameters) averages
    each chunk over the ranks during backward instead, the owners' daemon
    updates overlapping the rest of backward (with DDP's own all-reduce they
    wait for step()); at the end of backward ``.grad`` holds the average, as
    DDP leaves it. Call it once, before the first backward. Only for a model
    that fuyou.AdamW trains: any other optimizer's ``.grad`` would stay each
    rank's own."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"skip_ddp_allreduce takes a DistributedDataParallel model, not "
                        f"{type(model).__name__}")
    model.register_comm_hook(None, _reduce_nothing)
    for p in model.parameters():
        setattr(p, _MARK, True)
