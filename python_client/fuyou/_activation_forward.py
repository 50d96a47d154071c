"""The model's forward as activation offload sees it (issue 23): the
forward methods it replaces on the model and its layers (and puts back),
where in the forward it is, whether its saved-tensor hooks are the ones a
save reaches, and the inputs a recomputed layer holds."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

__all__ = ["ForwardPatches", "ForwardPosition", "HookProbe", "hold_inputs", "find_layers",
           "name_in", "model_device"]


class ForwardPatches:
    """The forward methods replaced on modules, each with what it replaced
    (an instance attribute, or none: the class's)."""

    def __init__(self):
        self._saved: list = []
        self.removed = False

    def replace(self, module: torch.nn.Module, make: Callable) -> None:
        """`module.forward` becomes make(its forward now)."""
        original = module.forward
        self._saved.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
        module.forward = make(original)

    def restore(self) -> bool:
        """Puts every forward back, last replaced first; False when done already."""
        if self.removed:
            return False
        self.removed = True
        for module, had, previous in reversed(self._saved):
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._saved = []
        return True


class ForwardPosition:
    """Where the wrapped forward is: inside the model's (``in_forward``),
    the stack of layers running, and how many forwards have run (``steps``)."""

    def __init__(self):
        self.in_forward = False
        self.stack: List[int] = []
        self.steps = 0

    @property
    def layer(self) -> Optional[int]:
        """The innermost layer running (None: outside the layers)."""
        return self.stack[-1] if self.stack else None

    def forward_ended(self) -> None:
        self.in_forward = False
        self.stack = []


class HookProbe:
    """Whether a tensor saved now reaches a given pack hook (not, for one,
    inside a user's torch.utils.checkpoint, which recomputes the layer
    already: checkpointing it again would nest recomputations). The probe
    saves two tensors; a recomputation makes the same probe."""

    def __init__(self):
        self._probe: Optional[torch.Tensor] = None
        self._hit = False

    def on_top(self) -> bool:
        probe = torch.zeros(1, requires_grad=True)
        self._probe, self._hit = probe, False
        try:
            probe * probe
        finally:
            self._probe = None
        return self._hit

    def catch(self, t: torch.Tensor) -> bool:
        """Called by the pack hook first: whether `t` is the probe (noted)."""
        if t is self._probe:
            self._hit = True
            return True
        return False


class _HoldInputs(torch.autograd.Function):
    """Identity that saves its inputs for backward, so the pack hook accounts
    a recomputed layer's inputs (what the checkpoint holds) for as long as
    the layer's graph lives."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def hold_inputs(args):
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not idx:
        return args
    held = _HoldInputs.apply(*(args[i] for i in idx))
    out = list(args)
    for i, h in zip(idx, held):
        out[i] = h
    return tuple(out)


def find_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The repeated blocks: the children of the model's largest nn.ModuleList
    (Hugging Face's ``layers``, ``h``, ``blocks``), or the longest run of
    consecutive children of one type in an nn.Sequential
    (``Sequential(Embedding, Block, ..., Block, Linear)``), whichever holds
    more; a run of one is no blocks."""
    best: List[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            found = list(m)
        elif isinstance(m, torch.nn.Sequential):
            found = _longest_run_of_one_type(list(m))
        else:
            continue
        if len(found) > len(best):
            best = found
    return best


def _longest_run_of_one_type(children: List[torch.nn.Module]) -> List[torch.nn.Module]:
    best: List[torch.nn.Module] = []
    start = 0
    for end in range(1, len(children) + 1):
        if end == len(children) or type(children[end]) is not type(children[start]):
            if end - start >= 2 and end - start > len(best):
                best = children[start:end]
            start = end
    return best


def name_in(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name or type(m).__name__
    return type(module).__name__


def model_device(model) -> torch.device:
    for p in model.parameters():
        if p.numel():
            return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")
