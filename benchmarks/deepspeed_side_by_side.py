#!/usr/bin/env python3
"""DeepSpeed beside fuyou, on this machine, in one run: the CPU Adam kernel, the
NVMe I/O engine and ZeRO-Infinity training the main job's model.

    benchmarks/deepspeed_side_by_side.sh [--parts kernel,io,zero3] [--json PATH] ...

(the wrapper makes benchmarks/.venv-deepspeed with `deepspeed` from PyPI and runs
this script in it; deepspeed is not a dependency of fuyou). Three parts:

kernel  DeepSpeedCPUAdam (JIT-built by its CPUAdamBuilder: AVX-512/AVX2, OpenMP)
        against fuyou's AdamWKernel (build/benchmarks/adamw_bench, its fp32 row:
        fp32 gradient, no weights output, the bytes DeepSpeed's kernel moves:
        28 B/elem) and its Adam-shaped bandwidth probe, --n elements (DeepSpeed's
        in --tensors tensors), at each --threads count (DeepSpeed: OMP_NUM_THREADS).
        --rounds interleaved rounds, the order alternating; best and median.
io      DeepSpeed's aio_handle (AsyncIOBuilder, libaio, O_DIRECT, page-locked
        buffer; sync_pwrite / sync_pread of one --io-size file, its size reserved
        with fallocate first as fuyou's StateFile::Reserve does; a write extending
        a new file is reported apart) against fuyou's IoEngine
        (build/benchmarks/io_bench: a sequential write then read of a file of the
        same size, the same request size and queue depth, with its plain io_uring
        loop and fio beside it). --io-repeat rounds, best of each.
zero3   The main job (deploy/main-job.sh, SKIP_BUILD=1: fuyou.AdamW, an embedded
        fuyoud with a 64 MiB DRAM budget) against DeepSpeed ZeRO-3 with
        offload_optimizer and offload_param to NVMe (ZeRO-Infinity; DeepSpeedCPUAdam
        does the update) on the CPU accelerator (DS_ACCELERATOR=cpu, one process,
        gloo), training the model the main job trains (finetune_gpt.py's model,
        preset, corpus, batch, sequence length, lr schedule, betas, weight decay)
        from the same base checkpoint, for the same steps. Per side: steady
        tokens/s, SSD bytes a step (fuyou: the daemon's counters; DeepSpeed: its
        process's /proc/self/io over the measured steps) and peak host memory (the
        sum of VmHWM over the run's processes: client + fuyoud; the DeepSpeed process).
        --zero3-variants adds "opt-nvme" (offload_optimizer to NVMe only, the
        weights kept in memory as fuyou's main job keeps them).

A part DeepSpeed cannot run here is reported with its exact error, in the table
and the JSON. Scratch files go under --work-dir (runs/deepspeed-side-by-side) and
are deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "python_client" / "examples"
PARTS = ("kernel", "io", "zero3")
ZERO3_VARIANTS = ("infinity", "opt-nvme")


def parse_bytes(text: str) -> int:
    """'1G', '64MiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: kernel, io, zero3")
    ap.add_argument("--build", type=pathlib.Path, default=ROOT / "build",
                    help="fuyou's CMake build directory (benchmarks/adamw_bench, io_bench)")
    ap.add_argument("--work-dir", type=pathlib.Path, default=ROOT / "runs" / "deepspeed-side-by-side",
                    help="scratch files: the I/O test files, the NVMe swap folders, the runs")
    ap.add_argument("--keep", action="store_true", help="keep --work-dir's files")
    ap.add_argument("--json", type=pathlib.Path, help="write every figure here")
    k = ap.add_argument_group("kernel")
    k.add_argument("--n", type=int, default=64 << 20, help="elements")
    k.add_argument("--tensors", type=int, default=16, help="DeepSpeed's parameters the n elements form")
    k.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    k.add_argument("--reps", type=int, default=5, help="timed steps per side per round")
    k.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    i = ap.add_argument_group("io")
    i.add_argument("--io-size", default="1G", help="file size (K, M, G suffixes)")
    i.add_argument("--bs", default="1M", help="request size (DeepSpeed's aio block_size)")
    i.add_argument("--qd", type=int, default=32, help="queue depth, both sides")
    i.add_argument("--io-repeat", type=int, default=2, help="rounds, best of each")
    i.add_argument("--fio", default="fio", help="fio for io_bench's column ('none': skip)")
    z = ap.add_argument_group("zero3")
    z.add_argument("--steps", type=int, default=60, help="training steps, both sides (the main job's)")
    z.add_argument("--zero3-variants", default="infinity",
                   help="comma-separated: infinity (offload_optimizer + offload_param to NVMe), "
                        "opt-nvme (offload_optimizer to NVMe only)")
    z.add_argument("--ds-param-buffer", type=int, default=100_000_000,
                   help="infinity: elements a DeepSpeed parameter swap buffer holds (5 buffers; "
                        "DeepSpeed's default 1e8 holds a small model's every weight, so none "
                        "is read from the SSD a step; 1e6 streams them)")
    z.add_argument("--skip-steps", type=int, default=6,
                   help="DeepSpeed's first steps left out of its steady tokens/s (the main "
                        "job leaves out its first step and its --serial-steps 5 + 1)")
    ap.add_argument("--child", choices=["adam", "aio", "zero3"], help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    for p in args.parts:
        if p not in PARTS:
            ap.error(f"--parts: unknown part {p!r} (choose from {', '.join(PARTS)})")
    try:
        args.thread_counts = [int(t) for t in args.threads.split(",")]
        args.io_bytes, args.bs_bytes = parse_bytes(args.io_size), parse_bytes(args.bs)
    except ValueError as e:
        ap.error(f"--threads, --io-size, --bs: {e}")
    if min(args.thread_counts) < 1 or args.n < 64 or args.tensors < 1 or args.reps < 1 \
            or args.rounds < 1 or args.io_repeat < 1 or args.steps < 1 or args.qd < 1:
        ap.error("--threads, --n (>= 64), --tensors, --reps, --rounds, --io-repeat, --steps "
                 "and --qd must be positive")
    if args.bs_bytes % 4096 or args.io_bytes % args.bs_bytes:
        ap.error("--bs must be a multiple of 4096 and --io-size a multiple of --bs")
    args.variants = [v for v in args.zero3_variants.split(",") if v]
    for v in args.variants:
        if v not in ZERO3_VARIANTS:
            ap.error(f"--zero3-variants: unknown {v!r} (choose from {', '.join(ZERO3_VARIANTS)})")
    if args.ds_param_buffer < 1:
        ap.error("--ds-param-buffer must be positive")
    if args.skip_steps >= args.steps:
        ap.error("--skip-steps must be below --steps")
    return args


def median(values: List[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def run_child(kind: str, child_args: dict, env: Optional[dict] = None, timeout: float = 3600):
    """Runs this script as a child (a fresh process: its own OpenMP threads, its
    own peak memory) and returns (its JSON result, None) or (None, its error)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", kind,
           "--child-args", json.dumps(dict(child_args, out=out))]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        text = pathlib.Path(out).read_text()
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    finally:
        pathlib.Path(out).unlink(missing_ok=True)
    result = json.loads(text) if text.strip() else None
    if proc.returncode != 0 or result is None or "error" in (result or {}):
        error = (result or {}).get("error") or last_line(proc.stderr or proc.stdout)
        sys.stderr.write(proc.stderr[-4000:])
        return None, f"{error} (exit {proc.returncode})"
    return result, None


# --- process tree: peak memory and I/O ------------------------------------------

class ProcessTreeWatch:
    """Samples, every `interval` s, each process under `root_pid` (itself included):
    its VmHWM (peak resident set) and /proc/<pid>/io read_bytes / write_bytes (the
    block-layer bytes, O_DIRECT included). Peaks are per process; their sum bounds
    the tree's peak from above."""

    def __init__(self, root_pid: int, interval: float = 0.25):
        self.root, self.interval = root_pid, interval
        self.procs: Dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _children(self) -> Dict[int, List[int]]:
        kids: Dict[int, List[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
        return kids

    def sample(self) -> None:
        kids = self._children()
        todo, seen = [self.root], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo += kids.get(pid, [])
            rec = self.procs.setdefault(pid, {"hwm": 0, "read": 0, "write": 0, "name": "?"})
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("Name:"):
                            rec["name"] = line.split()[1]
                        elif line.startswith("VmHWM:"):
                            rec["hwm"] = max(rec["hwm"], int(line.split()[1]) * 1024)
                with open(f"/proc/{pid}/io") as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        if key == "read_bytes":
                            rec["read"] = max(rec["read"], int(value))
                        elif key == "write_bytes":
                            rec["write"] = max(rec["write"], int(value))
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        procs = {f"{r['name']}[{pid}]": r for pid, r in self.procs.items() if r["hwm"]}
        big = {k: r for k, r in procs.items() if r["hwm"] > 64 << 20}
        return {"peak_rss_sum_bytes": sum(r["hwm"] for r in big.values()),
                "processes": {k: {"peak_rss_bytes": r["hwm"], "read_bytes": r["read"],
                                  "write_bytes": r["write"]} for k, r in big.items()}}


def self_io() -> Dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value)
    return out


def self_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# --- children (run inside the DeepSpeed venv) -----------------------------------

def child_adam(a: dict) -> dict:
    """DeepSpeedCPUAdam over a["n"] fp32 elements in a["tensors"] parameters:
    a["reps"] timed steps after one warm-up step (the JIT build, timed apart)."""
    import torch
    t0 = time.perf_counter()
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load()
    load_s = time.perf_counter() - t0
    n, tensors = a["n"], a["tensors"]
    per = n // tensors
    sizes = [per] * tensors
    sizes[-1] += n - per * tensors
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.rand(s, generator=g) * 2 - 1) for s in sizes]
    for p in params:
        p.grad = (torch.rand(p.shape, generator=g) * 2 - 1) * 0.01
    opt = DeepSpeedCPUAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                           adamw_mode=True)
    opt.step()  # allocates m and v
    opt.step()
    secs = []
    for _ in range(a["reps"]):
        t = time.perf_counter()
        opt.step()
        secs.append(time.perf_counter() - t)
    return {"seconds": secs, "load_s": load_s, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "simd": CPUAdamBuilder().simd_width(), "march": CPUAdamBuilder().cpu_arch()}


def child_aio(a: dict) -> dict:
    """DeepSpeed's aio_handle: sync_pwrite of a new file, then of a reserved (fallocate) one, and sync_pread of it, a["size"] bytes,
    from a page-locked buffer (O_DIRECT), block_size a["bs"], queue_depth a["qd"]."""
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=True):
        return {"error": "AsyncIOBuilder().is_compatible() is False (libaio-dev missing?)"}
    t0 = time.perf_counter()
    aio = builder.load()
    load_s = time.perf_counter() - t0
    handle = aio.aio_handle(block_size=a["bs"], queue_depth=a["qd"], single_submit=False,
                            overlap_events=True, intra_op_parallelism=1)
    buf = handle.new_cpu_locked_tensor(a["size"], torch.empty(0, dtype=torch.uint8))
    buf.fill_(0x5A)
    path = a["path"]
    rows = {}

    def timed(op: str) -> float:
        t = time.perf_counter()
        done = handle.sync_pwrite(buf, path) if op == "write" else handle.sync_pread(buf, path)
        if done < 0:
            raise RuntimeError(f"aio_handle.sync_p{op} returned {done}")
        return a["size"] / (time.perf_counter() - t) / 1e9

    try:
        # A new file, extended by the writes (how ZeRO-Infinity's swap files start).
        rows["write_new"] = timed("write")
        # The file fuyou's engine writes: its size reserved first (StateFile::Reserve's
        # fallocate); aio_handle opens without O_TRUNC, so the reservation stays.
        pathlib.Path(path).unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, a["size"])
        finally:
            os.close(fd)
        rows["write"] = timed("write")
        rows["read"] = timed("read")
        if int(buf[: 1 << 20].ne(0x5A).sum()) != 0:
            return {"error": "aio read back different bytes"}
    finally:
        pathlib.Path(path).unlink(missing_ok=True)
        handle.free_cpu_locked_tensor(buf)
    return {"write_gbps": rows["write"], "read_gbps": rows["read"],
            "write_new_file_gbps": rows["write_new"], "load_s": load_s,
            "alignment": handle.get_alignment()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_zero3(a: dict) -> dict:
    """ZeRO-3 training of the main job's model with DeepSpeed, one process on the CPU
    accelerator; a["variant"]: infinity (optimizer and parameters on NVMe) or
    opt-nvme (optimizer only)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    import torch
    sys.path.insert(0, str(EXAMPLES))
    import finetune_gpt as ft  # the main job's script: model, corpus, schedule
    import deepspeed

    job = a["job"]  # the main job's arguments, as finetune_gpt parsed them
    torch.manual_seed(job["seed"])
    parsed = ft.parse_args(job["argv"])
    if hasattr(ft, "build_model"):  # --arch llama (transformers) or gpt
        model = ft.build_model(parsed)
    else:
        model = ft.GPT(ft.PRESETS[job["model"]])
    ckpt = torch.load(a["checkpoint"], map_location="cpu")
    model.load_state_dict(ckpt["model"])
    n_params = model.num_parameters()
    nvme = a["nvme_dir"]
    offload_param = ({"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                      "buffer_count": 5, "buffer_size": a["param_buffer"]}
                     if a["variant"] == "infinity" else {"device": "none"})
    config = {
        "train_micro_batch_size_per_gpu": job["batch_size"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {
            "lr": job["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
            "weight_decay": job["weight_decay"]}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                                  "buffer_count": 4},
            "offload_param": offload_param,
        },
        "aio": {"block_size": a["bs"], "queue_depth": a["qd"], "single_submit": False,
                "overlap_events": True, "intra_op_parallelism": 1},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if job.get("grad_clip", 0) > 0:
        config["gradient_clipping"] = job["grad_clip"]
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config, dist_init_required=True)
    init_s = time.perf_counter() - t0
    if hasattr(engine.module, "tok_emb"):
        # gpt.py's tied LM head reads tok_emb.weight in GPT.forward, outside tok_emb's
        # own forward: DeepSpeed's documented registration for such a parameter.
        deepspeed.zero.register_external_parameter(engine.module, engine.module.tok_emb.weight)

    tok = ft.ByteTokenizer()
    data = ft.TextDataset(ft.FINETUNE_CORPUS, tok)
    gen = torch.Generator().manual_seed(job["seed"] + 1)  # finetune_gpt's fine-tuning seed
    steps, bsz, seq = a["steps"], job["batch_size"], job["seq_len"]
    step_s, losses, io_at = [], [], {}
    for i in range(steps):
        if i == a["skip"]:
            io_at["start"] = self_io()
            t_measured = time.perf_counter()
        t = time.perf_counter()
        lr = ft.lr_at(i, steps, job["lr"], job["warmup"])
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        x, y = data.train_batch(bsz, seq, gen)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - t)
        losses.append(loss.item())
        if (i + 1) % 10 == 0:
            print(f"deepspeed zero3 step {i + 1}/{steps} loss={loss.item():.3f} "
                  f"{step_s[-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    measured_s = time.perf_counter() - t_measured
    io_at["end"] = self_io()
    measured = steps - a["skip"]
    engine.eval()
    with torch.no_grad():
        val = [engine(x, y)[1].item()
               for x, y in data.val_batches(job["eval_batches"], bsz, seq)]
    return {
        "variant": a["variant"], "parameters": n_params, "model": type(model).__name__, "deepspeed": deepspeed.__version__,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "init_s": init_s, "step_s": step_s, "losses": losses,
        "tokens_per_second_steady": bsz * seq * measured / measured_s,
        "tokens_per_second_all": bsz * seq * steps / sum(step_s),
        "ssd_read_per_step": (io_at["end"]["read_bytes"] - io_at["start"]["read_bytes"]) / measured,
        "ssd_written_per_step": (io_at["end"]["write_bytes"] - io_at["start"]["write_bytes"]) / measured,
        "peak_rss_bytes": self_hwm(), "heldout_loss_after": sum(val) / len(val),
        "config": config,
    }


def child_main(kind: str, a: dict) -> int:
    out = pathlib.Path(a["out"])
    try:
        result = {"adam": child_adam, "aio": child_aio, "zero3": child_zero3}[kind](a)
    except BaseException as e:  # noqa: BLE001: the error is the result
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}".strip()[:2000]}
    out.write_text(json.dumps(result, default=str))
    # DeepSpeed's and gloo's threads can hang interpreter teardown: the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "error" not in result else 1)


# --- parts (the parent) ----------------------------------------------------------

def part_kernel(args) -> dict:
    bench = args.build / "benchmarks" / "adamw_bench"
    if not os.access(bench, os.X_OK):
        return {"error": f"no adamw_bench at {bench} (cmake --build build --target adamw_bench)"}
    ours: List[dict] = []
    ds: Dict[int, List[List[float]]] = {t: [] for t in args.thread_counts}
    ds_info: dict = {}
    ds_error = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["ours", "deepspeed"] if r % 2 == 0 else ["deepspeed", "ours"]
            for who in order:
                if who == "ours":
                    path = os.path.join(tmp, f"adamw.{r}.json")
                    subprocess.run([str(bench), f"--n={args.n}", f"--threads={args.threads}",
                                    f"--reps={args.reps}", f"--json={path}"], check=True,
                                   stdout=subprocess.DEVNULL)
                    ours.append(json.loads(pathlib.Path(path).read_text()))
                elif ds_error is None:
                    for t in args.thread_counts:
                        res, ds_error = run_child("adam", {"n": args.n, "tensors": args.tensors,
                                                           "reps": args.reps},
                                                  env={"OMP_NUM_THREADS": str(t)})
                        if ds_error:
                            print(f"kernel: DeepSpeedCPUAdam failed: {ds_error}", flush=True)
                            break
                        ds[t].append(res["seconds"])
                        ds_info = {k: res[k] for k in ("simd", "march")}
                        ds_info.setdefault("first_load_s", res["load_s"])
            print(f"  kernel round {r + 1}/{args.rounds} ({' then '.join(order)})", flush=True)
    rows = []
    for t in args.thread_counts:
        def ours_row(variant):
            same = [next(x for x in b["rows"] if x["threads"] == t and x["variant"] == variant)
                    for b in ours]
            return same
        fp32, probe = ours_row("fp32"), ours_row("probe")
        row = {"threads": t,
               "fuyou_best_s": min(x["best_seconds"] for x in fp32),
               "fuyou_median_s": median([x["median_seconds"] for x in fp32]),
               "probe_best_s": min(x["best_seconds"] for x in probe)}
        if ds[t]:
            flat = [s for rnd in ds[t] for s in rnd]
            row.update(ds_best_s=min(flat), ds_median_s=median(flat),
                       # paired: each round's DeepSpeed median over the same round's fuyou median
                       paired=median([median(d) / fp32[i]["median_seconds"]
                                      for i, d in enumerate(ds[t]) if i < len(fp32)]))
            row["fuyou_over_ds"] = row["ds_best_s"] / row["fuyou_best_s"]
        rows.append(row)
    return {"n": args.n, "bytes_per_elem": 28, "isa": ours[0]["isa"], "deepspeed": ds_info,
            "rows": rows, "error": ds_error}


def part_io(args) -> dict:
    bench = args.build / "benchmarks" / "io_bench"
    if not os.access(bench, os.X_OK):
        return {"error": f"no io_bench at {bench} (cmake --build build --target io_bench)"}
    io_dir = args.work_dir / "io"
    io_dir.mkdir(parents=True, exist_ok=True)
    best = {"ours": {"write": 0.0, "read": 0.0}, "plain": {"write": 0.0, "read": 0.0},
            "fio": {"write": 0.0, "read": 0.0}, "deepspeed": {"write": 0.0, "read": 0.0}}
    ds_error = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.io_repeat):
            order = ["ours", "deepspeed"] if r % 2 == 0 else ["deepspeed", "ours"]
            for who in order:
                if who == "ours":
                    path = os.path.join(tmp, f"io.{r}.json")
                    subprocess.run([str(bench), f"--dir={io_dir}", f"--size={args.io_bytes}",
                                    f"--bs={args.bs_bytes}", f"--qd={args.qd}", "--repeat=1",
                                    f"--json={path}", f"--fio={args.fio}"], check=True,
                                   stdout=subprocess.DEVNULL)
                    for row in json.loads(pathlib.Path(path).read_text())["results"]:
                        for side, key in (("ours", "ours_gbps"), ("plain", "plain_loop_gbps"),
                                          ("fio", "fio_gbps")):
                            best[side][row["op"]] = max(best[side][row["op"]], row[key])
                elif ds_error is None:
                    res, ds_error = run_child("aio", {"size": args.io_bytes, "bs": args.bs_bytes,
                                                      "qd": args.qd,
                                                      "path": str(io_dir / "deepspeed_aio.dat")})
                    if ds_error:
                        print(f"io: DeepSpeed aio failed: {ds_error}", flush=True)
                    else:
                        for op in ("write", "read", "write_new_file"):
                            best["deepspeed"][op] = max(best["deepspeed"].get(op, 0.0), res[f"{op}_gbps"])
            print(f"  io round {r + 1}/{args.io_repeat} ({' then '.join(order)})", flush=True)
    shutil.rmtree(io_dir, ignore_errors=True)
    return {"size_bytes": args.io_bytes, "request_bytes": args.bs_bytes, "queue_depth": args.qd,
            "gbps": best, "error": ds_error}


def main_job_args() -> dict:
    """The main job's arguments as finetune_gpt.py parses deploy/main-job.sh's line."""
    sys.path.insert(0, str(EXAMPLES))
    import finetune_gpt as ft
    script = (ROOT / "deploy" / "main-job.sh").read_text()
    line = script.rsplit("python_client/examples/finetune_gpt.py", 1)[1].split("${args", 1)[0]
    argv = line.replace("\\\n", " ").split()
    parsed = ft.parse_args(argv)
    return {"argv": argv, "model": parsed.model, "batch_size": parsed.batch_size,
            "seq_len": parsed.seq_len, "lr": parsed.lr, "weight_decay": parsed.weight_decay,
            "warmup": parsed.warmup, "seed": parsed.seed, "steps": parsed.steps,
            "grad_clip": parsed.grad_clip, "eval_batches": parsed.eval_batches,
            "dram_budget": parsed.dram_budget}


def run_main_job(args, extra: List[str], out_dir: pathlib.Path, data_dir: pathlib.Path, log: pathlib.Path):
    """deploy/main-job.sh with SKIP_BUILD=1, its own fuyoud data folder, watched."""
    env = {**os.environ, "SKIP_BUILD": "1", "FUYOU_DATA_DIR": str(data_dir)}
    env.pop("PYTHONPATH", None)
    env.pop("DS_ACCELERATOR", None)
    with open(log, "w") as f:
        proc = subprocess.Popen([str(ROOT / "deploy" / "main-job.sh"), "--out-dir", str(out_dir),
                                 "--no-progress", *extra], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
        watch = ProcessTreeWatch(proc.pid)
        rc = proc.wait()
        tree = watch.stop()
    return rc, tree


def part_zero3(args) -> dict:
    job = main_job_args()
    steps = args.steps
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"main_job_argv": job["argv"], "steps": steps, "model": job["model"]}
    # 1. The base model both sides fine-tune: the main job's base training, once.
    base_dir = work / "base"
    rc, _ = run_main_job(args, ["--optimizer", "torch", "--steps", "1", "--serial-steps", "0",
                                "--compare-steps", "0", "--job", "ds-side-by-side-base"],
                         base_dir, work / "fuyou-data-base", work / "base.log")
    if rc != 0 or not (base_dir / "base.pt").exists():
        return {"error": f"the main job's base training failed (exit {rc}): see {work / 'base.log'}"}
    # 2. fuyou: the main job itself, from that base, without its torch comparison.
    fy_dir = work / "fuyou"
    print(f"  zero3: fuyou's main job, {steps} steps", flush=True)
    rc, tree = run_main_job(args, ["--checkpoint", str(base_dir / "base.pt"), "--steps", str(steps),
                                   "--compare-steps", "0", "--job", "ds-side-by-side-fuyou"],
                            fy_dir, work / "fuyou-data", work / "fuyou.log")
    metrics_path = fy_dir / "metrics.json"
    if rc != 0 or not metrics_path.exists():
        result["fuyou"] = {"error": f"main job failed (exit {rc}): {last_line((work / 'fuyou.log').read_text())}"}
    else:
        m = json.loads(metrics_path.read_text())
        s = m["summary"]
        n = s["steps"]
        daemon = {k: v for k, v in tree["processes"].items() if k.startswith("fuyoud")}
        result["fuyou"] = {
            "tokens_per_second_steady": s["fuyou_tokens_per_second_overlapped"],
            "tokens_per_second_all": s["fuyou_tokens_per_second"],
            "ssd_read_per_step": (s["ssd_bytes_read"] or 0) / n,
            "ssd_written_per_step": (s["ssd_bytes_written"] or 0) / n,
            "daemon_proc_io": daemon,
            "peak_rss_bytes": tree["peak_rss_sum_bytes"], "processes": tree["processes"],
            "heldout_loss_after": m.get("finetune_loss_after"), "parameters": m.get("parameters"),
            "dram_budget_bytes": s.get("dram_budget_bytes"), "overlap": s.get("overlap"),
        }
    shutil.rmtree(work / "fuyou-data", ignore_errors=True)
    shutil.rmtree(work / "fuyou-data-base", ignore_errors=True)
    # 3. DeepSpeed ZeRO-3, each variant in a fresh process.
    for variant in args.variants:
        nvme = work / f"ds-nvme-{variant}"
        nvme.mkdir(parents=True, exist_ok=True)
        print(f"  zero3: DeepSpeed ZeRO-3 ({variant}), {steps} steps", flush=True)
        res, err = run_child("zero3", {"variant": variant, "job": job, "steps": steps,
                                       "skip": args.skip_steps,
                                       "checkpoint": str(base_dir / "base.pt"),
                                       "nvme_dir": str(nvme), "bs": args.bs_bytes, "qd": args.qd,
                                       "param_buffer": args.ds_param_buffer},
                             env={"DS_ACCELERATOR": "cpu"})
        shutil.rmtree(nvme, ignore_errors=True)
        if err:
            print(f"  zero3 ({variant}): DeepSpeed failed: {err}", flush=True)
        result[f"deepspeed_{variant}"] = res if res else {"error": err}
    return result


# --- report -------------------------------------------------------------------

def fmt_gb(v: float) -> str:
    return f"{v / 1e9:.3f} GB"


def report(args, results: dict) -> str:
    lines = []
    if "kernel" in results:
        k = results["kernel"]
        lines.append(f"\n(a) AdamW kernel, n={args.n:,} fp32 elements, 28 B/elem (p, g, m, v in; "
                     f"p, m, v out), best of {args.rounds} rounds x {args.reps} steps")
        if k.get("rows"):
            lines.append(f"{'threads':>7} {'fuyou ms':>9} {'Gelem/s':>8} {'GB/s':>6} "
                         f"{'DeepSpeed ms':>12} {'Gelem/s':>8} {'GB/s':>6} {'fuyou/DS':>8} "
                         f"{'paired':>6} {'fuyou/probe':>11}")
            for r in k["rows"]:
                f_eps = args.n / r["fuyou_best_s"]
                ds = (f"{r['ds_best_s'] * 1e3:12.1f} {args.n / r['ds_best_s'] / 1e9:8.3f} "
                      f"{args.n * 28 / r['ds_best_s'] / 1e9:6.2f} {r['fuyou_over_ds']:8.2f} "
                      f"{r['paired']:6.2f}" if "ds_best_s" in r else f"{'not run':>12}")
                lines.append(f"{r['threads']:>7} {r['fuyou_best_s'] * 1e3:9.1f} {f_eps / 1e9:8.3f} "
                             f"{args.n * 28 / r['fuyou_best_s'] / 1e9:6.2f} {ds} "
                             f"{r['probe_best_s'] / r['fuyou_best_s']:11.2f}")
        if k.get("error"):
            lines.append(f"DeepSpeedCPUAdam: {k['error']}")
    if "io" in results:
        io = results["io"]
        lines.append(f"\n(b) NVMe I/O, one {args.io_bytes >> 20} MiB file, {args.bs_bytes >> 10} KiB "
                     f"requests, queue depth {args.qd}, O_DIRECT, best of {args.io_repeat}")
        if "gbps" in io:
            g = io["gbps"]
            lines.append(f"{'op':<6} {'fuyou GB/s':>10} {'DeepSpeed GB/s':>14} {'fuyou/DS':>8} "
                         f"{'io_uring loop':>13} {'fio':>6}")
            for op in ("write", "read"):
                ds = g["deepspeed"][op]
                lines.append(f"{op:<6} {g['ours'][op]:10.3f} "
                             + (f"{ds:14.3f} {g['ours'][op] / ds:8.2f}" if ds else f"{'not run':>14} {'-':>8}")
                             + f" {g['plain'][op]:13.3f} {g['fio'][op]:6.3f}")
            if g["deepspeed"].get("write_new_file"):
                lines.append(f"DeepSpeed writing a new file (extended by its writes, no reservation): "
                             f"{g['deepspeed']['write_new_file']:.3f} GB/s")
        if io.get("error"):
            lines.append(f"DeepSpeed aio: {io['error']}")
    if "zero3" in results:
        z = results["zero3"]
        lines.append(f"\n(c) the main job's model ({z.get('model')}), {z.get('steps')} steps, "
                     "CPU only: fuyou.AdamW + fuyoud vs DeepSpeed ZeRO-3 NVMe offload")
        if z.get("error"):
            lines.append(f"error: {z['error']}")
        sides = [("fuyou main job", z.get("fuyou"))] + [
            (f"DeepSpeed ZeRO-3 {v}", z.get(f"deepspeed_{v}")) for v in args.variants]
        lines.append(f"{'side':<26} {'tokens/s':>9} {'SSD read/step':>14} {'written/step':>13} "
                     f"{'peak host mem':>14} {'held-out loss':>13}")
        fy = z.get("fuyou") or {}
        for name, s in sides:
            if not s or s.get("error"):
                lines.append(f"{name:<26} not run: {(s or {}).get('error', 'not run')}")
                continue
            lines.append(f"{name:<26} {s['tokens_per_second_steady']:9.0f} "
                         f"{s['ssd_read_per_step'] / 1e6:11.1f} MB {s['ssd_written_per_step'] / 1e6:10.1f} MB "
                         f"{s['peak_rss_bytes'] / 2 ** 20:10.0f} MiB {s.get('heldout_loss_after') or 0:13.3f}")
        for v in args.variants:
            d = z.get(f"deepspeed_{v}") or {}
            if fy.get("tokens_per_second_steady") and d.get("tokens_per_second_steady"):
                lines.append(f"fuyou / DeepSpeed ({v}): tokens/s "
                             f"{fy['tokens_per_second_steady'] / d['tokens_per_second_steady']:.2f}x, "
                             f"SSD bytes a step {(fy['ssd_read_per_step'] + fy['ssd_written_per_step']) / max(d['ssd_read_per_step'] + d['ssd_written_per_step'], 1):.2f}x, "
                             f"peak host memory {fy['peak_rss_bytes'] / d['peak_rss_bytes']:.2f}x")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, json.loads(args.child_args))
    try:
        import deepspeed  # noqa: F401: fail early, with the reason
        ds_version = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        sys.exit(f"deepspeed_side_by_side: cannot import deepspeed ({type(e).__name__}: {e}); "
                 "run it through benchmarks/deepspeed_side_by_side.sh")
    import torch
    print(f"deepspeed {ds_version}, torch {torch.__version__}, DS_ACCELERATOR="
          f"{os.environ.get('DS_ACCELERATOR')}, {os.cpu_count()} CPUs; parts: {', '.join(args.parts)}",
          flush=True)
    results: dict = {"deepspeed": ds_version, "torch": torch.__version__, "argv": sys.argv[1:]}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        for part in args.parts:
            t0 = time.perf_counter()
            print(f"{part}:", flush=True)
            results[part] = {"kernel": part_kernel, "io": part_io, "zero3": part_zero3}[part](args)
            results[part]["seconds"] = time.perf_counter() - t0
    finally:
        if not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    print(report(args, results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
