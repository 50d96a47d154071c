"""torch.optim.AdamW's state dict format, as both checkpoint writers (the
single-file one in _checkpoint.py and the sharded one in _sharded.py) and
``AdamW.state_dict`` number and spell it."""

from __future__ import annotations

from typing import Dict, List

__all__ = ["TORCH_GROUP_DEFAULTS", "HYPER_KEYS", "torch_indices", "torch_param_groups"]

# What torch 1.13's AdamW.state_dict() puts in each param group besides
# lr, betas, eps, weight_decay and params; fuyou implements exactly these values.
TORCH_GROUP_DEFAULTS = {"amsgrad": False, "foreach": None, "maximize": False,
                        "capturable": False}
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
    torch 1.13's AdamW groups."""
    groups = []
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        for key, value in TORCH_GROUP_DEFAULTS.items():
            saved.setdefault(key, value)
        for key in ("fused", "differentiable"):  # not in torch 1.13's AdamW groups
            if saved.get(key) in (None, False):
                saved.pop(key, None)
        saved["params"] = [index[id(p)] for p in g["params"]]
        groups.append(saved)
    return groups
