"""The arithmetic of ``fuyou plan``: from a model's shape and a machine's measured
rates, the bytes each tier holds, the bytes a step moves, the time each resource
needs for them, and the largest model the machine's storage can hold.

Pure functions of their inputs (no probe, no daemon): tests/python/test_plan.py
checks them by hand-computed cases. The measurements come from _plan_probe.py,
the report from plan.py.

What a step moves (fuyou's design, DESIGN.md section 3-7), per parameter:
  * the AdamW update reads the fp32 master and both moments (``state_bytes``:
    12, or 8 with bf16 moments) for every chunk the daemon's DRAM budget does not
    keep, and writes them back for every chunk (a commit each step makes them all
    durable; commit_every_steps > 1 would spare the cached ones);
  * streamed weights (``offload_params``): the daemon writes the new working
    weights (``weight_bytes``) beside the states, and forward and backward each
    fetch them once (2 x ``weight_bytes`` read);
  * streamed weights keep the step's gradients in the daemon's journal
    (``grad_bytes``), in DRAM up to half the budget, spilled (written, read back
    only for a redo) beyond it.
Storage space: step-atomic commits keep two extents of every state (the committed
one and its shadow): 2 x (state + weights) bytes a parameter, plus the journal's
scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

__all__ = ["ModelShape", "Machine", "Workload", "Plan", "shape_from_params",
           "shape_from_hf_config", "make_plan", "largest_params", "pick_chunk_bytes"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class ModelShape:
    """A decoder-only transformer, as far as the plan needs it."""

    params: int
    layers: int
    hidden: int
    vocab: int
    largest_module_params: int  # the largest module's own parameters (what one fetch holds)
    source: str = "size"  # "size" (guessed Llama proportions) or the config's path


@dataclass
class Machine:
    """Measured (or given) rates and capacities. Rates in bytes or operations a second."""

    disk_read: List[float]  # per storage path, bytes/s
    disk_write: List[float]
    disk_free: List[int]  # per storage path, bytes the daemon may use
    kernel_params_per_s: float  # the daemon's AdamW kernel, parameters updated a second
    host_total: int
    host_available: int
    dram_budget: int  # the daemon's --dram-budget
    compute_flops: float  # matmul rate of the device the model trains on
    gpu_memory: Optional[int] = None  # None: the model trains on the CPU
    h2d: Optional[float] = None  # host-to-device bytes/s (pinned)
    d2h: Optional[float] = None
    job_quota: Optional[int] = None  # the daemon's job_quota in bytes, None: unlimited

    @property
    def read_rate(self) -> float:  # striped over every path
        return sum(self.disk_read)

    @property
    def write_rate(self) -> float:
        return sum(self.disk_write)


@dataclass
class Workload:
    """How the model is trained."""

    tokens: int  # tokens a step (batch x sequence, all micro-batches)
    weight_bytes: int = 2  # working weights: 2 (bf16/fp16) or 4 (fp32)
    grad_bytes: int = 2
    state_bytes: int = 12  # fp32 master + m + v; 8 with state_dtype="bf16"
    recompute: bool = True  # activation checkpointing: one more forward in backward
    act_bytes: int = 2  # bytes of an activation element


@dataclass
class Plan:
    model: ModelShape
    workload: Workload
    tiers: Dict[str, int]  # bytes each tier holds
    stream_weights: bool
    stream_activations: bool
    activation_bytes: int
    chunk_bytes: int  # fuyou.AdamW(chunk_bytes=): bytes of weights a chunk
    read_bytes: int  # storage bytes a step
    write_bytes: int
    bounds: Dict[str, float]  # seconds a step each resource needs
    binding: str
    step_s: float
    tb_written_per_day: float
    storage_bytes: int  # space the job takes on the storage paths
    notes: List[str] = field(default_factory=list)


def _round_to(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m)


def shape_from_params(params: float, vocab: int = 32000) -> ModelShape:
    """A Llama-proportioned model of about ``params`` parameters: 12 h^2 a layer
    (4 h^2 attention, 8 h^2 gated MLP), hidden = 128 x layers (Llama 7B/13B,
    GPT-3 175B), two vocab x hidden embeddings."""
    n = int(params)
    if n <= 0:
        raise ValueError(f"--params must be positive, not {params!r}")
    hidden = _round_to((n * 128 / 12) ** (1 / 3), 128)
    layers = max(1, round((n - 2 * vocab * hidden) / (12 * hidden * hidden)))
    mlp = 8 * hidden * hidden // 3  # one of the three MLP projections
    largest = max(vocab * hidden, mlp)
    return ModelShape(params=n, layers=layers, hidden=hidden, vocab=vocab,
                      largest_module_params=largest, source="size")


def shape_from_hf_config(cfg: dict, source: str = "config") -> ModelShape:
    """The parameters of a Hugging Face decoder config (Llama/Mistral/Qwen style:
    hidden_size, num_hidden_layers, intermediate_size, num_attention_heads,
    num_key_value_heads, vocab_size, tie_word_embeddings; GPT-2 style n_embd,
    n_layer, n_positions), counted as transformers builds them."""
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    vocab = cfg.get("vocab_size")
    if not (hidden and layers and vocab):
        raise ValueError(f"{source}: needs hidden_size (n_embd), num_hidden_layers (n_layer) "
                         "and vocab_size")
    heads = cfg.get("num_attention_heads", cfg.get("n_head", 1))
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if "n_embd" in cfg and "hidden_size" not in cfg:  # GPT-2: biases, 4h MLP, learned positions
        inner = cfg.get("n_inner") or 4 * hidden
        per_layer = (4 * hidden * hidden + 4 * hidden) + (2 * hidden * inner + inner + hidden) \
            + 4 * hidden
        embed = vocab * hidden + cfg.get("n_positions", 1024) * hidden
        params = layers * per_layer + embed + 2 * hidden  # tied head, final LayerNorm
        largest = max(vocab * hidden, hidden * inner)
    else:
        inter = cfg.get("intermediate_size") or 4 * hidden
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        if cfg.get("attention_bias"):
            attn += heads * head_dim + 2 * kv_heads * head_dim + hidden
        per_layer = attn + 3 * hidden * inter + 2 * hidden
        tied = cfg.get("tie_word_embeddings", False)
        params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
        largest = max(vocab * hidden, hidden * inter)
    return ModelShape(params=int(params), layers=int(layers), hidden=int(hidden),
                      vocab=int(vocab), largest_module_params=int(largest), source=source)


def pick_chunk_bytes(shape: ModelShape, work: Workload, machine: Machine) -> int:
    """Bytes of weights a chunk (fuyou.AdamW's ``chunk_bytes``): the power of two
    at or below the weights of 16-256 MiB of states (large sequential extents, at least 4 MiB on each
    storage path), at most a sixteenth of the daemon's budget (its pipeline window
    holds a few chunks in flight) and at most an eighth of the model (enough chunks
    for the update to overlap backward)."""
    paths = max(1, len(machine.disk_read))
    states = min(256 * MiB, machine.dram_budget // 16,
                 shape.params * work.state_bytes // 8)
    states = max(states, 16 * MiB, 4 * MiB * paths)
    weights = states // work.state_bytes * work.weight_bytes
    return max(MiB, 1 << int(math.log2(weights)))


def activation_bytes(shape: ModelShape, work: Workload) -> int:
    """What backward keeps: with recompute, each layer's input (hidden values a
    token); without, about 34 hidden values a token a layer (Korthikanti et al.,
    attention scores left out: a fused attention keeps none)."""
    per_token_layer = shape.hidden * (1 if work.recompute else 34)
    return work.tokens * shape.layers * per_token_layer * work.act_bytes


def _cached_fraction(total_bytes: int, chunk_states: int, budget: int, journal: int) -> float:
    """Share of the chunks (states and weights) the daemon's DRAM tier serves
    without reading them: what its budget holds beyond a window of four chunks
    in flight and the gradient journal's DRAM share."""
    if total_bytes <= 0:
        return 1.0
    return min(1.0, max(0, budget - 4 * chunk_states - journal) / total_bytes)


