#!/usr/bin/env python3
"""Optimizer states larger than the host (issue 35 item 1): a Llama-architecture
model built in fuyou.init_empty, materialized straight into fuyoud, its weights
streamed (offload_params + stream_parameters), trained for a few steps on real
text (this repository's docs, byte-level), with every step's traffic and memory
measured against the disk's rate and against what fuyou plan predicts.

    .venv/bin/python benchmarks/scale_bench.py --fuyoud build/daemon/fuyoud \\
        --size 1.5b [--steps 4] [--batch 1 --seq 64] [--dram-budget 1GiB] \\
        [--data-dir DIR] [--kill-at STEP] [--export DIR --shard-mib 512] [--json out.json]
    .venv/bin/python benchmarks/scale_bench.py --table run1.json run2.json ...   # item 4

--size: tiny (19M), 25m, 100m, 300m, 1b, 1.5b (Llama proportions, vocab
256 for bytes; --layers/--hidden/--intermediate override). Before anything it
checks that the storage the job takes (both extents of states and weights, the
spilled gradient journal; fuyou plan's arithmetic) fits the data directory's free
space with --spare-gib left, and refuses if not.

Reported a step: forward+backward and optimizer seconds, SSD bytes read and
written (the daemon's GetStats) and the seconds the disk needs for them at the
rates a probe measured on the same path in this run, the daemon's and the
client's peak RSS (VmHWM), the loss. Against fuyou plan: its predicted bytes
and step time for this model on the rates measured here.

--kill-at K: SIGKILL fuyoud during step K, start a new one on the same data
directory, rebuild the model and optimizer (the job resumes), check that it
resumed at the last durable step and that step K's loss, recomputed, equals the
one seen before the kill; then train on.
--export DIR: fuyou.export_checkpoint(opt, DIR, model, shard_bytes=) after the
last step; the client's peak RSS during it against the shard size.
"""
import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import threading
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
import fuyou  # noqa: E402
from fuyou import _plan_model as pm, _plan_probe as probe  # noqa: E402
from fuyou._host_malloc import MALLOC_ENV, keep_large_buffers_mmapped  # noqa: E402
from fuyou._sizes import parse_size  # noqa: E402

SIZES = {  # hidden, intermediate, layers, heads
    "tiny": (256, 688, 24, 4),
    "25m": (512, 1376, 8, 8),
    "100m": (768, 2048, 14, 12),
    "300m": (1024, 2752, 24, 16),
    "1b": (2048, 5504, 20, 16),
    "1.5b": (2048, 5504, 29, 16),
}
MiB, GiB = 1 << 20, 1 << 30
CLIENT_OVER_BASE = 1 << 30  # the client's stated bound over its RSS before the model


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuyoud", default=os.environ.get("FUYOU_DAEMON"))
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dram-budget", default="1GiB", help="fuyoud's --dram-budget")
    ap.add_argument("--device-budget", help="stream_parameters' device_budget "
                    "(default 4 x the largest module)")
    ap.add_argument("--chunk-mib", type=float, help="MiB of weights a chunk (default: fuyou plan's)")
    ap.add_argument("--threads", type=int, default=1, help="fuyoud's optimizer threads")
    ap.add_argument("--data-dir", default=str(ROOT / "scale-bench-data"))
    ap.add_argument("--keep-data", action="store_true", help="leave the data directory")
    ap.add_argument("--spare-gib", type=float, default=5.0,
                    help="free space to leave on the disk for others")
    ap.add_argument("--probe-bytes", default="1GiB")
    ap.add_argument("--kill-at", type=int, help="SIGKILL fuyoud during this step (>= 2)")
    ap.add_argument("--export", help="export the trained model here (sharded)")
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--quick", action="store_true",
                    help="no kernel and matmul probes (the plan's bytes only, no step time)")
    ap.add_argument("--malloc", choices=["fuyou", "mmap", "glibc"], default="fuyou",
                    help="fuyou: what stream_parameters does (allocations of 128 KiB and more "
                    "mmapped, given back to the system when freed: fuyou/_host_malloc.py); mmap: "
                    "the same set by the bench before anything else; glibc: FUYOU_MALLOC=glibc, "
                    "glibc's default dynamic threshold, which keeps the freed buffers of "
                    "streamed weights in the heap")
    ap.add_argument("--json")
    return ap.parse_args(argv)


