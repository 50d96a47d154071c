"""torch.optim.AdamW's state dict format, as both checkpoint writers (the
single-file one in _checkpoint.py and the sharded one in _sharded.py) and
``AdamW.state_dict`` number and spell it."""

from __future__ import annotations

import functools
from typing import Dict, List

import torch

__all__ = ["torch_group_defaults", "HYPER_KEYS", "torch_indices", "torch_param_groups"]


@functools.lru_cache(maxsize=None)
def torch_group_defaults() -> Dict[str, object]:
    """What the installed torch's AdamW.state_dict() puts in each param group
    besides lr, betas, eps, weight_decay and params, with its defaults (torch 2.15:
    amsgrad, maximize, foreach, capturable, differentiable, fused,
    decoupled_weight_decay), read off a torch.optim.AdamW once: fuyou's state dicts
    carry exactly the keys of the torch they run on."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {key: value for key, value in probe.param_groups[0].items()
            if key not in ("params", "lr", "betas", "eps", "weight_decay")}

# The group keys an import takes over from a checkpoint (as load_state_dict does).
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "initial_lr", "maximize")


def torch_indices(param_groups) -> Dict[int, int]:
    """id(param) -> the index torch.optim.Optimizer.state_dict() gives it."""
    mapping: Dict[int, int] = {}
    start = 0
    for group in param_groups:
        for i, p in enumerate(group["params"], start):
            mapping.setdefault(id(p), i)
        start += len(group["params"])
    return mapping


def torch_param_groups(opt, index: Dict[int, int]) -> List[dict]:
    """`opt`'s param_groups as torch.optim.AdamW.state_dict() gives them: the
    parameters as their indices (`index`: id(param) -> index), and the keys of
    the installed torch's AdamW groups."""
    groups = []
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        for key, value in torch_group_defaults().items():
            saved.setdefault(key, value)
        saved["params"] = [index[id(p)] for p in g["params"]]
        groups.append(saved)
    return groups
