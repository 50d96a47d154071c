"""OptimizerSettings: the knobs fuyou.AdamW was built with, beside torch's
parameter groups, in one record; ``Setting`` shows each as an attribute of the
optimizer (``opt.chunk_bytes``, ``opt.max_grad_norm``, ...), readable and
settable as before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["OptimizerSettings", "Setting"]


@dataclass
class OptimizerSettings:
    """What the constructor took that is not a group's hyper-parameter."""

    chunk_bytes: int  # most bytes of weights per chunk
    overlap: bool  # hooks send chunks during backward
    max_grad_norm: Optional[float]  # clip by the global norm at step(); None: no clipping
    timeout: float  # seconds any wait on the daemon may take
    state_dtype: str  # "fp32", "bf16" or "8bit": the dtype the daemon keeps exp_avg and exp_avg_sq in
    state_dict_max_bytes: Optional[int]  # most bytes of moments state_dict() holds


class Setting:
    """An attribute of the owner kept in its ``_settings`` record under the same name."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return getattr(obj._settings, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj._settings, self.name, value)
