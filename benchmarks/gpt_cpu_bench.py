#!/usr/bin/env python3
"""A real PyTorch GPT on the CPU, trained through fuyou.AdamW (optimizer states in a
fuyoud whose DRAM budget is smaller than them, so they stream from the SSD every
step) against torch.optim.AdamW(foreach=True), in one run, steps interleaved.

    .venv/bin/python benchmarks/gpt_cpu_bench.py --fuyoud BUILD/daemon/fuyoud \\
        [--layers 8] [--embd 512] [--heads 8] [--batch 4] [--seq 128] [--steps 5] \\
        [--dram-budget 128MiB] [--chunk-mib 4] [--json out.json]

Three copies of one model, one optimizer each, a step of each in turn:
  torch       torch.optim.AdamW(foreach=True): forward+backward, then step();
  overlapped  fuyou.AdamW(overlap=True): chunks go to the daemon during backward;
  serial      fuyou.AdamW(overlap=False): all updates after backward (ZeRO-Infinity's
              order); its step() time is "optimizer + I/O alone".
Reports step times, tokens/s, overlapped / max(forward+backward alone, optimizer+I/O
alone) and serial / overlapped. On a CPU-only machine backward and the daemon's
updates share the cores: the table shows how much slower forward+backward runs while
the daemon works (overlapped fwd+bwd / torch fwd+bwd). Run with the project's venv (.venv/bin/python).
"""
import argparse
import copy
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
sys.path.insert(0, str(ROOT / "python_client" / "examples"))
import fuyou  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuyoud", default=os.environ.get("FUYOU_DAEMON"),
                    help="fuyoud binary (default $FUYOU_DAEMON)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each variant")
    ap.add_argument("--dram-budget", default="128MiB")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="MiB of fp32 weights a chunk")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json")
    return ap.parse_args()


def main():
    args = parse_args()
    if not args.fuyoud or not os.access(args.fuyoud, os.X_OK):
        sys.exit("gpt_cpu_bench: give --fuyoud PATH (or set FUYOU_DAEMON)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    base = GPT(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    tokens = args.batch * args.seq
    data = [torch.randint(0, 256, (args.batch, args.seq + 1)) for _ in range(4)]

    with tempfile.TemporaryDirectory(prefix="gpt-cpu-bench-") as tmp:
        daemon = fuyou.EmbeddedDaemon(data_dir=os.path.join(tmp, "data"),
                                      extra_args=["--dram-budget", args.dram_budget,
                                                  "--log-level", "warn"],
                                      binary=args.fuyoud)
        try:
            models = {k: copy.deepcopy(base) for k in ("torch", "overlapped", "serial")}
            chunk_bytes = int(args.chunk_mib * (1 << 20))
            opts = {
                "torch": torch.optim.AdamW(models["torch"].parameters(), lr=1e-4, foreach=True),
                "overlapped": fuyou.AdamW(models["overlapped"].parameters(), lr=1e-4,
                                          job="gpt-bench-overlapped", address=daemon.address,
                                          chunk_bytes=chunk_bytes, overlap=True, timeout=300),
                "serial": fuyou.AdamW(models["serial"].parameters(), lr=1e-4,
                                      job="gpt-bench-serial", address=daemon.address,
                                      chunk_bytes=chunk_bytes, overlap=False, timeout=300),
            }
            print(f"gpt_cpu_bench: GPT {args.layers}x{args.embd} ({n_params / 1e6:.1f}M params, "
                  f"{12 * n_params / 2**20:.0f} MiB of fp32 states), batch {args.batch}x{args.seq}"
                  f" = {tokens} tokens, torch {torch.__version__} with {torch.get_num_threads()}"
                  f" threads; fuyoud budget {args.dram_budget}, "
                  f"{opts['overlapped'].num_chunks} chunks", flush=True)
            times = {k: {"fwd_bwd": [], "step": [], "total": []} for k in opts}
            for i in range(args.steps + 1):  # step 0 warms up
                batch = data[i % len(data)]
                x, y = batch[:, :-1], batch[:, 1:]
                for name in ("torch", "overlapped", "serial"):
                    model, opt = models[name], opts[name]
                    t0 = time.perf_counter()
                    _, loss = model(x, y)
                    loss.backward()
                    t1 = time.perf_counter()
                    opt.step()
                    t2 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    if i > 0:
                        times[name]["fwd_bwd"].append(t1 - t0)
                        times[name]["step"].append(t2 - t1)
                        times[name]["total"].append(t2 - t0)
                print(f"  step {i}{' (warm-up)' if i == 0 else ''}: " + ", ".join(
                    f"{k} {times[k]['total'][-1]:.3f} s" for k in times if i > 0) , flush=True)
            # Same weights? (the three optimizers must agree to float tolerance)
            w = {k: torch.cat([p.detach().flatten() for p in models[k].parameters()])
                 for k in models}
            max_diff = max(float((w["overlapped"] - w["torch"]).abs().max()),
                           float((w["serial"] - w["torch"]).abs().max()))
            stats = fuyou.admin_stats(daemon.address) if hasattr(fuyou, "admin_stats") else None
            for k in ("overlapped", "serial"):
                opts[k].close()
        finally:
            daemon.stop()

    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    fwd_bwd_alone = med["torch"]["fwd_bwd"]
    opt_alone = med["serial"]["step"]
    overlapped = med["overlapped"]["total"]
    serial = med["serial"]["total"]
    ratio = overlapped / max(fwd_bwd_alone, opt_alone)
    print(f"\n{'variant':<12} {'fwd+bwd s':>10} {'step() s':>9} {'total s':>8} {'tokens/s':>9}")
    for k in ("torch", "overlapped", "serial"):
        print(f"{k:<12} {med[k]['fwd_bwd']:>10.3f} {med[k]['step']:>9.3f} {med[k]['total']:>8.3f}"
              f" {tokens / med[k]['total']:>9.0f}")
    print(f"\nforward+backward alone (torch run) {fwd_bwd_alone:.3f} s; fuyou optimizer+I/O alone"
          f" (serial step()) {opt_alone:.3f} s")
    print(f"overlapped / max(fwd+bwd, optimizer+I/O) = {ratio:.3f}; serial / overlapped = "
          f"{serial / overlapped:.2f}x; overlapped / torch = {overlapped / med['torch']['total']:.2f}")
    print(f"sharing the cores: fwd+bwd is {med['overlapped']['fwd_bwd'] / fwd_bwd_alone:.2f}x slower"
          f" while the daemon updates during it; max |w - w_torch| = {max_diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpt_cpu_bench", "params": n_params, "tokens_per_step": tokens,
                       "config": vars(args), "torch_threads": torch.get_num_threads(),
                       "median_seconds": med, "samples": times,
                       "fwd_bwd_alone_s": fwd_bwd_alone, "optimizer_io_alone_s": opt_alone,
                       "overlapped_over_max": ratio, "speedup_over_serial": serial / overlapped,
                       "overlapped_over_torch": overlapped / med["torch"]["total"],
                       "fwd_bwd_slowdown_when_shared": med["overlapped"]["fwd_bwd"] / fwd_bwd_alone,
                       "max_abs_weight_diff_vs_torch": max_diff,
                       "tokens_per_s": {k: tokens / med[k]["total"] for k in med}}, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
