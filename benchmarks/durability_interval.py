#!/usr/bin/env python3
"""SSD bytes written per step with the durability interval ([durability]
commit_every_steps N), for a job whose optimizer states fit in fuyoud's DRAM
budget: a private fuyoud per N, one fuyou.AdamW job (an MLP, by default 4.2M
parameters: 50 MB of states, DRAM budget 1 GiB), steps counted after the first
(which registers the chunks and writes their initial states), GetStats
bytes_written before and after, then the close (which makes the last step durable).

    .venv/bin/python benchmarks/durability_interval.py --fuyoud build/daemon/fuyoud \\
        [--intervals 1 10] [--steps 20] [--width 1024] [--layers 4]
"""
import argparse
import os
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
import fuyou  # noqa: E402
from fuyou.daemon import EmbeddedDaemon  # noqa: E402


def run(binary, interval, steps, width, layers, budget):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="fuyou-interval-") as data:
        daemon = EmbeddedDaemon(data_dir=data, binary=binary,
                                extra_args=["--commit-every-steps", str(interval), "--dram-budget", budget])
        try:
            opt = fuyou.AdamW(model.parameters(), lr=1e-3, job=f"interval-{interval}", address=daemon.address,
                              chunk_bytes=4 << 20)
            x = torch.randn(16, width)

            def step():
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()

            step()  # registration: initial states written
            start = fuyou.admin_stats(daemon.address)["bytes_written"]
            for _ in range(steps):
                step()
            during = fuyou.admin_stats(daemon.address)["bytes_written"] - start
            opt.close()
            with_close = fuyou.admin_stats(daemon.address)["bytes_written"] - start
        finally:
            daemon.stop()
    return params, during, with_close


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuyoud", default=str(ROOT / "build" / "daemon" / "fuyoud"))
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dram-budget", default="1GiB")
    args = ap.parse_args()
    print(f"{'N':>4} {'params':>10} {'states MB':>10} {'steps':>6} {'written MB':>11} {'MB/step':>9} "
          f"{'+close MB':>10} {'MB/step incl. close':>20}")
    for interval in args.intervals:
        params, during, with_close = run(args.fuyoud, interval, args.steps, args.width, args.layers,
                                         args.dram_budget)
        print(f"{interval:>4} {params:>10} {params * 12 / 1e6:>10.1f} {args.steps:>6} {during / 1e6:>11.1f} "
              f"{during / args.steps / 1e6:>9.2f} {(with_close - during) / 1e6:>10.1f} "
              f"{with_close / args.steps / 1e6:>20.2f}")


if __name__ == "__main__":
    main()
