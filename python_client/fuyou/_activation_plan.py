"""The activation planner: for each layer (a model's repeated block) one of
keep / host / ssd / recompute, the least predicted step time within the device
and host budgets (issue 23; idea 3 of the Fuyou paper, with measured rather
than hard-coded bandwidths, an SSD tier and recomputation as choices).

Pure Python over a :class:`Profile`; nothing here touches a model, so the
planner is tested with synthetic profiles.

The cost model (``simulate``), one step seen as two copy links (device to host
and host to device, full duplex) beside the compute:

forward
    Layers run back to back (``forward_s`` each; a recomputed layer runs as it
    is, saving nothing). The saved tensors of an offloaded layer go out after
    its forward, in layer order on the device-to-host link: the copy starts at
    ``max(layer end, link free)`` and takes ``bytes / d2h`` (host tier) or
    ``bytes / min(d2h, ssd_write)`` (SSD tier: staged through host buffers,
    the slower link sets the pace). Copies overlap the following layers'
    forward and never stall it (device memory pays instead: a copy's bytes
    stay on the device until it completes).
backward
    Layers in reverse order. A layer's tensors come back on the host-to-device
    link while the next-later layer runs its backward (prefetch one layer
    ahead, the runtime's order: reverse of pack order), not before they went
    out, taking ``bytes / h2d`` or ``bytes / min(h2d, ssd_read)``. A layer's
    backward starts when the later layer's backward ended *and* its tensors
    are back: the difference is a **stall**. A recomputed layer's backward
    costs ``forward_s + backward_s``.
step time
    ``end of backward + other_s`` (embeddings, head, loss: time outside the
    layers, whose saved tensors are always kept).

Device bytes (the budget bounds the predicted peak of saved-activation bytes
on the device): ``outside_bytes`` always; a kept layer's saved bytes from its
forward until its backward; a recomputed layer's ``input_bytes`` (what the
checkpoint holds) likewise, and its full saved bytes during its own backward;
an offloaded layer's bytes while its copy out is in flight, and again from its
prefetch (one layer ahead) to its backward. The peak is the largest of these
sums at every layer boundary of forward and backward. Host bytes: the sum of
the host layers' saved bytes (all live at the end of forward); SSD bytes
likewise against ``ssd_budget``.

The search: every combination when there are at most ``EXHAUSTIVE_LIMIT`` of
them, else a greedy descent (the change with the least time added per device
byte saved, until within budget) followed by single-layer improvements until
none helps. Ties prefer keep, then host, then ssd, then recompute.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["KEEP", "HOST", "SSD", "RECOMPUTE", "CHOICES", "LayerProfile", "Profile", "Plan",
           "plan_activations", "simulate", "format_bytes"]

KEEP, HOST, SSD, RECOMPUTE = "keep", "host", "ssd", "recompute"
CHOICES = (KEEP, HOST, SSD, RECOMPUTE)
_RANK = {c: i for i, c in enumerate(CHOICES)}
EXHAUSTIVE_LIMIT = 4096


@dataclasses.dataclass
class LayerProfile:
    """One layer as profiled: ``forward_s`` / ``backward_s`` (seconds),
    ``saved_bytes`` (activation bytes its forward saves for backward, weights
    excluded) and ``input_bytes`` (its tensor inputs: what a checkpoint holds)."""

    name: str
    forward_s: float
    backward_s: float
    saved_bytes: int
    input_bytes: int = 0


@dataclasses.dataclass
class Profile:
    """A step's profile: the layers in forward order, time and saved bytes
    outside them, and the links' bandwidths in bytes/s (``ssd_write`` /
    ``ssd_read`` None: no SSD tier)."""

    layers: List[LayerProfile]
    d2h: float
    h2d: float
    ssd_write: Optional[float] = None
    ssd_read: Optional[float] = None
    other_s: float = 0.0
    outside_bytes: int = 0

    @property
    def has_ssd(self) -> bool:
        return bool(self.ssd_write) and bool(self.ssd_read)


@dataclasses.dataclass
class Prediction:
    """What ``simulate`` predicts for one assignment of choices."""

    step_s: float
    device_peak: int
    host_bytes: int
    ssd_bytes: int
    stalls_s: List[float]
    copy_out_s: List[float]


@dataclasses.dataclass
class Plan:
    """A choice per layer and what the cost model predicts for it.

    ``choices[i]`` is one of ``CHOICES`` for ``profile.layers[i]``;
    ``predicted_step_s``, ``predicted_device_peak`` (bytes), ``host_bytes``,
    ``ssd_bytes``; ``device_budget`` / ``host_budget`` / ``ssd_budget`` as
    planned against. ``str(plan)`` is the readable table."""

    profile: Profile
    choices: List[str]
    prediction: Prediction
    device_budget: int
    host_budget: int
    ssd_budget: Optional[int]

    @property
    def predicted_step_s(self) -> float:
        return self.prediction.step_s

    @property
    def predicted_device_peak(self) -> int:
        return self.prediction.device_peak

    @property
    def host_bytes(self) -> int:
        return self.prediction.host_bytes

    @property
    def ssd_bytes(self) -> int:
        return self.prediction.ssd_bytes

    def choice_of(self, name: str) -> str:
        for layer, c in zip(self.profile.layers, self.choices):
            if layer.name == name:
                return c
        raise KeyError(name)

    def counts(self) -> Dict[str, int]:
        return {c: self.choices.count(c) for c in CHOICES}

    def table(self) -> str:
        p, pred = self.profile, self.prediction
        rows = [f"{'layer':<20} {'fwd ms':>8} {'bwd ms':>8} {'saved':>10} {'input':>10} "
                f"{'choice':>9} {'out ms':>8} {'stall ms':>8}"]
        for layer, c, out, stall in zip(p.layers, self.choices, pred.copy_out_s, pred.stalls_s):
            rows.append(f"{layer.name[:20]:<20} {layer.forward_s * 1e3:8.2f} "
                        f"{layer.backward_s * 1e3:8.2f} {format_bytes(layer.saved_bytes):>10} "
                        f"{format_bytes(layer.input_bytes):>10} {c:>9} {out * 1e3:8.2f} "
                        f"{stall * 1e3:8.2f}")
        ssd = (f"write {p.ssd_write / 1e9:.2f} / read {p.ssd_read / 1e9:.2f} GB/s"
               if p.has_ssd else "none")
        ssd_budget = "unbounded" if self.ssd_budget is None else format_bytes(self.ssd_budget)
        rows.append(f"links: d2h {p.d2h / 1e9:.2f} GB/s, h2d {p.h2d / 1e9:.2f} GB/s, ssd {ssd}; "
                    f"outside layers: {p.other_s * 1e3:.2f} ms, "
                    f"{format_bytes(p.outside_bytes)} kept")
        rows.append(f"predicted step {pred.step_s * 1e3:.2f} ms; device peak "
                    f"{format_bytes(pred.device_peak)} of {format_bytes(self.device_budget)}; "
                    f"host {format_bytes(pred.host_bytes)} of {format_bytes(self.host_budget)}; "
                    f"ssd {format_bytes(pred.ssd_bytes)} of {ssd_budget}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}B"


def _out_s(profile: Profile, choice: str, nbytes: int) -> float:
    if choice == HOST:
        return nbytes / profile.d2h
    if choice == SSD:
        return nbytes / min(profile.d2h, profile.ssd_write)
    return 0.0


def _in_s(profile: Profile, choice: str, nbytes: int) -> float:
    if choice == HOST:
        return nbytes / profile.h2d
    if choice == SSD:
        return nbytes / min(profile.h2d, profile.ssd_read)
    return 0.0


def simulate(profile: Profile, choices: Sequence[str]) -> Prediction:
    """The cost model of the module docstring for one assignment."""
    layers = profile.layers
    n = len(layers)
    if len(choices) != n:
        raise ValueError(f"{len(choices)} choices for {n} layers")
    moved = [c in (HOST, SSD) for c in choices]
    resident = [layers[i].saved_bytes if choices[i] == KEEP
                else layers[i].input_bytes if choices[i] == RECOMPUTE else 0 for i in range(n)]
    # forward
    t, link = 0.0, 0.0
    out_end = [0.0] * n
    copy_out = [0.0] * n
    peak = held = profile.outside_bytes
    for i, layer in enumerate(layers):
        t += layer.forward_s
        held += resident[i]
        if moved[i]:
            copy_out[i] = _out_s(profile, choices[i], layer.saved_bytes)
            start = max(t, link)
            link = out_end[i] = start + copy_out[i]
        in_flight = sum(layers[j].saved_bytes for j in range(i + 1) if moved[j] and out_end[j] > t)
        peak = max(peak, held + in_flight)
    # backward
    stalls = [0.0] * n
    link_in, prev_start = 0.0, t
    in_end = [0.0] * n
    # the prefetch of the last layer starts at the end of forward; of layer j
    # when layer j + 1's backward starts
    if n and moved[n - 1]:
        start = max(t, out_end[n - 1])
        link_in = in_end[n - 1] = start + _in_s(profile, choices[n - 1], layers[n - 1].saved_bytes)
    for j in range(n - 1, -1, -1):
        ready = in_end[j] if moved[j] else 0.0
        start = max(prev_start, ready)
        stalls[j] = start - prev_start
        if j > 0 and moved[j - 1]:
            s = max(start, link_in, out_end[j - 1])
            link_in = in_end[j - 1] = s + _in_s(profile, choices[j - 1], layers[j - 1].saved_bytes)
        here = layers[j].saved_bytes if choices[j] != KEEP else 0
        if choices[j] == RECOMPUTE:
            here -= layers[j].input_bytes  # already counted in held
        ahead = layers[j - 1].saved_bytes if j > 0 and moved[j - 1] else 0
        peak = max(peak, held + here + ahead)
        held -= resident[j]
        cost = layers[j].backward_s + (layers[j].forward_s if choices[j] == RECOMPUTE else 0.0)
        prev_start = start + cost
    host = sum(layer.saved_bytes for layer, c in zip(layers, choices) if c == HOST)
    ssd = sum(layer.saved_bytes for layer, c in zip(layers, choices) if c == SSD)
    return Prediction(step_s=prev_start + profile.other_s, device_peak=int(peak),
                      host_bytes=int(host), ssd_bytes=int(ssd), stalls_s=stalls,
                      copy_out_s=copy_out)


class _Search:
    """Scores assignments: (infeasible, time, tie-break rank)."""

    def __init__(self, profile: Profile, device_budget: int, host_budget: int,
                 ssd_budget: Optional[int]):
        self.profile = profile
        self.device_budget, self.host_budget, self.ssd_budget = device_budget, host_budget, ssd_budget
        self.cache: Dict[Tuple[str, ...], Tuple[Prediction, tuple]] = {}

    def excess(self, pred: Prediction) -> int:
        over = max(0, pred.device_peak - self.device_budget)
        over += max(0, pred.host_bytes - self.host_budget)
        if self.ssd_budget is not None:
            over += max(0, pred.ssd_bytes - self.ssd_budget)
        return over

    def score(self, choices: Sequence[str]):
        key = tuple(choices)
        hit = self.cache.get(key)
        if hit is None:
            pred = simulate(self.profile, key)
            rank = sum(_RANK[c] for c in key)
            hit = (pred, (self.excess(pred), round(pred.step_s, 12), rank))
            self.cache[key] = hit
        return hit


def plan_activations(profile: Profile, device_budget: int, host_budget: int,
                     ssd_budget: Optional[int] = None,
                     allowed: Sequence[str] = CHOICES) -> Plan:
    """The plan of least predicted step time whose predicted device peak,
    host bytes and SSD bytes are within the budgets (bytes; ``ssd_budget``
    None: unbounded). ``ssd`` is considered only when the profile has SSD
    bandwidths and ``allowed`` names it. ValueError when even the best
    assignment exceeds a budget (the message gives the least peak possible)."""
    options = [c for c in CHOICES if c in allowed and (c != SSD or profile.has_ssd)]
    if not profile.d2h or not profile.h2d:
        options = [c for c in options if c != HOST]
    if KEEP not in options:
        options.insert(0, KEEP)
    search = _Search(profile, int(device_budget), int(host_budget), ssd_budget)
    n = len(profile.layers)
    if len(options) ** n <= EXHAUSTIVE_LIMIT:
        best = min(itertools.product(options, repeat=n), key=lambda c: search.score(c)[1])
        best = list(best)
    else:
        best = _descend(search, options, n)
    pred, (excess, _, _) = search.score(best)
    if excess:
        raise ValueError(
            f"no activation plan fits: the best predicted device peak is "
            f"{format_bytes(pred.device_peak)} (budget {format_bytes(device_budget)}), host "
            f"{format_bytes(pred.host_bytes)} (budget {format_bytes(host_budget)}); raise a "
            "budget or lower the batch or sequence length")
    return Plan(profile=profile, choices=best, prediction=pred, device_budget=int(device_budget),
                host_budget=int(host_budget), ssd_budget=ssd_budget)


def _descend(search: _Search, options: List[str], n: int) -> List[str]:
    """Greedy from all-keep to feasibility, then single-layer improvements."""
    current = [KEEP] * n
    while True:
        pred, key = search.score(current)
        if key[0] == 0:
            break
        best, best_ratio = None, math.inf
        for i in range(n):
            for c in options:
                if c == current[i]:
                    continue
                trial = current[:i] + [c] + current[i + 1:]
                p2, k2 = search.score(trial)
                saved = key[0] - k2[0]
                if saved <= 0:
                    continue
                ratio = max(p2.step_s - pred.step_s, 0.0) / saved
                if ratio < best_ratio:
                    best, best_ratio = trial, ratio
        if best is None:
            break
        current = best
    improved = True
    while improved:
        improved = False
        key = search.score(current)[1]
        for i in range(n):
            for c in options:
                if c == current[i]:
                    continue
                trial = current[:i] + [c] + current[i + 1:]
                k2 = search.score(trial)[1]
                if k2 < key:
                    current, key, improved = trial, k2, True
    return current