def set_malloc(mode):
    """glibc raises its mmap threshold to the size of each mmapped block freed
    (up to 32 MiB), after which module-sized buffers come from the heap and stay
    there once freed: a client streaming a 300M model grew by ~1.7x the model's
    bf16 weights. fuyou.stream_parameters fixes the threshold at 128 KiB
    (fuyou/_host_malloc.py) unless FUYOU_MALLOC=glibc; "mmap" sets it here first."""
    if mode == "glibc":
        os.environ[MALLOC_ENV] = "glibc"
    elif mode == "mmap" and not keep_large_buffers_mmapped():
        sys.exit("scale_bench: mallopt(M_MMAP_THRESHOLD) failed; use --malloc glibc")


def vm(pid, key):
    """VmHWM or VmRSS of `pid` in bytes (0 for a process that is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def reset_peak():
    """Resets this process's VmHWM to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def text_batches(batch, seq, count=2):  # report() groups the losses by the same count
    """`count` batches of bytes of this repository's docs (real text), fixed."""
    raw = b"".join((ROOT / p).read_bytes() for p in ("README.md", "python_client/README.md"))
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        out.append(torch.stack([data[s:s + seq + 1] for s in starts.tolist()]))
    return out


def llama_config(args):
    from transformers import LlamaConfig
    hidden, inter, layers, heads = SIZES[args.size]
    hidden, inter, layers = args.hidden or hidden, args.intermediate or inter, args.layers or layers
    return LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads, max_position_embeddings=max(args.seq, 128),
                       tie_word_embeddings=False)


def init_weights(module):
    """Llama's init, module by module: N(0, 0.02) for Linear and Embedding, ones for norms."""
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif hasattr(module, "weight") and module.weight is not None:
        torch.nn.init.ones_(module.weight)


class Trainer:
    """The model, its fuyou.AdamW and the stream, built for a (new or resumed) job."""

    def __init__(self, args, cfg, daemon, job, chunk_bytes, device_budget):
        from transformers import LlamaForCausalLM
        with fuyou.init_empty(job=job):
            self.model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        self.opt = fuyou.AdamW(self.model.parameters(), lr=args.lr, address=daemon.address,
                               chunk_bytes=chunk_bytes, offload_params=True, timeout=3600)
        t0 = time.perf_counter()
        torch.manual_seed(1)
        fuyou.materialize(self.model, self.opt, init=init_weights)
        self.materialize_s = time.perf_counter() - t0
        self.stream = fuyou.stream_parameters(self.model, self.opt, device_budget=device_budget,
                                              prefetch=2)


def io_counters(address):
    s = fuyou.admin_stats(address)
    return {k: s.get(k, 0) for k in ("bytes_read", "bytes_written", "weights_bytes_read",
                                     "journal_spilled_bytes_total")}


def main(argv=None):
    args = parse_args(argv)
    if not args.fuyoud or not os.access(args.fuyoud, os.X_OK):
        sys.exit("scale_bench: give --fuyoud PATH (or set FUYOU_DAEMON)")
    set_malloc(args.malloc)
    cfg = llama_config(args)
    shape = pm.shape_from_hf_config(cfg.to_dict(), source=f"LlamaConfig ({args.size})")
    work = pm.Workload(tokens=args.batch * args.seq, recompute=False)  # no checkpointing here
    data_dir = pathlib.Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    avail, _size = probe.free_for_jobs(str(data_dir))
    budget = parse_size(args.dram_budget, "--dram-budget")
    need = shape.params * pm.storage_bytes_per_param(work) + (1 << 30)
    spare = int(args.spare_gib * GiB)
    if need + spare > avail:
        sys.exit(f"scale_bench: a {shape.params / 1e9:.2f} B-parameter model needs "
                 f"{need / 1e9:.1f} GB in {data_dir} (both extents of fp32 states and bf16 "
                 f"weights, the spilled gradient journal) and {spare / 1e9:.1f} GB must stay "
                 f"free, but only {avail / 1e9:.1f} GB are: pick a smaller --size, another "
                 "--data-dir, or free space")
    try:
        result = run(args, cfg, shape, work, data_dir, budget, need)
    finally:
        if not args.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print("wrote", args.json)
    return result


