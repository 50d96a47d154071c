#!/usr/bin/env python3
"""Data-parallel scaling of fuyou.AdamW (issue 24): the example GPT trained by
1, 2 (and 3) gloo ranks on one node, the same global batch split between them,
each rank on its own fixed thread budget, one fuyoud for the node.

    .venv/bin/python benchmarks/dp_bench.py --fuyoud BUILD/daemon/fuyoud \\
        [--ranks 1,2,3] [--threads-per-rank 1] [--daemon-threads 1] \\
        [--model tiny] [--global-batch 12] [--seq-len 64] [--steps 6] [--warmup 2] \\
        [--chunk-bytes 1048576] [--ddp | --offload-params] [--json [PATH]]

For each world size w the ranks are subprocesses (this script with --worker)
joined over a FileStore; each calls torch.set_num_threads(--threads-per-rank)
and trains --global-batch / w sequences a step (--global-batch must divide by
every w), with fuyou.AdamW on one fuyoud this script starts with
--threads --daemon-threads. ``--ddp`` wraps the model in DDP (DDP's all-reduce,
fuyou reduces nothing); without it fuyou all-reduces each chunk
during backward (fuyou/_dp_overlap.py). ``--offload-params``: the streamed
mode (``offload_params=True``, ``fuyou.stream_parameters``; each chunk
all-reduced during backward, fuyou/_dp_pass_reductions.py). Reported per w: the mean step time of
the steps after --warmup (rank 0's; every step ends in collectives, so the
ranks keep pace), tokens/s of the global batch, the speedup over w=1 and the
scaling efficiency speedup / w, and the reductions started during backward.

Bounds: the cores. w ranks use w x --threads-per-rank cores for forward and
backward, plus the daemon's --daemon-threads and gloo's threads; on a machine
with fewer cores than that the ranks share them and the efficiency measures
the sharing, not data parallelism (the table says how many cores it wanted).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
sys.path.insert(0, str(ROOT / "python_client" / "examples"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuyoud", default=os.environ.get("FUYOU_DAEMON"),
                    help="fuyoud binary (default $FUYOU_DAEMON)")
    ap.add_argument("--ranks", default="1,2,3", help="world sizes to run, comma-separated")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--daemon-threads", type=int, default=1, help="fuyoud --threads")
    ap.add_argument("--model", default="tiny", help="a preset of python_client/examples/gpt.py")
    ap.add_argument("--global-batch", type=int, default=12, help="sequences a step, all ranks")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--ddp", action="store_true", help="wrap the model in DDP")
    ap.add_argument("--offload-params", action="store_true",
                    help="the streamed mode: fuyou.stream_parameters (not with --ddp)")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="write the results as JSON to PATH (or stdout without one)")
    # one rank (internal)
    ap.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "STORE", "OUT"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------- one rank
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import fuyou
    from gpt import GPT, PRESETS

    rank, world, store, out = int(args.worker[0]), int(args.worker[1]), args.worker[2], args.worker[3]
    torch.set_num_threads(args.threads_per_rank)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    if args.offload_params:  # its tied LM head a module: a streamed module fetches its own
        from param_stream_bench import StreamableGPT
        model = StreamableGPT(PRESETS[args.model])
    else:
        model = GPT(PRESETS[args.model])
    trained = model
    if args.ddp and world > 1:  # gloo broadcasts no bool tensors: the masks stay out
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, b in model.named_buffers() if b.dtype == torch.bool])
        trained = torch.nn.parallel.DistributedDataParallel(model)
    opt = fuyou.AdamW(model.parameters(), lr=1e-4, job=f"dpbench-w{world}",
                      address=args.address, chunk_bytes=args.chunk_bytes,
                      offload_params=args.offload_params)
    if args.offload_params:
        fuyou.stream_parameters(model, opt)
    per_rank = args.global_batch // world
    gen = torch.Generator().manual_seed(1000 + rank)
    times = []
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, 256, (per_rank, args.seq_len), generator=gen)
            y = torch.randint(0, 256, (per_rank, args.seq_len), generator=gen)
            started = time.perf_counter()
            _, loss = trained(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
        reductions = getattr(opt._mode, "reductions", None)
        result = {"rank": rank, "step_s": times[args.warmup:],
                  "chunks": len(opt._data_parallel.all_chunks) if opt._data_parallel
                  else opt.num_chunks,
                  "started_in_backward": _started_in_backward(reductions),
                  "rounds_found_ddp": getattr(reductions.counts, "rounds_found_ddp", None)
                  if reductions else None,
                  # the durable gate (_dp_durable.py): seconds waited in all steps, gates passed
                  "durable_wait_s": getattr(opt.loop_stats, "durable_wait_seconds", None),
                  "durable_gates": getattr(opt.loop_stats, "durable_gates", None)}
    finally:
        opt.close()
        dist.destroy_process_group()
    pathlib.Path(out).write_text(json.dumps(result))


def _started_in_backward(reductions):
    """Chunk reductions started during backward (either mode's counters)."""
    if reductions is None:
        return None
    counts = reductions.counts  # in a hook, or at the end of the pass (inside backward)
    in_hooks = getattr(counts, "started_in_backward", None)
    if in_hooks is None:
        in_hooks = counts.started_in_hooks
    return in_hooks + counts.started_at_pass_end


# ---------------------------------------------------------------------- driver
def run_world(args, world: int, tmp: pathlib.Path, address: str) -> dict:
    outs = [tmp / f"w{world}.rank{r}.json" for r in range(world)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python_client"), OMP_NUM_THREADS=str(
        args.threads_per_rank), OPENBLAS_THREAD_TIMEOUT=os.environ.get("OPENBLAS_THREAD_TIMEOUT", "4"))
    common = ["--model", args.model, "--global-batch", str(args.global_batch), "--seq-len",
              str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--chunk-bytes", str(args.chunk_bytes), "--threads-per-rank",
              str(args.threads_per_rank), "--address", address] + (["--ddp"] if args.ddp else []) + (
                  ["--offload-params"] if args.offload_params else [])
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world),
                               str(tmp / f"w{world}.store"), str(outs[r])] + common,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = [p.communicate()[0].decode(errors="replace") for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0 or not out.exists():
            sys.exit(f"dp_bench: rank {r} of {world} failed:\n{logs[r]}")
    ranks = [json.loads(o.read_text()) for o in outs]
    step_s = statistics.mean(ranks[0]["step_s"])
    return {"ranks": world, "per_rank_batch": args.global_batch // world, "step_s": step_s,
            "step_s_all": ranks[0]["step_s"],
            "tokens_per_s": args.global_batch * args.seq_len / step_s,
            "chunks": ranks[0]["chunks"],
            "started_in_backward": [r["started_in_backward"] for r in ranks],
            "rounds_found_ddp": ranks[0]["rounds_found_ddp"],
            "durable_wait_s": [r.get("durable_wait_s") for r in ranks],
            "durable_gates": [r.get("durable_gates") for r in ranks],
            "cores_wanted": world * args.threads_per_rank + args.daemon_threads}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.ddp and args.offload_params:
        sys.exit("dp_bench: --ddp and --offload-params do not go together (DDP does not wrap "
                 "a streamed model)")
    worlds = [int(w) for w in args.ranks.split(",") if w.strip()]
    bad = [w for w in worlds if w < 1 or args.global_batch % w]
    if bad:
        sys.exit(f"dp_bench: --global-batch {args.global_batch} does not split over {bad} ranks")
    if not args.fuyoud or not os.access(args.fuyoud, os.X_OK):
        sys.exit("dp_bench: give --fuyoud PATH (or set FUYOU_DAEMON)")
    os.environ["FUYOU_DAEMON"] = args.fuyoud
    import fuyou
    results = []
    with tempfile.TemporaryDirectory(prefix="dp_bench.") as tmp:
        tmp = pathlib.Path(tmp)
        daemon = fuyou.EmbeddedDaemon(data_dir=str(tmp / "data"),
                                      extra_args=["--threads", str(args.daemon_threads)])
        try:
            for world in worlds:
                results.append(run_world(args, world, tmp, daemon.address))
        finally:
            daemon.stop()
    base = next((r for r in results if r["ranks"] == 1), None)
    for r in results:
        r["speedup"] = base["step_s"] / r["step_s"] if base else None
        r["efficiency"] = r["speedup"] / r["ranks"] if base else None
    report = {"model": args.model, "global_batch": args.global_batch, "seq_len": args.seq_len,
              "threads_per_rank": args.threads_per_rank, "daemon_threads": args.daemon_threads,
              "ddp": args.ddp, "offload_params": args.offload_params, "cpu_count": os.cpu_count(), "results": results}
    print(f"dp_bench: {args.model}, global batch {args.global_batch} x {args.seq_len}, "
          f"{args.threads_per_rank} thread(s) a rank, fuyoud --threads {args.daemon_threads}, "
          f"{'DDP' if args.ddp else 'fuyou reduces'}"
          f"{', streamed' if args.offload_params else ''}, {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'speedup':>8} {'effic.':>7} "
          f"{'cores wanted':>12}")
    for r in results:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        ef = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
        print(f"{r['ranks']:>5} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10,.0f} {sp:>8} "
              f"{ef:>7} {r['cores_wanted']:>12}")
    if any(r["cores_wanted"] > (os.cpu_count() or 1) for r in results):
        print("note: some runs wanted more cores than the machine has; their ranks shared "
              "cores, which bounds the efficiency")
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            pathlib.Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
