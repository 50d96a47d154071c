"""Loss scaling for fp16 training, with torch.cuda.amp.GradScaler's schedule."""

from __future__ import annotations

from typing import Union

__all__ = ["LossScaler", "make_loss_scaler"]


class LossScaler:
    """Static (``dynamic=False``) or dynamic loss scale.

    Dynamic: starts at ``init_scale`` (2**16), multiplies by ``growth_factor`` (2)
    after ``growth_interval`` (2000) steps in a row without overflow, and by
    ``backoff_factor`` (0.5) at each overflow. A static scale never changes; an
    overflow still skips the step.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if init_scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {init_scale}")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.dynamic = dynamic and enabled
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "dynamic": self.dynamic,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        for key in ("enabled", "scale", "dynamic", "growth_factor", "backoff_factor",
                    "growth_interval", "good_steps"):
            if key in state:
                setattr(self, key, state[key])


def make_loss_scaler(loss_scale: Union[None, float, str]) -> LossScaler:
    if loss_scale is None:
        return LossScaler(enabled=False)
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f'loss_scale must be None, a number or "dynamic", got {loss_scale!r}')
        return LossScaler()
    return LossScaler(init_scale=float(loss_scale), dynamic=False)