def plan_for(shape, work, disk, kernel, flops, budget, need):
    """fuyou plan's machine and plan for this run's measurements."""
    mem = probe.memory()
    machine = pm.Machine(disk_read=[disk["read"]], disk_write=[disk["write"]], disk_free=[need],
                         kernel_params_per_s=kernel, host_total=mem["total"],
                         host_available=mem["available"], dram_budget=budget,
                         compute_flops=flops)
    return machine, pm.make_plan(shape, work, machine, stream_weights=True)


def run(args, cfg, shape, work, data_dir, budget, need):
    r = probe.disk_rate(str(data_dir), parse_size(args.probe_bytes, "--probe-bytes"))
    if args.quick:
        kernel, flops = {"params_per_s": float("nan")}, float("nan")
    else:
        kernel = probe.kernel_rate(binary=args.fuyoud, threads=args.threads)
        flops = probe.matmul_rate("cpu", dtype="bf16")
    machine, plan = plan_for(shape, work, r, kernel["params_per_s"], flops, budget, need)
    chunk_bytes = int(args.chunk_mib * MiB) if args.chunk_mib else plan.chunk_bytes
    device_budget = parse_size(args.device_budget, "--device-budget") if args.device_budget \
        else 4 * shape.largest_module_params * 2
    states = 12 * shape.params
    print(f"scale_bench: Llama {cfg.num_hidden_layers}x{cfg.hidden_size} (MLP "
          f"{cfg.intermediate_size}), {shape.params / 1e9:.3f} B params; fp32 states "
          f"{states / GiB:.1f} GiB = {states / machine.host_total:.2f}x this host's "
          f"{machine.host_total / GiB:.1f} GiB; storage {need / 1e9:.1f} GB; batch "
          f"{args.batch}x{args.seq}; fuyoud budget {budget / MiB:.0f} MiB, {args.threads} "
          f"thread(s); chunk {chunk_bytes / MiB:.1f} MiB of weights; device_budget "
          f"{device_budget / MiB:.0f} MiB", flush=True)
    print(f"probe of {data_dir} ({r['bytes'] >> 20} MiB, O_DIRECT {r['direct']}): write "
          f"{r['write'] / 1e9:.2f} GB/s, read {r['read'] / 1e9:.2f} GB/s; AdamW update "
          f"{kernel['params_per_s'] / 1e9:.3f} G params/s; matmul {flops / 1e9:.0f} GFLOPS",
          flush=True)

    def start_daemon():
        return fuyou.EmbeddedDaemon(
            data_dir=str(data_dir / "fuyoud"), binary=args.fuyoud,
            extra_args=["--dram-budget", args.dram_budget, "--threads", str(args.threads),
                        "--job-quota", "unlimited", "--max-storage-per-user", "unlimited",
                        "--max-storage-all-users", "unlimited", "--log-level", "warn"])

    daemon = start_daemon()
    daemon_peaks = []
    batches = text_batches(args.batch, args.seq)
    from transformers import LlamaForCausalLM  # noqa: F401  (its import is not the model's)
    reset_peak()
    client_base = vm(os.getpid(), "VmRSS")
    t_first = time.perf_counter()
    tr = Trainer(args, cfg, daemon, "scale-bench", chunk_bytes, device_budget)
    print(f"materialize: {tr.materialize_s:.1f} s", flush=True)
    steps, kill = [], None
    step = 1
    try:
        while step <= args.steps:
            batch = batches[(step - 1) % len(batches)]
            before = io_counters(daemon.address)
            timer = None
            if args.kill_at == step and kill is None:
                delay = 0.5 * steps[-1]["fwd_bwd_s"] if steps else 1.0
                timer = threading.Timer(delay, os.kill, (daemon.pid, signal.SIGKILL))
                timer.start()
            t0 = time.perf_counter()
            loss = None
            try:
                # transformers shifts the labels: the loss predicts each next byte
                out = tr.model(input_ids=batch, labels=batch)
                loss = float(out.loss.detach())
                out.loss.backward()
                t1 = time.perf_counter()
                tr.opt.step()
                tr.opt.zero_grad(set_to_none=True)
                t2 = time.perf_counter()
            except fuyou.FuyouError as e:
                if timer is None:
                    raise
                kill = resume(args, cfg, tr, daemon, e, loss, step, chunk_bytes, device_budget,
                              daemon_peaks, start_daemon)
                tr, daemon = kill.pop("trainer"), kill.pop("daemon")
                continue  # redo this step on the resumed job (its first: not timed)
            if timer is not None:
                timer.cancel()
                sys.exit("scale_bench: the kill landed after the step; use a later --kill-at")
            after = io_counters(daemon.address)
            d = {k: after[k] - before[k] for k in after}
            io_s = d["bytes_read"] / r["read"] + d["bytes_written"] / r["write"]
            row = dict(step=step, loss=loss, fwd_bwd_s=t1 - t0, opt_s=t2 - t1, step_s=t2 - t0,
                       disk_s=io_s, **d, daemon_rss=vm(daemon.pid, "VmRSS"),
                       client_rss=vm(os.getpid(), "VmRSS"))
            if step == 1:
                row["first_step_total_s"] = time.perf_counter() - t_first
            # a session's first step learns the order: the steady median leaves it out
            row["first_of_session"] = step == 1 or (kill is not None and step == kill["step"])
            steps.append(row)
            if kill is not None and step == kill["step"]:
                kill["loss_after"] = loss
            print(f"  step {step}: loss {loss:.4f}  fwd+bwd {row['fwd_bwd_s']:.1f} s  opt "
                  f"{row['opt_s']:.1f} s  read {d['bytes_read'] / 1e9:.2f} GB (weights "
                  f"{d['weights_bytes_read'] / 1e9:.2f}) written {d['bytes_written'] / 1e9:.2f}"
                  f" GB (journal {d['journal_spilled_bytes_total'] / 1e9:.2f}) = disk "
                  f"{io_s:.1f} s at the probe's rates; RSS fuyoud "
                  f"{row['daemon_rss'] / MiB:.0f} MiB, client {row['client_rss'] / MiB:.0f} MiB",
                  flush=True)
            step += 1
        client_peak = vm(os.getpid(), "VmHWM")  # training's (the export resets it)
        export = do_export(args, tr) if args.export else None
        used = sum(f.stat().st_blocks * 512 for f in data_dir.rglob("*") if f.is_file())
        print(f"storage used in {data_dir}: {used / 1e9:.1f} GB (plan: {need / 1e9:.1f} GB)",
              flush=True)
        daemon_peaks.append(vm(daemon.pid, "VmHWM"))
        peak_live = tr.stream.peak_live_bytes
        tr.opt.close()
    finally:
        daemon.stop()
    result = report(args, shape, plan, machine, r, steps, daemon_peaks, client_base,
                    client_peak, budget, device_budget, peak_live, kill, export, need)
    result["storage_used"] = used
    return result


