"""The ranks of a data-parallel ``fuyou.AdamW`` are built alike (issue 31,
item 4): the same job name, the same parameter list (shapes, dtypes, which
train) in the same groups, the same hyper-parameters and chunk settings.

Each rank's chunks are planned from its own optimizer and the ranks own
disjoint runs of them; ranks that differ would each update chunks the others
do not have, or name other jobs, and train without a word. ``check_alike``
compares every rank's description with rank 0's in one ``all_gather_object``
at construction (a collective every rank makes, before anything is
registered) and raises on every rank, naming the ranks and what differs."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ._errors import InvalidArgument

__all__ = ["describe", "check_alike"]

_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize", "amsgrad")


def describe(job: str, param_groups: List[dict], **settings) -> dict:
    """What must be the same on every rank (plain values, picklable)."""
    groups = []
    for g in param_groups:
        params = [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in g["params"]]
        hyper = {k: _plain(g[k]) for k in _HYPER if k in g}
        groups.append({"params": params, "hyper": hyper})
    return {"job": job, "groups": groups, **{k: _plain(v) for k, v in settings.items()}}


def check_alike(dp, mine: dict) -> None:
    """Raises InvalidArgument on every rank unless every rank's description is
    rank 0's."""
    every: list = [None] * dp.world_size
    dist.all_gather_object(every, mine, group=dp.group)
    problems = [f"rank {r}: {_difference(every[0], d)}" for r, d in enumerate(every)
                if d != every[0]]
    if problems:
        raise InvalidArgument(
            f"fuyou.AdamW of job {every[0]['job']!r} (rank {dp.rank} of {dp.world_size}): the "
            "ranks built their optimizers differently from rank 0 (" + "; ".join(problems) +
            "); every rank must pass the same job, the same parameters in the same groups and "
            "the same settings")


def _difference(first: dict, other: dict) -> str:
    """The first thing `other` has otherwise than `first`, in words."""
    if other["job"] != first["job"]:
        return f"job {other['job']!r} instead of {first['job']!r}"
    if len(other["groups"]) != len(first["groups"]):
        return f"{len(other['groups'])} parameter groups instead of {len(first['groups'])}"
    for i, (a, b) in enumerate(zip(first["groups"], other["groups"])):
        if len(a["params"]) != len(b["params"]):
            return f"group {i} has {len(b['params'])} parameters instead of {len(a['params'])}"
        for k, (pa, pb) in enumerate(zip(a["params"], b["params"])):
            if pa != pb:
                return (f"parameter {k} of group {i} is (shape, dtype, requires_grad) {pb} "
                        f"instead of {pa}")
        for key in a["hyper"]:
            if a["hyper"][key] != b["hyper"].get(key):
                return f"group {i} has {key}={b['hyper'].get(key)} instead of {a['hyper'][key]}"
    for key in first:
        if key not in ("job", "groups") and first[key] != other.get(key):
            return f"{key}={other.get(key)!r} instead of {first[key]!r}"
    return "a difference"


def _plain(value):
    """A hyper-parameter as a plain value (torch 2's tensor lr as its float)."""
    if isinstance(value, torch.Tensor):
        return float(value.item())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value
