"""``python -m fuyou.plan``: what this machine can fine-tune with fuyou, how fast
each resource lets a step go, and how much it writes to the SSDs.

    python -m fuyou.plan --params 70e9 [--tokens 16384] [--endurance-tbw 7000]
    python -m fuyou.plan --config path/to/config.json [--batch 8 --seq 2048]

It measures the machine in a few seconds (each storage path's O_DIRECT write and
read rate, the daemon's AdamW update rate through a private fuyoud, the matmul
rate of the device the model trains on, free memory, on a GPU machine its memory
and host-device bandwidth) and reads the daemon's settings from the same TOML
file fuyoud reads (--daemon-config, default /etc/fuyou/fuyoud.toml; --data-dir
and --dram-budget as fuyoud's flags). Every measurement can be given instead
(--disk-read-gbps, --kernel-gparams, --tflops, ...): a plan for another machine,
or for the paper's rig. The arithmetic is fuyou/_plan_model.py, the probes
fuyou/_plan_probe.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from . import _plan_model as pm
from . import _plan_probe as probe
from ._errors import FuyouError
from ._sizes import parse_size

__all__ = ["measure", "main"]

GB = 1e9


def _args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fuyou.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="model size in parameters, e.g. 70e9")
    model.add_argument("--config", help="a Hugging Face config.json (or its directory)")
    ap.add_argument("--tokens", type=int, help="tokens a step (default batch x seq)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--weights", choices=["bf16", "fp16", "fp32"], default="bf16",
                    help="working weights and gradients (default bf16)")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="fuyou.AdamW(state_dtype=): the moments' dtype")
    ap.add_argument("--no-recompute", action="store_true",
                    help="keep every activation (default: activation checkpointing)")
    ap.add_argument("--stream-weights", choices=["auto", "yes", "no"], default="auto",
                    help="offload_params: the weights live in fuyoud (on the SSDs beside the "
                    "states) and stream in; auto: when they do not fit the device")
    ap.add_argument("--endurance-tbw", type=float,
                    help="the drives' rated endurance in TB written (all drives together)")
    ap.add_argument("--daemon-config", help="fuyoud's TOML file (default /etc/fuyou/fuyoud.toml)")
    ap.add_argument("--data-dir", action="append", help="storage path, repeat per SSD")
    ap.add_argument("--dram-budget", help="fuyoud's DRAM budget, e.g. 64GiB")
    ap.add_argument("--fuyoud", help="fuyoud binary for the kernel probe")
    ap.add_argument("--probe-bytes", default="512MiB", help="bytes each disk probe writes")
    given = ap.add_argument_group("instead of measuring (a plan for another machine)")
    given.add_argument("--disks", type=int, help="number of identical storage paths")
    given.add_argument("--disk-read-gbps", type=float, help="GB/s read, each path")
    given.add_argument("--disk-write-gbps", type=float, help="GB/s written, each path")
    given.add_argument("--disk-free", help="space free for the job, each path, e.g. 3.8TB")
    given.add_argument("--kernel-gparams", type=float, help="AdamW update, 1e9 params/s")
    given.add_argument("--host-memory", help="host memory, e.g. 768GiB")
    given.add_argument("--gpu-memory", help="GPU memory, e.g. 24GiB ('none': CPU training)")
    given.add_argument("--pcie-gbps", type=float, help="host-device GB/s, each direction")
    given.add_argument("--tflops", type=float, help="achieved matmul TFLOPS of the trainer")
    ap.add_argument("--json", help="also write the plan and measurements here")
    return ap.parse_args(argv)


def _say(line: str) -> None:
    print(line, flush=True)


def measure(args: argparse.Namespace) -> pm.Machine:
    """The machine: each figure given on the command line, else measured."""
    settings = probe.daemon_settings(args.daemon_config, args.data_dir, args.dram_budget)
    paths = settings["paths"]
    n = args.disks or len(paths)
    reads, writes, free = [], [], []
    if args.disk_read_gbps and args.disk_write_gbps:
        reads, writes = [args.disk_read_gbps * GB] * n, [args.disk_write_gbps * GB] * n
    else:
        for path in paths:
            if not os.path.isdir(path):
                sys.exit(f"fuyou plan: storage path {path} does not exist; create it, or "
                         "name the paths fuyoud will use with --data-dir (or --daemon-config)")
            r = probe.disk_rate(path, parse_size(args.probe_bytes, "--probe-bytes"))
            _say(f"measured {path}: write {r['write'] / GB:.2f} GB/s, read {r['read'] / GB:.2f}"
                 f" GB/s ({'O_DIRECT' if r['direct'] else 'buffered: O_DIRECT refused'}, "
                 f"{r['bytes'] >> 20} MiB, 4 MiB requests, 4 in flight)")
            reads.append(r["read"])
            writes.append(r["write"])
    if args.disk_free:
        free = [parse_size(args.disk_free, "--disk-free")] * n
    else:
        for path in paths:
            avail, _size = probe.free_for_jobs(path) if os.path.isdir(path) else (0, 0)
            free.append(avail)
    quota = settings["job_quota"]
    job_quota = None
    if quota not in ("auto", "unlimited"):
        job_quota = parse_size(quota, "job_quota")
    elif quota == "auto" and not args.disk_free:
        job_quota = sum(probe.free_for_jobs(p)[1] for p in paths if os.path.isdir(p)) // 4
    mem = probe.memory()
    host_total = parse_size(args.host_memory, "--host-memory") if args.host_memory \
        else mem["total"]
    host_avail = host_total if args.host_memory else mem["available"]
    if args.kernel_gparams:
        kernel = args.kernel_gparams * GB
    else:
        try:
            k = probe.kernel_rate(binary=args.fuyoud)
        except (FuyouError, OSError) as e:
            sys.exit(f"fuyou plan: the AdamW probe needs a fuyoud it can start ({e}); name "
                     "the binary with --fuyoud, or give the rate with --kernel-gparams")
        kernel = k["params_per_s"]
        _say(f"measured the daemon's AdamW update: {kernel / GB:.3f} G params/s "
             "(8 Mi fp32 params in its DRAM tier, shared-memory copies included)")
    gpu_mem = h2d = d2h = None
    if args.gpu_memory and args.gpu_memory != "none":
        gpu_mem = parse_size(args.gpu_memory, "--gpu-memory")
        h2d = d2h = (args.pcie_gbps or 25.0) * GB
    elif args.gpu_memory != "none":
        g = probe.gpu()
        if g is None:
            _say("no CUDA device: the plan is for training on this machine's CPU "
                 "(GPU memory and host-device bandwidth not measured)")
        else:
            gpu_mem, h2d, d2h = g["memory"], g["h2d"], g["d2h"]
            _say(f"measured {g['name']}: {gpu_mem / 2**30:.1f} GiB, host-to-device "
                 f"{h2d / GB:.1f} GB/s, device-to-host {d2h / GB:.1f} GB/s")
    if args.tflops:
        flops = args.tflops * 1e12
    else:
        flops = probe.matmul_rate("cuda" if gpu_mem else "cpu", dtype=args.weights)
        _say(f"measured matmul: {flops / 1e12:.3f} TFLOPS ({args.weights} on the "
             f"{'GPU' if gpu_mem else 'CPU'})")
    return pm.Machine(disk_read=reads, disk_write=writes, disk_free=free,
                      kernel_params_per_s=kernel, host_total=host_total,
                      host_available=host_avail, dram_budget=settings["dram_budget"],
                      compute_flops=flops, gpu_memory=gpu_mem, h2d=h2d, d2h=d2h,
                      job_quota=job_quota)


def _shape(args) -> pm.ModelShape:
    if args.params:
        return pm.shape_from_params(args.params)
    path = args.config
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return pm.shape_from_hf_config(json.load(f), source=path)


def _size(b: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def report(plan: pm.Plan, machine: pm.Machine, largest: int, endurance_tbw=None) -> None:
    """The plan, in the order a user asks."""
    m, w = plan.model, plan.workload
    _say(f"\nmodel: {m.params / 1e9:.2f} B parameters ({m.layers} layers, hidden {m.hidden}, "
         f"vocab {m.vocab}; from {m.source}); {w.tokens} tokens a step; weights "
         f"{w.weight_bytes} B, states {w.state_bytes} B a parameter")
    _say(f"machine: {len(machine.disk_read)} storage path(s), {machine.read_rate / GB:.2f} GB/s "
         f"read, {machine.write_rate / GB:.2f} GB/s write together; daemon budget "
         f"{machine.dram_budget / 2**30:.1f} GiB; host memory {machine.host_available / 2**30:.1f}"
         f" GiB available of {machine.host_total / 2**30:.1f}")
    _say("bytes per tier:")
    for tier, b in plan.tiers.items():
        _say(f"  {tier:<48} {_size(b):>10}")
    _say(f"weights must stream (offload_params=True): {'yes' if plan.stream_weights else 'no'}; "
         f"activations must be offloaded: {'yes' if plan.stream_activations else 'no'} "
         f"({_size(plan.activation_bytes)} a step)")
    _say(f"chunk size: fuyou.AdamW(chunk_bytes={plan.chunk_bytes >> 20} << 20), "
         f"{plan.chunk_bytes // w.weight_bytes * w.state_bytes >> 20} MiB of states a chunk")
    _say(f"storage traffic a step: {_size(plan.read_bytes)} read, {_size(plan.write_bytes)} "
         "written")
    _say("step time each resource allows:")
    for name, s in sorted(plan.bounds.items(), key=lambda kv: -kv[1]):
        _say(f"  {name:<10} {s:>10.2f} s{'   <- binds' if name == plan.binding else ''}")
    flops = m.params * w.tokens / plan.step_s
    unit, div = ("TFLOPS", 1e12) if 6 * flops >= 1e12 else ("GFLOPS", 1e9)
    _say(f"predicted step: {plan.step_s:.2f} s ({w.tokens / plan.step_s:.3g} tokens/s; "
         f"{6 * flops / div:.1f} model {unit} counting 6 N a token, {8 * flops / div:.1f} "
         "counting 8 N with recompute)")
    for note in plan.notes:
        _say(f"  note: {note}")
    line = f"written to the SSDs: {plan.tb_written_per_day:.1f} TB a day of training"
    if endurance_tbw:
        days = endurance_tbw / plan.tb_written_per_day if plan.tb_written_per_day else float("inf")
        line += f"; the rated {endurance_tbw:g} TBW last {days:.0f} days of training"
    _say(line)
    _say(f"storage needed: {_size(plan.storage_bytes)} of {_size(sum(machine.disk_free))} "
         f"free{' (fits)' if plan.storage_bytes <= sum(machine.disk_free) else ' (DOES NOT FIT)'}")
    _say(f"largest model this machine can fine-tune (storage bound, weights streamed): "
         f"{largest / 1e9:.2f} B parameters")


def main(argv: Optional[List[str]] = None) -> int:
    args = _args(argv)
    shape = _shape(args)
    wb = 4 if args.weights == "fp32" else 2
    work = pm.Workload(tokens=args.tokens or args.batch * args.seq, weight_bytes=wb,
                       grad_bytes=wb, state_bytes=12 if args.state_dtype == "fp32" else 8,
                       recompute=not args.no_recompute, act_bytes=wb)
    machine = measure(args)
    stream = {"auto": None, "yes": True, "no": False}[args.stream_weights]
    plan = pm.make_plan(shape, work, machine, stream_weights=stream)
    largest = pm.largest_params(work, machine)
    report(plan, machine, largest, args.endurance_tbw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": vars(machine), "plan": {k: v for k, v in vars(plan).items()
                                                         if k not in ("model", "workload")},
                       "model": vars(shape), "workload": vars(work),
                       "largest_params": largest}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