def resume(args, cfg, tr, daemon, error, loss, step, chunk_bytes, device_budget, daemon_peaks,
           start_daemon):
    """After fuyoud was killed in `step`: a new fuyoud on the same data, a new
    model and optimizer on the same job; returns what the resume shows."""
    durable_before, committed_before = tr.opt.durable_step, tr.opt.committed_step
    print(f"  step {step}: fuyoud SIGKILLed mid-step ({type(error).__name__}); last durable "
          f"step seen {durable_before}; loss before the kill {loss}", flush=True)
    daemon_peaks.append(vm(daemon.pid, "VmHWM"))
    try:
        tr.opt.close()
    except Exception:  # the session died with the daemon
        pass
    daemon.stop()
    t0 = time.perf_counter()
    daemon = start_daemon()
    trainer = Trainer(args, cfg, daemon, "scale-bench", chunk_bytes, device_budget)
    resumed = trainer.opt.committed_step
    print(f"  resumed: job at step {resumed} (resumed={trainer.opt.resumed}) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    # durable_step is read from EndStep's answers and may lag the daemon by one step
    if not durable_before <= resumed <= committed_before:
        sys.exit(f"scale_bench: the job resumed at step {resumed}, not at the last durable "
                 f"step ({durable_before}..{committed_before})")
    return dict(step=step, durable_before=durable_before, committed_before=committed_before,
                resumed_at=resumed,
                loss_before=loss, restart_s=time.perf_counter() - t0, trainer=trainer,
                daemon=daemon)


def do_export(args, tr):
    out = pathlib.Path(args.export)
    shutil.rmtree(out, ignore_errors=True)
    reset_peak()
    base = vm(os.getpid(), "VmRSS")
    t0 = time.perf_counter()
    summary = fuyou.export_checkpoint(tr.opt, str(out), tr.model,
                                      shard_bytes=args.shard_mib * MiB)
    secs = time.perf_counter() - t0
    peak = vm(os.getpid(), "VmHWM")
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"export: {len(files)} files, {size / 1e9:.2f} GB in {secs:.1f} s "
          f"({', '.join(files[:3])}, ...); client peak RSS +{(peak - base) / MiB:.0f} MiB "
          f"over its {base / MiB:.0f} MiB before, shard {args.shard_mib} MiB", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return dict(files=files, bytes=size, seconds=secs, peak_over_base=peak - base,
                shard_bytes=args.shard_mib * MiB, summary=summary)


def report(args, shape, plan, machine, r, steps, daemon_peaks, client_base, client_peak,
           budget, device_budget, peak_live, kill, export, need):
    timed = [s for s in steps if not s["first_of_session"]] or steps
    med = {k: statistics.median(s[k] for s in timed)
           for k in ("fwd_bwd_s", "opt_s", "step_s", "disk_s", "bytes_read", "bytes_written")}
    daemon_peak = max(daemon_peaks)
    moved = plan.read_bytes + plan.write_bytes
    measured = med["bytes_read"] + med["bytes_written"]
    print(f"\nmedian of steps {', '.join(str(s['step']) for s in timed)}: step {med['step_s']:.1f} s "
          f"(fwd+bwd {med['fwd_bwd_s']:.1f}, optimizer {med['opt_s']:.1f}); disk time at the "
          f"probe's rates {med['disk_s']:.1f} s")
    print(f"SSD a step: read {med['bytes_read'] / 1e9:.2f} GB, written "
          f"{med['bytes_written'] / 1e9:.2f} GB; the bytes that must move (plan: states read "
          f"and written, weights fetched twice and written, journal spilled) "
          f"{moved / 1e9:.2f} GB: measured / must = {measured / moved:.3f} (goal <= 1.2)")
    if not args.quick:
        print(f"plan's step {plan.step_s:.1f} s (binds: {plan.binding}; storage "
              f"{plan.bounds['storage']:.1f}, compute {plan.bounds['compute']:.1f}, kernel "
              f"{plan.bounds['kernel']:.1f}): measured / predicted = "
              f"{med['step_s'] / plan.step_s:.2f}")
    print(f"peak RSS: fuyoud {daemon_peak / MiB:.0f} MiB (budget {budget / MiB:.0f} + 256 = "
          f"{(budget + 256 * MiB) / MiB:.0f}: {'ok' if daemon_peak <= budget + 256 * MiB else 'OVER'}"
          f"); client {client_peak / MiB:.0f} MiB, +{(client_peak - client_base) / MiB:.0f} "
          f"over its {client_base / MiB:.0f} MiB before the model; stream peak live "
          f"{peak_live / MiB:.0f} MiB (device_budget {device_budget / MiB:.0f})")
    client_bound = client_base + CLIENT_OVER_BASE
    print(f"client bound: {client_base / MiB:.0f} MiB before the model + "
          f"{CLIENT_OVER_BASE / MiB:.0f} MiB (device_budget, two modules, activations, "
          f"slots): {'ok' if client_peak <= client_bound else 'OVER'}")
    losses = [s["loss"] for s in steps]
    per_batch = {}  # steps cycle over the batches: each batch's losses in turn
    for s in steps:
        per_batch.setdefault((s["step"] - 1) % 2, []).append(s["loss"])
    print(f"loss: {' '.join(f'{x:.3f}' for x in losses)}; by batch: " + "; ".join(
        f"{' -> '.join(f'{x:.3f}' for x in v)}"
        + ("" if len(v) < 2 else " (falls)" if v[-1] < v[0] else " (DOES NOT FALL)")
        for v in per_batch.values()))
    if kill:
        same = kill.get("loss_after") == kill["loss_before"]
        print(f"kill -9 at step {kill['step']}: resumed at step {kill['resumed_at']} (durable "
              f"{kill['durable_before']}, committed {kill['committed_before']} as the client last "
              f"heard), restart {kill['restart_s']:.1f} s; step {kill['step']}'s "
              f"loss {kill['loss_before']} before, {kill.get('loss_after')} after: "
              f"{'equal' if same else 'DIFFERENT'}")
    first = steps[0].get("first_step_total_s")
    print(f"time to the first step done (materialize + step 1): {first:.1f} s")
    return dict(args=vars(args), params=shape.params, states_bytes=12 * shape.params,
                host_total=machine.host_total, storage_needed=need, probe=r,
                kernel_params_per_s=machine.kernel_params_per_s,
                compute_flops=machine.compute_flops, steps=steps, median=med,
                plan=dict(read=plan.read_bytes, write=plan.write_bytes, step_s=plan.step_s,
                          bounds=plan.bounds, binding=plan.binding),
                traffic_ratio=measured / moved, daemon_peak_rss=daemon_peak,
                dram_budget=budget, client_peak_rss=client_peak, client_base_rss=client_base,
                peak_live=peak_live, device_budget=device_budget,
                kill={k: v for k, v in (kill or {}).items()}, export=export,
                first_step_total_s=first)


def growth_table(paths):
    """Item 4's table from the --json files of runs at several sizes: step time,
    SSD bytes and peak RSS against the model's size."""
    rows = [json.load(open(p)) for p in paths]
    rows.sort(key=lambda r: r["params"])
    for r in rows:  # the plan's bytes by today's arithmetic
        a = argparse.Namespace(**r["args"])
        shape = pm.shape_from_hf_config(llama_config(a).to_dict())
        work = pm.Workload(tokens=a.batch * a.seq, recompute=False)
        _, plan = plan_for(shape, work, r["probe"], r["kernel_params_per_s"], r["compute_flops"],
                           r["dram_budget"], r["storage_needed"])
        m = r["median"]
        r["traffic_ratio"] = (m["bytes_read"] + m["bytes_written"]) / (plan.read_bytes
                                                                        + plan.write_bytes)
        r["step_ratio"] = m["step_s"] / plan.step_s
    print("| params | fp32 states | step s (fwd+bwd / opt) | SSD read + written a step | "
          "/ plan's bytes | disk s at the probe's rates | step / plan's | fuyoud peak RSS | "
          "client peak RSS (+ over base) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["median"]
        print(f"| {r['params'] / 1e6:.0f}M | {r['states_bytes'] / GiB:.1f} GiB | "
              f"{m['step_s']:.1f} ({m['fwd_bwd_s']:.1f} / {m['opt_s']:.1f}) | "
              f"{m['bytes_read'] / 1e9:.2f} + {m['bytes_written'] / 1e9:.2f} GB | "
              f"{r['traffic_ratio']:.2f} | {m['disk_s']:.1f} | {r['step_ratio']:.2f} | "
              f"{r['daemon_peak_rss'] / MiB:.0f} MiB | {r['client_peak_rss'] / MiB:.0f} MiB "
              f"(+{(r['client_peak_rss'] - r['client_base_rss']) / MiB:.0f}) |")
    print(f"{rows[-1]['params'] / rows[0]['params']:.0f}x the parameters")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        growth_table(sys.argv[2:])
    else:
        main()