def make_plan(shape: ModelShape, work: Workload, machine: Machine,
              stream_weights: Optional[bool] = None) -> Plan:
    """The plan for ``shape`` trained as ``work`` on ``machine``."""
    n = shape.params
    notes: List[str] = []
    chunk_bytes = pick_chunk_bytes(shape, work, machine)
    chunk_states = chunk_bytes // work.weight_bytes * work.state_bytes
    acts = activation_bytes(shape, work)
    # The device the model trains on: a GPU's memory, else the host's, less the daemon's budget.
    device_mem = machine.gpu_memory if machine.gpu_memory is not None else \
        max(0, machine.host_available - machine.dram_budget)
    resident_need = n * (work.weight_bytes + work.grad_bytes) + acts
    if stream_weights is None:
        stream_weights = resident_need > 0.8 * device_mem
    working_weights = (2 * shape.largest_module_params * work.weight_bytes
                       + 2 * chunk_bytes) if stream_weights else n * work.weight_bytes
    stream_acts = acts > max(0, 0.8 * device_mem - working_weights
                             - (0 if stream_weights else n * work.grad_bytes))

    total_states = n * work.state_bytes
    weights = n * work.weight_bytes if stream_weights else 0
    journal = n * work.grad_bytes if stream_weights else 0
    journal_dram = min(journal, machine.dram_budget // 2)
    journal_spill = journal - journal_dram
    cached = _cached_fraction(total_states + weights, chunk_states, machine.dram_budget,
                              journal_dram)
    # Reads: the update's states and two fetches of the weights, unless DRAM holds them.
    read = int((total_states + 2 * weights) * (1 - cached))
    # Writes: a commit every step makes every updated chunk durable, cached or not.
    write = total_states + weights + journal_spill
    if journal_spill:
        notes.append(f"the gradient journal spills {journal_spill / GiB:.1f} GiB a step "
                     "(written, read back only for a redo)")

    least_budget = 2 * shape.largest_module_params * work.state_bytes
    if machine.dram_budget < least_budget:
        notes.append(f"the daemon's DRAM budget must be at least {least_budget / MiB:.0f} MiB: "
                     "twice the states of the largest parameter (one chunk)")

    flops = (8 if work.recompute else 6) * n * work.tokens
    bounds = {
        "storage": read / machine.read_rate + write / machine.write_rate,
        "kernel": n / machine.kernel_params_per_s,
        "compute": flops / machine.compute_flops,
    }
    if machine.gpu_memory is not None and machine.h2d and machine.d2h:
        h2d = (2 if stream_weights else 1) * n * work.weight_bytes
        d2h = n * work.grad_bytes
        if stream_acts:
            h2d += acts
            d2h += acts
        bounds["pcie"] = max(h2d / machine.h2d, d2h / machine.d2h)
        step_s = max(bounds.values())
        binding = max(bounds, key=bounds.get)
    else:
        # On the CPU the update and the model share the cores: only storage overlaps them.
        cpu = bounds["compute"] + bounds["kernel"]
        step_s = max(bounds["storage"], cpu)
        binding = "storage" if bounds["storage"] >= cpu else \
            ("compute" if bounds["compute"] >= bounds["kernel"] else "kernel")
        notes.append("CPU training: compute and the AdamW kernel share the cores, so the "
                     "step is max(storage, compute + kernel)")

    storage = 2 * (total_states + weights) + journal_spill
    tiers = {
        "storage (states, both extents" + (", weights" if stream_weights else "") + ")": storage,
        "daemon DRAM (budget)": min(machine.dram_budget, total_states + weights),
        ("GPU" if machine.gpu_memory is not None else "host (model)") + " weights":
            working_weights,
        "activations": acts,
    }
    return Plan(model=shape, workload=work, tiers=tiers, stream_weights=stream_weights,
                stream_activations=stream_acts, activation_bytes=acts, chunk_bytes=chunk_bytes,
                read_bytes=read, write_bytes=write, bounds=bounds, binding=binding,
                step_s=step_s, tb_written_per_day=write / step_s * 86400 / 1e12,
                storage_bytes=storage, notes=notes)


def storage_bytes_per_param(work: Workload, stream_weights: bool = True) -> int:
    """Storage a parameter takes: both extents of its states (and weights), and
    its gradient journal when it spills."""
    return 2 * (work.state_bytes + (work.weight_bytes if stream_weights else 0)) \
        + (work.grad_bytes if stream_weights else 0)


def largest_params(work: Workload, machine: Machine) -> int:
    """The most parameters the storage paths can hold for one job (streamed
    weights: the host and GPU hold one module at a time, so storage is the
    bound), within the daemon's job quota."""
    space = sum(machine.disk_free)
    if machine.job_quota is not None:
        space = min(space, machine.job_quota)
    return int(space // storage_bytes_per_param(work))
