"""fuyou.offload_activations: saved activations swapped out to host memory
during forward and back for backward, or recomputed, by a per-layer plan
(issue 23; see _activation_plan.py for the cost model and the search,
_activation_store.py for the tiers, _activation_copies.py for the copies,
_activation_forward.py and _activation_weights.py for what the hooks see).

One step, seen from here::

    model.forward (wrapped)   saved-tensor hooks pushed (on top of any that
                              fuyou.stream_parameters pushed in its pre-hook)
      layer i forward         (wrapped) the current layer is i; a ``recompute``
                              layer runs under torch.utils.checkpoint
                              (use_reentrant=False); its inputs are held
      pack(t)                 a weight or buffer (or a view of one): never
                              offloaded (handed to the parameter stream when
                              there is one, else kept as it is); an activation
                              of a ``host`` layer of at least ``min_bytes``:
                              copied out (ActivationStore.offload); any other:
                              kept and accounted
    backward
      unpack(saved)           its tensor (waiting for, or starting, its copy
                              back), and prefetch of the ones packed before it

The first step after install is profiled when no plan is given: every layer
kept, its times and bytes measured (_activation_profile.py), then the planner
picks the plan for the steps after it, printed as a table (``verbose``) and
kept as ``handle.plan``.

The SSD tier (``ssd=``: a daemon address or a fuyou.AdamW, for a session of
its own at that daemon, or a session; _activation_ssd.py): an ``ssd``
layer's activations are copied to host memory as for ``host``, then spilled
to the daemon's storage tier (scratch files striped over its storage paths,
never committed, dropped at the step's end, the session's end, or as soon as
none is alive) and recalled one layer ahead in backward. Without ``ssd=`` the
automatic planner plans without it (where host memory is short it picks
recomputation instead), and ``apply`` of a plan that chooses ``ssd`` for
some layer raises FailedPrecondition naming them. Budgets
are never exceeded silently: a step whose measured device peak exceeds the
budget logs a warning.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import List, Optional, Sequence, Union

import torch
import torch.utils.checkpoint

from ._activation_forward import (ForwardPatches, ForwardPosition, HookProbe, find_layers,
                                  hold_inputs, model_device, name_in)
from ._activation_plan import CHOICES, HOST, KEEP, RECOMPUTE, SSD, Plan, plan_activations
from ._activation_profile import StepProfiling
from ._activation_store import ActivationStore, SavedActivation, footprint_bytes
from ._activation_weights import SavedWeights
from ._errors import FailedPrecondition, InvalidArgument
from ._sizes import parse_size

__all__ = ["offload_activations", "ActivationOffload", "ssd_tier_available"]

log = logging.getLogger("fuyou")


def ssd_tier_available() -> bool:
    """Whether this client can spill activations to a daemon's storage tier
    (the binding has SpillActivation); a handle uses it only with ``ssd=``."""
    try:
        from . import _native
        return hasattr(_native.module().Session, "spill_activation")
    except Exception:
        return False


def _default_host_budget() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def offload_activations(model: torch.nn.Module, device_budget: Union[int, str, None] = None,
                        host_budget: Union[int, str, None] = None,
                        min_bytes: Union[int, str] = "64KiB", *,
                        plan: Union[None, str, Sequence[str], Plan] = None,
                        layers: Optional[Sequence[torch.nn.Module]] = None,
                        ssd_bandwidth: Optional[float] = None, parameter_stream=None,
                        prefetch_layers: int = 1, verbose: bool = True,
                        ssd=None) -> "ActivationOffload":
    """Installs activation offload on `model` and returns its handle (also a
    context manager; ``remove()`` uninstalls).

    ``device_budget``: the most bytes of saved activations the plan may keep
    on the device (None: unbounded, so the planner keeps everything unless
    told otherwise); ``host_budget``: the most bytes of host copies (None:
    half the host's RAM). Both take bytes or sizes such as ``"64MiB"``.
    ``min_bytes``: smaller saved tensors are always kept. ``plan``: None (the
    first step is profiled and planned), one of ``"keep"``, ``"host"``,
    ``"recompute"`` for every layer, a list of choices (one per layer) or a
    :class:`Plan`. ``layers``: the modules the plan is made of (default: the
    children of the model's largest nn.ModuleList, or the longest run of
    blocks of one type in an nn.Sequential). ``ssd_bandwidth``
    (bytes/s): used for planning only where an SSD tier exists (see the module
    docstring). ``parameter_stream``: the handle of ``fuyou.stream_parameters``
    on this model (found by itself when not given), whose saved weights stay
    its own. ``prefetch_layers``: backward brings a layer's offloaded tensors
    back while this many later layers still run their backward (the cost
    model assumes 1). ``ssd``: where the SSD tier's activations go: a daemon
    address or a fuyou.AdamW (a session of the handle's own at that daemon,
    on a job of its own, closed and the job deleted by ``remove()``), or a
    fuyou._fuyou.Session used as it is (it must leave the tier a slot); None:
    no SSD tier.
    """
    if getattr(model, "_fuyou_activation_offload", None) is not None:
        raise InvalidArgument("offload_activations is already installed on this model: "
                              "call remove() on its handle first")
    return ActivationOffload(model, device_budget, host_budget, min_bytes, plan, layers,
                             ssd_bandwidth, parameter_stream, prefetch_layers, verbose, ssd)


class ActivationBudgets:
    """A handle's budgets: ``device`` (bytes of saved activations on the
    device; None: unbounded), ``host`` (bytes of host copies), ``min_bytes``
    (smaller saved tensors are kept). A step whose saved activations exceed
    the device budget is logged, once."""

    def __init__(self, device, host, min_bytes):
        self.device = None if device is None else parse_size(device, "device_budget")
        self.host = _default_host_budget() if host is None else parse_size(host, "host_budget")
        self.min_bytes = parse_size(min_bytes, "min_bytes")
        self._warned = False

    def check_device(self, device_bytes: int) -> None:
        if self.device is not None and not self._warned and device_bytes > self.device:
            self._warned = True
            log.warning("fuyou: saved activations on the device (%d bytes) exceed "
                        "device_budget %d: the plan was made for smaller inputs; call "
                        "handle.profile() to plan again", device_bytes, self.device)


class ChosenPlan:
    """The per-layer choices in use (``choices``, all ``keep`` at first) for
    the layers ``names``, and the :class:`Plan` they came from (``plan``:
    None for choices given as such). ``ssd_tier``: whether there is an SSD
    tier to choose."""

    def __init__(self, names: List[str], ssd_tier: bool):
        self.names = names
        self.ssd_tier = ssd_tier
        self.plan: Optional[Plan] = None
        self.choices: List[str] = [KEEP] * len(names)

    @property
    def allowed(self) -> tuple:
        """The choices a planner may make."""
        return CHOICES if self.ssd_tier else (KEEP, HOST, RECOMPUTE)

    def of(self, layer: Optional[int]) -> str:
        """The choice for `layer` (outside the layers: keep)."""
        return KEEP if layer is None else self.choices[layer]

    def use(self, plan: Union[str, Sequence[str], Plan]) -> None:
        if isinstance(plan, Plan):
            choices = list(plan.choices)
        elif isinstance(plan, str):
            choices = [plan] * len(self.names)
        else:
            choices = list(plan)
        bad = [c for c in choices if c not in CHOICES]
        if bad or len(choices) != len(self.names):
            raise InvalidArgument(f"a plan is one of {CHOICES} per layer ({len(self.names)} "
                                  f"layers), got {choices!r}")
        ssd = [n for n, c in zip(self.names, choices) if c == SSD]
        if ssd and not self.ssd_tier:
            raise FailedPrecondition(
                f"the activation plan puts layers {ssd} on the SSD tier, which needs a daemon "
                "session: pass ssd= (a fuyou.AdamW, a session or the daemon's address) to "
                "offload_activations, plan with a larger host_budget, or let the planner choose "
                "(it recomputes where host memory is short)")
        self.choices = choices
        self.plan = plan if isinstance(plan, Plan) else None


class ActivationOffload:
    """The handle of :func:`offload_activations`.

    ``plan``: the :class:`Plan` in use (None before profiling, or for a plan
    given as choices); ``choices``: the per-layer choices in use (both of
    ``chosen``, a :class:`ChosenPlan`); ``store``: the
    :class:`ActivationStore` (``device_bytes``, ``peak_device_bytes``,
    ``host_bytes``, ``peak_host_bytes``; ``traffic.bytes_moved_out`` /
    ``bytes_moved_back``, ``traffic.prefetches``); ``weights_seen``: saved
    tensors recognised as weights or buffers (never offloaded; ``weights``,
    :class:`SavedWeights`); ``last_profile``: the profile of the last
    profiled step (``profiling``). :meth:`profile` re-profiles at the next
    step. Its other parts: ``budgets``, ``position`` (where the forward is),
    ``probe``, ``patches`` (the forward methods replaced)."""

    def __init__(self, model, device_budget, host_budget, min_bytes, plan, layers,
                 ssd_bandwidth, parameter_stream, prefetch_layers, verbose, ssd=None):
        self.model = model
        layers = list(layers) if layers is not None else find_layers(model)
        if not layers:
            raise InvalidArgument("offload_activations found no layers: the model has no "
                                  "nn.ModuleList and no nn.Sequential with two blocks of one "
                                  "type in a row; name them with layers=[...]")
        names = [name_in(model, m) for m in layers]
        self.budgets = ActivationBudgets(device_budget, host_budget, min_bytes)
        self.verbose = verbose
        self.weights = SavedWeights(model, parameter_stream)
        device = model_device(model)
        if not isinstance(prefetch_layers, int) or prefetch_layers < 0:
            raise ValueError(f"prefetch_layers must be an int >= 0, got {prefetch_layers!r}")
        tier = None
        if ssd is not None:
            from ._activation_ssd import open_ssd_tier
            tier = open_ssd_tier(ssd)
        self.store = ActivationStore(device, self.budgets.device, prefetch_layers, ssd=tier)
        self.chosen = ChosenPlan(names, ssd_tier=tier is not None)
        self.profiling = StepProfiling(names, device, ssd_bandwidth if tier is not None else None,
                                       requested=plan is None)
        self.position = ForwardPosition()
        self.probe = HookProbe()
        self.patches = ForwardPatches()
        if plan is not None:
            self.apply(plan)
        self._install(layers)
        model._fuyou_activation_offload = self

    @property
    def plan(self) -> Optional[Plan]:
        return self.chosen.plan

    @property
    def choices(self) -> List[str]:
        return self.chosen.choices

    @property
    def last_profile(self):
        return self.profiling.last_profile

    @property
    def weights_seen(self) -> int:
        return self.weights.seen

    # ------------------------------------------------------------ install
    def _install(self, layers) -> None:
        ref = weakref.ref(self)
        self.patches.replace(self.model, lambda original: _root_forward(ref, original))
        for index, module in enumerate(layers):
            self.patches.replace(module, lambda original, index=index:
                                 _layer_forward(ref, index, original))

    def remove(self) -> None:
        """Restores the model as it was: its and its layers' forward methods,
        no hooks left (idempotent). Saved activations of a forward whose
        backward has not run stay valid."""
        if not self.patches.restore():
            return
        if getattr(self.model, "_fuyou_activation_offload", None) is self:
            del self.model._fuyou_activation_offload
        if self.store.ssd is not None:
            self.store.ssd.close()

    def __enter__(self) -> "ActivationOffload":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------ plans
    def apply(self, plan: Union[str, Sequence[str], Plan]) -> None:
        """Uses `plan` from the next forward on (see offload_activations)."""
        self.chosen.use(plan)
        self.profiling.requested = False

    def profile(self) -> None:
        """Profiles the next step (every layer kept) and plans from it."""
        self.profiling.requested = True

    def plan_from(self, profile) -> Plan:
        """The plan for `profile` within this handle's budgets."""
        budget = self.budgets.device if self.budgets.device is not None else 1 << 62
        return plan_activations(profile, budget, self.budgets.host, allowed=self.chosen.allowed)

    def _end_of_backward(self) -> None:
        if self.profiling.pending is not None:
            self._finish_profile()

    def _finish_profile(self) -> None:
        profile = self.profiling.take_profile()
        plan = self.plan_from(profile)  # ValueError (out of backward) when nothing fits
        self.apply(plan)
        if self.verbose:
            print(f"fuyou activation plan for {type(self.model).__name__}:\n{plan.table()}")

    # ------------------------------------------------------------ forward
    def _root_forward(self, original, args, kwargs):
        position = self.position
        if position.in_forward or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        position.in_forward = True
        self.weights.new_forward()
        self.store.new_forward()
        self.store.reset_peaks()
        if self.profiling.pending is not None:  # profiled, and no backward through a layer
            self._finish_profile()
        recorder = self.profiling.start_forward(self._end_of_backward)
        t0 = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = original(*args, **kwargs)
        finally:
            position.forward_ended()
            self.store.finish_forward()
        position.steps += 1
        self.profiling.forward_ended(recorder, time.perf_counter() - t0)
        return out

    def _layer_forward(self, index, original, args, kwargs):
        position = self.position
        recompute = self.chosen.choices[index] == RECOMPUTE
        if not position.in_forward:  # a recomputation in backward, or a bare call
            if recompute and torch.is_grad_enabled():
                self.probe.on_top()  # the same saves as in forward (a user's checkpoint
                #                      matches its recomputation's saves by count)
            return original(*args, **kwargs)
        position.stack.append(index)
        try:
            recorder = self.profiling.recording
            if recorder is not None:
                return recorder.run_layer(index, original, args, kwargs)
            if recompute and torch.is_grad_enabled() and self.probe.on_top():
                held = hold_inputs(args)
                # Without early stop (torch 2's default stops the recomputation at
                # its last needed save): the whole layer runs again, so that every
                # module's stream_parameters hooks run in pairs; with it, the
                # streamed weights after a recomputed layer differed from torch's.
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    return torch.utils.checkpoint.checkpoint(original, *held,
                                                             use_reentrant=False, **kwargs)
            return original(*args, **kwargs)
        finally:
            position.stack.pop()

    # ------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor):
        if self.probe.catch(t):
            return t
        if self.weights.is_weight(t):
            return self.weights.pack(t)
        layer = self.position.layer
        recorder = self.profiling.recording
        if recorder is not None:
            recorder.saved(layer, footprint_bytes(t))
        choice = self.chosen.of(layer)
        if choice in (HOST, SSD) and footprint_bytes(t) >= self.budgets.min_bytes:
            saved = self.store.offload(t, layer, ssd=choice == SSD)
        else:
            saved = self.store.keep(t, layer)
        if recorder is None:
            self.budgets.check_device(self.store.device_bytes)
        return saved

    def _unpack(self, saved):
        if isinstance(saved, SavedActivation):
            return self.store.unpack(saved)
        return SavedWeights.unpack(saved)


def _root_forward(ref, original):
    def forward(*args, **kwargs):
        handle = ref()
        if handle is None:
            return original(*args, **kwargs)
        return handle._root_forward(original, args, kwargs)
    return forward


def _layer_forward(ref, index, original):
    def forward(*args, **kwargs):
        handle = ref()
        if handle is None:
            return original(*args, **kwargs)
        return handle._layer_forward(index, original, args, kwargs)
    return forward
